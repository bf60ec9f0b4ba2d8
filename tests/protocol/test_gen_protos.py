"""The committed generated code is what scripts/gen_protos.py produces, and --check notices drift."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"


@pytest.mark.timeout(60)
def test_committed_code_is_up_to_date() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


@pytest.mark.timeout(60)
def test_check_detects_stale_code(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_protos", SCRIPT)
    assert spec is not None and spec.loader is not None
    gen_protos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_protos)
    fresh = tmp_path / "fresh"
    gen_protos.generate(fresh)
    committed = tmp_path / "committed"
    shutil.copytree(fresh, committed)
    assert gen_protos.stale_files(committed, fresh) == []
    grpc_module = next(committed.rglob("*_pb2_grpc.py"))
    grpc_module.write_text(grpc_module.read_text() + "\n# edited by hand\n")
    (committed / "dtnode" / "v1" / "extra_pb2.py").write_text("")
    stale = gen_protos.stale_files(committed, fresh)
    assert str(grpc_module.relative_to(committed)) in stale and "dtnode/v1/extra_pb2.py" in stale


def test_generated_imports_are_package_absolute() -> None:
    text = (REPO_ROOT / "protocol" / "gen" / "dtnode" / "v1" / "allreduce_pb2_grpc.py").read_text()
    assert "from protocol.gen.dtnode.v1 import allreduce_pb2" in text
    assert "from dtnode.v1" not in text
