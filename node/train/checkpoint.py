"""Crash-safe checkpoints: tensors in safetensors, everything else in JSON, never a pickle.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-<S>/`` with

- ``tensors.safetensors``: every tensor of the node's state, keyed by its path in the state tree
  (``/model/layers.0.attention.wq.weight``, ``/inner_optimizer/state/3/exp_avg`` …);
- ``state.json``: the rest of the tree with ``{"__tensor__": key}`` where a tensor stood, plus
  ``meta`` (round, step, param_hash …).

Atomicity: both files are written into ``step-<S>.tmp-<pid>``, fsynced, and the directory is renamed
into place (``rename`` is atomic on POSIX); then ``LATEST`` is replaced atomically with the new
name. A crash at any point leaves the previous ``LATEST`` and the checkpoint it names intact;
half-written ``.tmp-*`` directories are removed at the next save. A save under a name already on
disk writes nothing if that checkpoint's meta (but its ``time``) is the same, and replaces it
otherwise (a crash before ``LATEST`` moved can leave such a directory behind). Loading reads ``LATEST`` and
verifies that every referenced tensor is present.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

LATEST = "LATEST"
TENSOR_TAG = "__tensor__"
TUPLE_TAG = "__tuple__"


def split_state(tree: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Replace every tensor in a nested dict/list tree by a reference; return (json_tree, tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    return _split(tree, prefix, tensors), tensors


def _split(node: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """split_state's walk. A module-level function, not a closure: a recursive closure is a reference
    cycle (function -> cell -> function) that would keep every saved state alive until the cyclic
    garbage collector happens to run (a node's memory grew by a state per round)."""
    if isinstance(node, torch.Tensor):
        if path in tensors:  # e.g. {"a/b": x, "a": {"b": y}}, or keys 1 and "1" side by side
            raise ValueError(f"two tensors would be stored under the same key {path!r}")
        tensors[path] = node.detach().to("cpu").contiguous()
        return {TENSOR_TAG: path}
    if isinstance(node, dict):
        for key in node:
            # JSON keeps str and int keys apart only because items are stored as pairs; any other
            # key type would save but never load again.
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise TypeError(f"cannot checkpoint a dict key of type {type(key).__name__} at {path or '/'}")
        return {"__dict__": [[key, _split(value, f"{path}/{key}", tensors)] for key, value in node.items()]}
    if isinstance(node, tuple):
        return {TUPLE_TAG: [_split(value, f"{path}/{i}", tensors) for i, value in enumerate(node)]}
    if isinstance(node, list):
        return [_split(value, f"{path}/{i}", tensors) for i, value in enumerate(node)]
    if node is None or isinstance(node, bool | int | float | str):
        return node
    raise TypeError(f"cannot checkpoint a {type(node).__name__} at {path or '/'}")


def join_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`."""
    if isinstance(tree, dict):
        if TENSOR_TAG in tree:
            key = tree[TENSOR_TAG]
            if key not in tensors:
                raise ValueError(f"checkpoint is missing tensor {key}")
            return tensors[key]
        if TUPLE_TAG in tree:
            return tuple(join_state(value, tensors) for value in tree[TUPLE_TAG])
        # Dict keys may be ints (optimizer state is keyed by parameter index): JSON keeps them typed
        # because items are stored as [key, value] pairs.
        return {key: join_state(value, tensors) for key, value in tree["__dict__"]}
    if isinstance(tree, list):
        return [join_state(value, tensors) for value in tree]
    return tree


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def save_checkpoint(root: Path, name: str, state: dict[str, Any], meta: dict[str, Any], *, keep: int) -> Path:
    """Write ``state`` atomically as checkpoint ``name`` under ``root`` and point LATEST at it."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / name
    if (final / "state.json").is_file() and _identity(_stored_meta(final)) == _identity(meta):
        # Checkpoints are named by inner step; the same name and meta (round, param_hash…) means
        # the same state, already on disk. (A complete directory with other meta is one a crash
        # left before LATEST named it; a swarm may have averaged that round differently since.)
        _point_latest(root, name)
        return final
    json_tree, tensors = split_state(state)
    # safetensors refuses tensors that share storage; clone the (rare) aliases.
    seen: set[int] = set()
    for key, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen and tensor.numel():
            tensors[key] = tensor.clone()
        seen.add(pointer)
    tmp = root / f"{name}.tmp-{os.getpid()}"
    tmp.mkdir()
    save_file(tensors, str(tmp / "tensors.safetensors"))
    with open(tmp / "tensors.safetensors", "rb+") as handle:
        os.fsync(handle.fileno())
    _write_durable(tmp / "state.json", json.dumps({"meta": meta, "state": json_tree}).encode())
    _fsync_dir(tmp)
    if final.exists():  # incomplete, or another state under this name: LATEST never names it
        stale = root / f"{name}.tmp-stale-{os.getpid()}"  # a leftover if we die before removing it
        os.rename(final, stale)
        shutil.rmtree(stale)
    os.rename(tmp, final)
    _point_latest(root, name)
    _prune(root, keep=keep, current=name)
    return final


def _identity(meta: Any) -> Any:
    """What names a state in a checkpoint's meta: all of it but the wall-clock ``time`` it was written."""
    return {k: v for k, v in meta.items() if k != "time"} if isinstance(meta, dict) else meta


def _stored_meta(directory: Path) -> Any:
    """The ``meta`` of a complete checkpoint directory (None if its state.json cannot be read)."""
    try:
        return json.loads((directory / "state.json").read_text())["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _point_latest(root: Path, name: str) -> None:
    latest_tmp = root / f"{LATEST}.tmp-{os.getpid()}"
    _write_durable(latest_tmp, name.encode())
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _remove_leftovers(root: Path) -> None:
    """Delete what crashed saves and prunes left: ``*.tmp-*`` files and dirs, dirs without state.json."""
    for path in root.iterdir():
        incomplete_dir = path.is_dir() and not (path / "state.json").exists()
        if ".tmp-" in path.name or incomplete_dir:
            _remove(path)


def _prune(root: Path, *, keep: int, current: str) -> None:
    complete = sorted(
        (p for p in root.iterdir() if p.is_dir() and ".tmp-" not in p.name and (p / "state.json").exists()),
        key=lambda p: p.name,  # names embed the zero-padded step: name order is age order
    )
    for old in complete[:-keep]:
        if old.name != current:
            # Rename first: a crash mid-delete then leaves a .tmp- dir that the next save sweeps away,
            # never a half-deleted checkpoint that looks real.
            doomed = old.with_name(f"{old.name}.tmp-{os.getpid()}")
            os.rename(old, doomed)
            shutil.rmtree(doomed)


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def checkpoint_meta(path: Path) -> dict[str, Any] | None:
    """The ``meta`` of checkpoint directory ``path`` without its tensors (None if unreadable)."""
    meta = _stored_meta(path)
    return meta if isinstance(meta, dict) else None


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (state, meta) of the checkpoint directory ``path``."""
    document = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "tensors.safetensors"))
    return join_state(document["state"], tensors), document["meta"]
