"""Held-out eval off the training thread: a round's global params evaluated by a second copy of the
model while the next inner phase trains (``--eval-background``; ``node.model.efficiency`` resolves auto).

    Phase 1 (training thread, at the round's end): the params are handed over. On the CPU the eval
             model's parameters become views of the round's one host copy of θ_global
             (``node.outer.host_copy.HostGlobalState``, made for the checkpoint and the served snapshot
             anyway): no copy at all. On a GPU they are copied device to device into the eval
             model on the training stream, and an event marks the end of that copy.
    Phase 2 (eval thread): the forward passes over the fixed held-out batches, on the eval thread's
             own CUDA stream (which first waits for that event), the per-batch losses summed
             exactly as ``SingleReplica.eval_loss`` sums them: the same params and batches give the
             same number as an inline eval.

At most one eval is in flight: a submit waits for the previous one first (its parameters are about
to be replaced). The loop polls the result at step boundaries (a future, never a callback).

A node with local workers evaluates inline: its replica lives in the workers, whose one command
channel the inner steps hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor, nn

from node.config import NodeConfig
from node.model.efficiency import resolve_eval_background, resolve_precision
from node.model.gpt import GPT, ModelConfig, cross_entropy_loss, precompute_rope
from node.model.replica import Replica, SingleReplica
from node.outer.diloco import ModuleParams

Batch = tuple[Tensor, Tensor]  # tokens (B, T), targets (B, T)


def build_eval_model(config: ModelConfig, device: torch.device, precision: str) -> GPT:
    """A GPT of ``config`` on ``device`` with uninitialised parameters (every eval loads them) and
    real RoPE buffers; built on the meta device and materialized empty, so it costs neither host
    memory nor a random fill, and torch's global RNG (part of a checkpoint) is left as it was."""
    from node.parallel.engine import autocast_forward

    rng = torch.get_rng_state()
    try:
        with torch.device("meta"):
            model = GPT(config)
    finally:
        torch.set_rng_state(rng)  # GPT() draws its init seed from the CPU RNG, even on meta
    model.to_empty(device=device)
    if config.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight
    cos, sin = precompute_rope(config.head_dim, config.seq_len, config.rope_theta)
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)
    model.eval()
    autocast_forward(model, precision)
    return model


class HeldOutEval:
    """Evaluates global params on ``batches`` on one background thread (see the module docstring).

    ``compile``: evaluate through ``torch.compile`` as the training replica does (the same graph, so
    the same numbers as its inline eval)."""

    def __init__(
        self,
        model_config: ModelConfig,
        device: torch.device,
        batches: Sequence[Batch],
        *,
        precision: str,
        compile: bool = False,
    ) -> None:
        self.device = device
        self.batches = list(batches)
        self.model = build_eval_model(model_config, device, precision)
        self._params = [p for p in self.model.parameters() if p.requires_grad]  # canonical order
        for param in self._params:
            param.requires_grad_(False)
        self._forward: nn.Module = torch.compile(self.model) if compile else self.model  # type: ignore[assignment]
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="held-out-eval")
        self._pending: Future[tuple[int, float]] | None = None
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._ready = torch.cuda.Event() if cuda else None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def submit(self, key: int, global_params: Tensor) -> None:
        """Evaluate ``global_params`` (N,) fp32 in the background; :meth:`poll` returns ``(key, loss)``.

        On the CPU ``global_params`` must be a host copy nobody writes to while the eval runs (the
        eval model's parameters become its views); elsewhere it is copied into the eval model here."""
        self.wait()
        if self.device.type == "cpu" and global_params.device.type == "cpu":
            offset = 0
            for param in self._params:  # views, no copy (Phase 1)
                size = param.numel()
                param.data = global_params[offset : offset + size].view_as(param)
                offset += size
            assert offset == global_params.numel(), "the global params do not fit the eval model"
        else:
            ModuleParams(self._params).write_params(global_params)  # on the training stream
            if self._ready is not None:
                self._ready.record()
        self._pending = self._executor.submit(self._evaluate, key)

    @torch.no_grad()
    def _evaluate(self, key: int) -> tuple[int, float]:
        """Phase 2, on the eval thread."""
        if self._stream is None:
            return key, self._mean_loss()
        assert self._ready is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)  # the params' copy on the training stream is done
            return key, self._mean_loss()

    def _mean_loss(self) -> float:
        total = 0.0
        for x, y in self.batches:  # as SingleReplica.eval_loss: a Python sum of per-batch losses
            total += cross_entropy_loss(self._forward(x.to(self.device)), y.to(self.device)).item()
        return total / len(self.batches)

    def poll(self) -> tuple[int, float] | None:
        """The eval that finished since the last call, else None; re-raises what a failed eval raised."""
        pending = self._pending
        if pending is None or not pending.done():
            return None
        self._pending = None
        return pending.result()

    def wait(self) -> tuple[int, float] | None:
        """Block until the eval in flight (if any) is done; returns it."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def background_eval(
    config: NodeConfig,
    replica: Replica,
    model_config: ModelConfig,
    device: torch.device,
    batches: Sequence[Batch],
) -> HeldOutEval | None:
    """The background eval of ``--eval-background`` (``node.model.efficiency.resolve_eval_background``), or
    None to evaluate inline; evaluated as ``replica`` evaluates (precision, compiled or not)."""
    single = isinstance(replica, SingleReplica)
    if not resolve_eval_background(config.eval.background, device, local_workers=not single):
        return None
    assert isinstance(replica, SingleReplica)
    return HeldOutEval(
        model_config,
        device,
        batches,
        precision=resolve_precision(config.parallel.precision, device),
        compile=replica.forward is not replica.model,
    )
