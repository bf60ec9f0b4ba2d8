"""dtnode's node: the machine that trains one model replica (model, data, DiLoCo, checkpoints, CLI)."""

__version__ = "0.1.0"
