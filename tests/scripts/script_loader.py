"""Import a file of ``scripts/`` by its bare name, as the module its siblings import (``scripts.bench.x``)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
ROLE_FOLDERS = ("bench", "tools", "workers")


def script_path(name: str) -> Path:
    """``scripts/<role>/<name>.py``: the file to run with ``python``."""
    found = [SCRIPTS_DIR / folder / f"{name}.py" for folder in ROLE_FOLDERS]
    found = [path for path in found if path.is_file()]
    assert len(found) == 1, f"{name}.py in {found or 'no folder'} of {SCRIPTS_DIR}"
    return found[0]


def load_script(name: str) -> ModuleType:
    """The module ``scripts.<role>.<name>``, the same object the other scripts import."""
    return importlib.import_module(f"scripts.{script_path(name).parent.name}.{name}")
