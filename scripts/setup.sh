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
# What is installed is byte-compiled: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines), Python never caches what it compiles, and without .pyc files every process would compile
# torch's sources again at each import. pip compiles on one core (~45 CPU-s of its ~75 s here);
# compileall does it on all cores afterwards (2 cores, a fresh venv: the whole setup 100 s -> 75 s).
pip=("$venv/bin/python" -m pip install --no-compile --quiet --disable-pip-version-check)

if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: CUDA device found: installing torch with CUDA"
    "${pip[@]}" ${DTNODE_TORCH_PIP_ARGS:-} torch
  else
    echo "setup: no CUDA device: installing torch==2.13.0 (CPU build)"
    "${pip[@]}" ${DTNODE_TORCH_PIP_ARGS:-} torch==2.13.0
  fi
fi
"${pip[@]}" -e ".[dev,hf]"
# Files that do not compile (a package's deliberately broken test data) are skipped, as pip skips them.
"$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
"$venv/bin/python" -c 'import torch, hivemind, grpc, node, protocol; print(f"setup: ok: torch {torch.__version__}, hivemind {hivemind.__version__}, grpc {grpc.__version__}")'
