"""scripts/common.py: the output flags, scratch directories, JSON out, SIGTERM as an exit; and every
script run as a file can import its siblings (the sys.path line comes before them)."""

from __future__ import annotations

import argparse
import ast
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts import common
from tests.scripts.script_loader import ROLE_FOLDERS, SCRIPTS_DIR

BOOTSTRAP = "sys.path.insert(0, str(Path(__file__).resolve().parents[2]))"


def test_repo_root_is_the_checkout() -> None:
    assert (common.REPO_ROOT / "pyproject.toml").is_file()
    assert common.REPO_ROOT == SCRIPTS_DIR.parent


def test_output_flags() -> None:
    parser = argparse.ArgumentParser()
    common.add_output_flags(parser, keep_logs=True)
    args = parser.parse_args(["--json-out", "a.json", "--keep-logs", "logs"])
    assert args.json_out == Path("a.json") and args.keep_logs == Path("logs")
    assert parser.parse_args([]).json_out is None and parser.parse_args([]).keep_logs is None
    bare = argparse.ArgumentParser()
    common.add_output_flags(bare)
    with pytest.raises(SystemExit):
        bare.parse_args(["--keep-logs", "logs"])


def test_scratch_dir_is_kept_under_keep_logs_or_removed(tmp_path: Path) -> None:
    with common.scratch_dir(tmp_path / "logs", "run-1", prefix="t-") as kept:
        assert kept == tmp_path / "logs" / "run-1" and kept.is_dir()
        (kept / "node.log").write_text("x")
    assert (tmp_path / "logs" / "run-1" / "node.log").read_text() == "x"
    with common.scratch_dir(None, "run-1", prefix="t-") as scratch:
        assert scratch.is_dir() and scratch.name.startswith("t-")
    assert not scratch.exists()


def test_json_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common.print_json({"a": 1, "b": [2, 3]})
    assert capsys.readouterr().out == '{"a": 1, "b": [2, 3]}\n'
    common.write_json(tmp_path / "out.json", [{"a": 1}])
    assert json.loads((tmp_path / "out.json").read_text()) == [{"a": 1}]
    common.write_json(None, [{"a": 1}])  # no --json-out: nothing written, no error


@pytest.mark.timeout(60)
def test_sigterm_unwinds_finally_blocks(tmp_path: Path) -> None:
    marker = tmp_path / "cleaned"
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(SCRIPTS_DIR.parent)!r})
        from scripts.common import exit_on_sigterm
        exit_on_sigterm()
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            open({str(marker)!r}, "w").close()
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.exists()


def _run_as_files() -> list[Path]:
    return sorted(
        path
        for folder in ROLE_FOLDERS
        for path in (SCRIPTS_DIR / folder).glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    )


@pytest.mark.parametrize("path", _run_as_files(), ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_script_run_as_a_file_sets_sys_path_before_importing_scripts(path: Path) -> None:
    tree = ast.parse(path.read_text())
    statements = list(tree.body)
    imports = [
        i
        for i, s in enumerate(statements)
        if isinstance(s, ast.ImportFrom) and (s.module or "").startswith("scripts")
    ]
    if not imports:
        return
    bootstrap = [i for i, s in enumerate(statements) if ast.unparse(s) == BOOTSTRAP]
    assert bootstrap and bootstrap[0] < imports[0], f"{path}: {BOOTSTRAP} must come before `from scripts...`"


@pytest.mark.timeout(60)
def test_a_script_starts_from_another_directory(tmp_path: Path) -> None:
    # bench_allreduce imports from bench/, tools/ and common: its --help proves they resolve by path.
    script = SCRIPTS_DIR / "bench" / "bench_allreduce.py"
    completed = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=50
    )
    assert completed.returncode == 0, completed.stderr
    assert "--json-out" in completed.stdout and "--keep-logs" in completed.stdout
