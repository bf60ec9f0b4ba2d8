"""One forkserver per test process, shared by the helpers that fork processes from it.

A fresh interpreter spends ~1.3 CPU-seconds importing torch alone, more with gRPC, the node and
torch.distributed: more than many tests' own work. multiprocessing's forkserver imports such modules
once per test process (it starts no thread of its own, so forking it is safe) and forks each process
from it; each is still a process of its own, with its own sockets and signals. The server's preload
list is global and read when it starts, so every helper adds its modules to it rather than replacing
it; a module missing from it (the server already ran) is imported in the child instead.

The server imports ``scripts.forkserver_gc`` last, which freezes what the imports made (``gc.freeze``):
a forked child's garbage collections then never walk the preloaded modules' objects (nor copy their
memory pages by touching them), ~0.5 CPU-s less per forked node of the swarm tests.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

FREEZE_MODULE = "scripts.forkserver_gc"
"""Imported by the server after every other module of its preload (in list order): it freezes them."""


def forkserver(preload: Iterable[str]) -> multiprocessing.context.ForkServerContext:
    """The forkserver context, with ``preload`` added to the modules it imports when it starts."""
    context = multiprocessing.get_context("forkserver")
    asked = getattr(multiprocessing.forkserver._forkserver, "_preload_modules", None) or []
    context.set_forkserver_preload([*sorted({*asked, *preload} - {FREEZE_MODULE}), FREEZE_MODULE])
    return context


def enter_child(env: Mapping[str, str], cwd: Path | str, stdout: Path | str, stderr: Path | str) -> None:
    """In a forked child: the environment the test process had at the fork (not the server's from its
    start), ``cwd``, and stdout / stderr written to files (one file opened once when they are the same),
    line-buffered as ``PYTHONUNBUFFERED`` would leave them."""
    os.environ.clear()
    os.environ.update(env)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    if str(stdout) == str(stderr):
        shared = os.open(stdout, flags, 0o644)
        targets = [(1, shared), (2, shared)]
    else:
        targets = [(1, os.open(stdout, flags, 0o644)), (2, os.open(stderr, flags, 0o644))]
    for fd, target in targets:
        os.dup2(target, fd)
    for target in {target for _, target in targets}:
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.chdir(cwd)
