#!/usr/bin/env bash
# Make a virtualenv and install dtnode into it.
#
#   bash scripts/setup.sh            # venv in ./.venv (or $DTNODE_VENV), with the dev tools and
#                                    # the Hugging Face extra (dtnode[hf]: transformers, tokenizers, datasets)
#
# On a machine without a CUDA device, torch's CPU build (torch==2.13.0) is installed first, so pip
# does not pull a multi-GB CUDA build. A GPU user who already has a CUDA torch in the venv keeps it.
# Extra pip options for torch (e.g. an index of CPU wheels) can be passed in $DTNODE_TORCH_PIP_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DTNODE_VENV:-.venv}"
python="${PYTHON:-python3}"

"$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dtnode needs Python >= 3.11")'
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# Installs go through uv (https://docs.astral.sh/uv/), pip's faster drop-in: on 2 cores, a fresh venv's
# torch + dtnode[dev,hf] take ~11 s instead of pip's ~41 s. uv does not read pip's configuration, so
# pip's find-links and constraint files (this project's machines keep torch's CPU wheel and a torch cap
# there) are handed to it. Should uv not install or fail, pip does the same install.
pip=("$venv/bin/python" -m pip install --no-compile --quiet --disable-pip-version-check)
"${pip[@]}" uv >/dev/null 2>&1 || true
uv_flags=()
while IFS= read -r line; do
  key=${line%%=*}; value=${line#*=}; value=${value#\'}; value=${value%\'}
  case "$key" in
    *.find-links) for link in $value; do uv_flags+=(--find-links "$link"); done ;;
    *.constraint) for file in $value; do [ -f "$file" ] && uv_flags+=(--constraint "$file"); done ;;
  esac
done < <("$venv/bin/python" -m pip config list 2>/dev/null || true)
install() {
  if [ -x "$venv/bin/uv" ] && "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" "${uv_flags[@]}" "$@"; then
    return 0
  fi
  "${pip[@]}" "$@"
}

if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: CUDA device found: installing torch with CUDA"
    install ${DTNODE_TORCH_PIP_ARGS:-} torch
  else
    echo "setup: no CUDA device: installing torch==2.13.0 (CPU build)"
    install ${DTNODE_TORCH_PIP_ARGS:-} torch==2.13.0
  fi
fi
install -e ".[dev,hf]"
# Where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) Python caches no .pyc, and every
# process would compile torch's sources again at each import (seconds per node). Importing every module
# of dtnode once with caching on compiles what a node imports (~10 s on 2 cores), not the whole
# site-packages (compileall: ~45 CPU-s, mostly modules dtnode never loads).
PYTHONDONTWRITEBYTECODE= "$venv/bin/python" - <<'PY'
import importlib, pkgutil
import node, protocol
for package in (node, protocol):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
PY
"$venv/bin/python" -c 'import torch, hivemind, grpc, node, protocol; print(f"setup: ok: torch {torch.__version__}, hivemind {hivemind.__version__}, grpc {grpc.__version__}")'
