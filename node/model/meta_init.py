"""Build the model on the meta device and materialize it on its own device, bit-identical to a CPU build.

``GPT(config)`` on CPU allocates every parameter in host memory, fills it with torch's default
initialisation (drawn from the global RNG), then ``init_weights`` draws the seed of the real
initialisation from that RNG and overwrites every value; ``.to(device)`` then copies it all. Here:

    Phase 1: construct under ``torch.device("meta")``: shapes only, no memory. The default
             initialisers' draws are *replayed* on a scratch CPU tensor of each parameter's shape
             (one at a time), so the global RNG advances exactly as in a CPU build and
             ``init_weights`` draws the same seed (``GPT.init_seed``);
    Phase 2: ``to_empty(device)``: allocate the parameters where they will live;
    Phase 3: ``init_weights(init_seed)``: every parameter from (seed, name), as in a CPU build.

So the model, and torch's RNG state after it, are those of ``GPT(config).to(device)`` for the same
``torch.manual_seed``, with one parameter's worth of scratch host memory instead of the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from node.model.gpt import GPT, ModelConfig

aten = torch.ops.aten
# The in-place random fills under nn.init's initialisers (uniform_, normal_, trunc_normal_ …).
_RANDOM_FILLS = frozenset(
    {
        aten.uniform_.default, aten.normal_.default, aten.random_.default, aten.random_.to,
        getattr(aten.random_, "from"), aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.exponential_.default,
        aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default,
    }
)  # fmt: skip


class ReplayRandomFills(TorchDispatchMode):
    """Runs each random fill of a meta tensor on a CPU scratch tensor of its shape and dtype as well,
    so the global CPU RNG advances as if the tensor were real (a meta fill draws nothing)."""

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            scratch = torch.empty(args[0].shape, dtype=args[0].dtype, device="cpu")
            func(scratch, *args[1:], **kwargs)
        return func(*args, **kwargs)


def build_model(config: ModelConfig, device: torch.device) -> GPT:
    """``GPT(config).to(device)``, built on the meta device (see the module docstring)."""
    with torch.device("meta"), ReplayRandomFills():
        model = GPT(config)
    model.to_empty(device=device)  # new tensors, one per module: a tied weight comes apart
    if config.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight
    model.init_weights(model.init_seed)
    return model
