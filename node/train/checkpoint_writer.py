"""Checkpoints written in the background: the training loop pays for a host copy, not for the disk.

A save has two halves:

    Phase 1 (training thread): snapshot the state into host memory — every tensor copied (into
             pinned buffers, asynchronously, from a GPU; one device sync for all of them), the rest
             of the tree rebuilt; except the tensors handed over as *owned*: the round's one host
             copy of the global state, shared with the served snapshot (``node/train/round_end.py``).
             After this the loop may change its params at will.
    Phase 2 (writer thread):   the param_hash of the snapshot's global params, then
             ``node.train.checkpoint.save_checkpoint`` — the same atomic, crash-safe write as before
             (temporary directory, fsync, rename, LATEST), so a crash mid-write still leaves the
             previous checkpoint named by LATEST.

At most one write is in flight: a save due while the previous one is still writing waits for it first
(so checkpoints land in step order and the directory never sees two writers), and so does closing.
The loop :meth:`CheckpointWriter.poll`\\ s at step boundaries: a finished write is logged there, and a
write that failed raises there, on the training thread (background work is a future polled by the
loop, never a callback into it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.outer.state import tensor_hash
from node.train.checkpoint import join_state, save_checkpoint

log = logging.getLogger("dtnode")

GLOBAL_PARAMS = ("outer", "global_params")  # where the trainer's state tree holds the global params


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` that nothing else references (pinned and asynchronous from a GPU)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    target = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    return target.copy_(tensor, non_blocking=True)


def snapshot_state(state: Any, owned: Collection[torch.Tensor] = ()) -> Any:
    """The state tree with every tensor replaced by a host copy; lists, tuples and dicts rebuilt.
    The tensors in ``owned`` are taken as they are: host copies already, which nobody writes to
    (``node.outer.host_copy.HostGlobalState`` and views of it)."""
    tensors: dict[str, torch.Tensor] = {}
    json_tree = _snapshot(state, "", tensors, frozenset(id(tensor) for tensor in owned))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
    return join_state(json_tree, tensors)


def _snapshot(node: Any, path: str, tensors: dict[str, torch.Tensor], owned: frozenset[int]) -> Any:
    """``node.train.checkpoint.split_state``'s tree, but tensors are copied unless ``owned`` (a module
    function: no closure cycle)."""
    if isinstance(node, torch.Tensor):
        tensors[path] = node if id(node) in owned else host_copy(node)
        return {"__tensor__": path}
    if isinstance(node, dict):
        return {
            "__dict__": [
                [key, _snapshot(value, f"{path}/{key}", tensors, owned)] for key, value in node.items()
            ]
        }
    if isinstance(node, tuple):
        return {
            "__tuple__": [_snapshot(value, f"{path}/{i}", tensors, owned) for i, value in enumerate(node)]
        }
    if isinstance(node, list):
        return [_snapshot(value, f"{path}/{i}", tensors, owned) for i, value in enumerate(node)]
    return node  # immutable leaves (None, bool, int, float, str); anything else fails in the write


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint the writer finished: where it is and what it names."""

    path: Path
    meta: dict[str, Any]


class CheckpointWriter:
    """Writes the trainer's checkpoints under ``root`` on one background thread (see the module docstring).

    ``write`` is the function that puts one checkpoint on disk (``save_checkpoint``'s signature);
    tests pass one that blocks, to show the loop goes on meanwhile.
    """

    def __init__(self, root: Path, *, keep: int, write: Callable[..., Path] | None = None) -> None:
        self.root = root
        self.keep = keep
        self._write = write
        self._executor: ThreadPoolExecutor | None = None  # started by the first write (again after close)
        self._pending: Future[SavedCheckpoint] | None = None
        self._lock = threading.Lock()  # submit/poll/wait may come from the loop and from its exit path

    @property
    def in_flight(self) -> bool:
        """A write was submitted and has not been collected by :meth:`poll` or :meth:`wait`."""
        return self._pending is not None

    def submit(
        self, name: str, state: dict[str, Any], meta: dict[str, Any], *, owned: Collection[torch.Tensor] = ()
    ) -> None:
        """Snapshot ``state`` now (Phase 1) and write it as checkpoint ``name`` in the background.

        ``meta`` is completed with ``param_hash`` (of the snapshot's global params) by the writer.
        ``owned``: tensors of ``state`` that are host copies already (not copied again, see
        :func:`snapshot_state`). Waits for the previous write first, if one is still going.
        """
        self.wait()
        snapshot = snapshot_state(state, owned)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
            self._pending = self._executor.submit(self._save, name, snapshot, dict(meta))

    def _save(self, name: str, snapshot: dict[str, Any], meta: dict[str, Any]) -> SavedCheckpoint:
        """Phase 2, on the writer thread."""
        global_params = snapshot[GLOBAL_PARAMS[0]][GLOBAL_PARAMS[1]]
        meta["param_hash"] = tensor_hash(global_params)
        write = self._write or save_checkpoint  # looked up now: a crash test may wrap the module's function
        path = write(self.root, name, snapshot, meta, keep=self.keep)
        return SavedCheckpoint(path=path, meta=meta)

    def poll(self) -> SavedCheckpoint | None:
        """The write that finished since the last call (None if none, or still writing); re-raises
        what a failed write raised."""
        with self._lock:
            pending = self._pending
            if pending is None or not pending.done():
                return None
            self._pending = None
        return self._collect(pending)

    def wait(self) -> SavedCheckpoint | None:
        """Block until the write in flight (if any) is on disk; returns it, or raises what it raised."""
        with self._lock:
            pending, self._pending = self._pending, None
        return None if pending is None else self._collect(pending)

    @staticmethod
    def _collect(pending: Future[SavedCheckpoint]) -> SavedCheckpoint:
        saved = pending.result()  # a disk full or a permission error surfaces here, on the caller's thread
        meta = saved.meta
        log.info(
            "checkpoint %s (round %d, step %d, param_hash %s)",
            saved.path, meta["round"], meta["step"], meta["param_hash"][:12],
        )  # fmt: skip
        return saved

    def close(self) -> None:
        """Wait for the write in flight, then stop the thread (a later submit starts another)."""
        try:
            self.wait()
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
