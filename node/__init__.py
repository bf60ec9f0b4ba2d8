"""dtnode's node: the machine that trains one model replica (model, data, DiLoCo, checkpoints, CLI)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from node.model.gpt import GPT

__version__ = "0.1.0"


def load_model(run_dir: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> GPT:
    """The model a run exported (``RUN_DIR/model.safetensors``, or a swarm dir's node), in eval mode.

    See ``node/model/export.py``. Imported lazily: ``import node`` (e.g. ``dtnode --help``) stays free of torch.
    """
    from node.model.export import load_model as load_exported_model

    return load_exported_model(run_dir, device=device)
