"""A real short training run for the tests that read what a run leaves behind (export, report).

``train_short_run`` trains the nano preset for two DiLoCo rounds of H=3 inner steps (a few seconds)
on a corpus of Python source, without a swarm, and returns the finished ``Trainer``; its run dir
then holds the metrics, the checkpoint and the exported model. ``one_torch_thread`` keeps such
tiny forwards on one intra-op thread.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from node.train.trainer import Trainer
from tests.node.train.test_trainer import small_config


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread inside: tiny steps are faster that way, and kinder to a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def write_corpus(directory: Path) -> Path:
    """A text file of real Python source (``inspect``'s, twice) in ``directory``; its path."""
    path = directory / "text.txt"
    path.write_text(inspect.getsource(inspect) * 2)
    return path


def train_short_run(corpus_file: Path, run_dir: Path) -> Trainer:
    """Two rounds of H=3 on the nano preset, without a swarm, into ``run_dir``, both evaluated; the
    finished trainer."""
    trainer = Trainer(small_config(corpus_file, run_dir, max_rounds=2, swarm=False, eval_every=1))
    trainer.run()
    return trainer
