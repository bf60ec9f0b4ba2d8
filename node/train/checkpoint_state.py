"""What a node's checkpoint holds, and loading it back: the trainer's state tree.

    {"model": the replica's module state, "inner_optimizer": AdamW's state (if the replica has one),
     "outer": DiLoCo's global params and outer SGD state, "data": the batches' position,
     "rng": torch's CPU RNG, "swarm": what one round carries into the next (the codec's residual)}

The tree is built at a round's end from the round's one host copy of the global state
(``node.outer.host_copy.HostGlobalState``): the outer entry is made of it, and when the model holds θ_global
(after a synchronous outer step or an adoption) so are the model's parameters (views). Those
tensors are returned as *owned* so that the background writer (``node/train/checkpoint_writer.py``) takes
them as they are instead of copying them again; everything else is copied by the writer's snapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from node.config import ConfigError
from node.model.replica import Replica, SingleReplica
from node.outer.host_copy import HostGlobalState, model_state_as_views, outer_checkpoint_state
from node.train.checkpoint import load_checkpoint

if TYPE_CHECKING:
    from node.data.batches import ShardedBatches
    from node.outer.diloco import DiLoCo
    from node.outer.seam import SwarmSide


def checkpoint_state(
    *,
    replica: Replica,
    diloco: DiLoCo,
    batches: ShardedBatches,
    swarm: SwarmSide | None,
    host: HostGlobalState,
    model_is_global: bool,
) -> tuple[dict[str, Any], list[Tensor]]:
    """The state tree (see the module docstring) and its tensors that are ``host``'s or views of it."""
    model_state = replica.model_state()
    if model_is_global and isinstance(replica, SingleReplica):
        model_state = model_state_as_views(model_state, diloco.params, host.params)
    optimizer_state = replica.optimizer_state()
    carried = swarm.state_dict() if swarm is not None else {}
    state = {
        "model": model_state,
        **({} if optimizer_state is None else {"inner_optimizer": optimizer_state}),
        "outer": outer_checkpoint_state(diloco, host),
        "data": batches.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        **({"swarm": carried} if carried else {}),
    }
    storage = host.params.untyped_storage().data_ptr()
    owned = [host.params, *([] if host.momentum is None else [host.momentum])]
    owned += [t for t in model_state.values() if t.untyped_storage().data_ptr() == storage]
    return state, owned


def restore_state(
    path: Path,
    *,
    replica: Replica,
    diloco: DiLoCo,
    batches: ShardedBatches,
    corpus_sha256: str,
    model_name: str,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Load checkpoint ``path`` into the replica, DiLoCo, the batches and torch's RNG; returns its meta
    and the swarm's part (loaded by the swarm session once it has started). ``ConfigError`` if it
    was trained on another corpus or does not fit the model; ``RuntimeError`` if the loaded params do
    not hash to the saved param_hash."""
    state, meta = load_checkpoint(path)
    if meta["corpus_sha256"] != corpus_sha256:
        raise ConfigError(
            f"{path} was trained on corpus {meta['corpus_sha256'][:12]}, this run reads {corpus_sha256[:12]}; "
            "use the same --data and --tokenizer or a new --run-dir"
        )
    try:
        replica.load_model_state(state["model"])
        diloco.load_state_dict(state["outer"])
    except (RuntimeError, ValueError) as error:
        raise ConfigError(f"{path} does not fit model {model_name!r}: {str(error).splitlines()[0]}") from None
    if "inner_optimizer" in state:
        replica.load_optimizer_state(state["inner_optimizer"])
    batches.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["torch"])
    if diloco.param_hash() != meta["param_hash"]:
        raise RuntimeError(f"{path}: restored params do not match the saved param_hash")
    return meta, state.get("swarm", {})
