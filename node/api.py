"""A Python API around your own training loop: join a DiLoCo swarm with any ``nn.Module``.

The user keeps their loop and their inner optimizer; the swarm is told after every inner step what
was trained, and once a round is due it runs DiLoCo's outer round on the module's parameters::

    swarm = join_swarm(model, run_name="demo", data_id="my-corpus-v1", peers=addresses, inner_steps=50)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()      # the user's inner step, untouched
        report = swarm.step(tokens=x.numel())             # None, or the round that just ended
    swarm.finish()

One outer round (Douillard et al., 2023, "DiLoCo"; ``node/outer/diloco.py`` has the algorithm):

1. Δ = θ_global − θ_module over the module's trainable params (flat fp32, ``named_parameters`` order);
2. the swarm averages Δ over the round's group, weighted by what each node trained (tokens or
   samples), through the compressed all-reduce of ``node/swarm/session.py`` (``SwarmSession``);
3. outer Nesterov SGD on θ_global with the mean, then θ_module ← θ_global;
4. the round's decision (``node/outer/seam.py``) is acted on: Averaged and FellBack count the round;
   Adopt (this node missed the round or is off the swarm's lineage) loads the swarm's verified global
   state into the module instead.

The round is the daemon's own: this class is a thin wrapper of :class:`~node.outer.round.OuterRound`,
which the daemon's loop drives too. As with torchft's Manager the swarm never holds this object; as
with hivemind's Optimizer the user says what was trained and the round is due after ``inner_steps``
calls (or ``round_seconds`` seconds).

Options are :class:`~node.config.NodeConfig`'s fields, as ``dtnode join`` takes them (``peers``,
``codec``, ``swarm_key_file``, ``aggregation``, ``min_peers``, …), validated by NodeConfig; the ones
about dtnode's own model and data (``model``, ``data``, ``batch_size``, …) are ignored. ``overlap``
and ``swarm_streams > 1`` are refused (their rounds need the daemon's loop). The data identity a
joiner is checked against is the user's ``data_id`` (hashed into the state's ``corpus_sha256``): a
node with another ``data_id`` cannot adopt the swarm's state. Two fresh nodes at round 0 hold the same
seeded init and fetch nothing, so the check bites from the first round a joiner must adopt.

Checkpoints: :meth:`SwarmTrainer.state_dict` (module, outer state, counters, the codec's residual) is
saved with ``torch.save`` beside the inner optimizer's; loaded before :meth:`SwarmTrainer.start`, the
run continues bit for bit as if it had not stopped.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from node.config import ConfigError, NodeConfig, replace
from node.outer.diloco import DiLoCo
from node.outer.round import OuterRound, RoundKind, RoundProgress, RoundSettings
from node.outer.seam import SoloAverager

if TYPE_CHECKING:
    from node.swarm.session import SwarmSession

log = logging.getLogger(__name__)

STATE_VERSION = 1  # of SwarmTrainer.state_dict


def data_sha256(data_id: str) -> str:
    """The corpus identity of a user's ``data_id``, as served with the swarm's state."""
    return hashlib.sha256(f"dtnode-api-data:{data_id}".encode()).hexdigest()


def module_shapes(module: nn.Module) -> str:
    """The trainable parameters' names and shapes, as text: the module's part of the node's identity."""
    return ";".join(f"{name}:{tuple(p.shape)}" for name, p in module.named_parameters() if p.requires_grad)


@dataclass(frozen=True)
class RoundReport:
    """One outer round as the loop sees it."""

    round: int  # rounds the module's global params went through (the swarm's, after an adoption)
    kind: RoundKind  # averaged with the group, fell back to our own Δ, or adopted the swarm's state
    num_peers: int  # nodes whose Δ is in the mean (1: only ours; 0: adopted)
    param_hash: str  # SHA-256 of the global params now in the module: equal on every member
    step: int  # inner steps counted by the swarm after the round
    weight: float  # tokens (or samples) this node trained in the round
    seconds_comm: float  # the round's wait on the swarm
    shard: tuple[int, int]  # (index, count) of the data shard this node should train on next
    reason: str = ""  # why it fell back, if it did


def api_config(config: NodeConfig | None = None, **options: Any) -> NodeConfig:
    """``config`` (default: NodeConfig's defaults) with ``options`` over it, validated by NodeConfig;
    ConfigError for an unknown option, a bad value, or one the API cannot honour."""
    resolved = replace(config or NodeConfig(), **options)
    if resolved.outer.overlap:
        raise ConfigError("overlap=True is not supported by the Python API (use dtnode join --overlap)")
    if resolved.outer.fragments > 1:
        raise ConfigError("fragments > 1 is not supported by the Python API (use dtnode join --fragments)")
    if resolved.rounds.streams > 1:
        raise ConfigError("swarm_streams > 1 needs the daemon's local ranks; the Python API runs one stream")
    return resolved


class _UserData:
    """The API's data cursor: the user reads their own data; the swarm only assigns a shard."""

    def __init__(self, shard: tuple[int, int]) -> None:
        self.shard = shard

    def state_dict(self) -> dict[str, Any]:
        return {}  # the data position is the user's: a served state carries only the counters

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """An adopted state's data position is the swarm's counters only: nothing to load here."""

    def skip(self, num_steps: int) -> None:
        """Catching up skips steps of the user's data: their loop follows ``num_steps``."""

    def reshard(self, shard_index: int, num_shards: int) -> None:
        self.shard = (shard_index, num_shards)

    def end_round(
        self, shard: tuple[int, int] | None, *, phase_shards: int | None = None, phase_tokens: int = 0
    ) -> None:
        """The round's group agreed on the shard (None: no group, it stays); where the user's data
        stands is theirs to say."""
        if shard is not None:
            self.shard = shard

    def read_spare(self, lane: int, *, steps: int) -> None:
        """Joined the round after it began: ``(count + lane, count)`` until the next round, data no
        member's shard reads (the user's data decides what that index reads)."""
        self.shard = (self.shard[1] + lane, self.shard[1])


class SwarmTrainer:
    """DiLoCo around a user's module and loop; see the module docstring.

    Build it, optionally :meth:`load_state_dict`, then :meth:`start` (``join_swarm`` does all three);
    :meth:`step` after each inner step; :meth:`finish` (serve stragglers, leave) or :meth:`close`.
    """

    def __init__(self, module: nn.Module, *, config: NodeConfig, data_id: str) -> None:
        if not data_id:
            raise ConfigError("data_id must name the data this module trains on (e.g. 'my-corpus-v3')")
        config = api_config(config)
        self.module = module
        self.config = config
        self.corpus_sha256 = data_sha256(data_id)
        self._stop = threading.Event()
        self._session: SwarmSession | None = None
        if config.network.enabled:
            from node.swarm.session import SwarmSession  # imported late: the gRPC stack is slow to import
            from node.swarm.setup import start_swarm

            module_name = type(module).__name__

            def join_hint(run_name: str, peers: str) -> str:  # a `dtnode join` node trains dtnode's own model
                return (f"join_swarm(<a {module_name} built as this one>, run_name={run_name!r}, "
                        f"data_id={data_id!r}, peers={peers!r}) in your own loop (Python API)")  # fmt: skip

            self._session = SwarmSession(
                start_swarm(config, join_hint=join_hint),
                joining=bool(config.network.peers),
                start_peers=config.rounds.start_peers,
            )
        self.diloco = DiLoCo(
            module,
            outer_lr=config.outer.lr,
            outer_momentum=config.outer.momentum,
            nesterov=config.outer.nesterov,
            offload=config.outer.offload,
        )
        self._data = _UserData((config.corpus.shard_index, config.corpus.num_shards))
        self.round = OuterRound(
            self.diloco,
            averager=self._session if self._session is not None else SoloAverager(),
            swarm=self._session,
            settings=RoundSettings(
                inner_steps=config.inner.steps, round_seconds=config.rounds.seconds,
                model=f"api:{type(module).__name__}", corpus_sha256=self.corpus_sha256,
                rank=config.corpus.rank, architecture=module_shapes(module),
            ),
            data=self._data,
            stop_requested=self._stop.is_set,
        )  # fmt: skip
        self._unit: str = ""  # "tokens" or "samples", fixed by the first step
        self._pending_swarm_state: dict[str, torch.Tensor] = {}
        self._started = False
        log.info("Python API: %s", config)

    # --- lifecycle ---

    def start(self) -> None:
        """Announce the node; a joiner adopts the swarm's state into the module if its own is not
        the swarm's (ConfigError if that state is of another model size or ``data_id``); then the
        start barrier (``start_peers``)."""
        if self._started:
            return
        self._started = True
        try:
            self.round.start(self._pending_swarm_state)
        except BaseException:  # refused (another data_id or model) or interrupted: free the sockets
            self.close()
            raise

    def finish(self) -> None:
        """End of the run: serve our last state while a node is behind it, then leave the swarm."""
        if self._session is not None and self._started and not self._stop.is_set():
            self._session.serve_stragglers()
        self.close()

    def close(self) -> None:
        """Leave the swarm and close its connections (idempotent)."""
        self._stop.set()
        self.round.close()
        session, self._session = self._session, None
        if session is not None:
            session.stop()

    # --- the loop ---

    @property
    def num_steps(self) -> int:
        """Inner steps over the run (the swarm's count after an adoption)."""
        return self.round.progress.step

    @property
    def num_rounds(self) -> int:
        """Outer rounds applied over the run."""
        return self.round.progress.round

    @property
    def shard(self) -> tuple[int, int]:
        """(index, count): the data shard the swarm's last round assigned this node; ``index >= count``
        until the first round of a node that joined mid-phase: a spare lane, other data than the
        ``count`` members' shards (``node/data/batches.py``, "Spare lanes")."""
        return self._data.shard

    def param_hash(self) -> str:
        """SHA-256 of the global params (equal on every node of the swarm's lineage)."""
        return self.diloco.param_hash()

    def step(self, *, tokens: int = 0, samples: int = 0) -> RoundReport | None:
        """Count one inner step that trained ``tokens`` (or ``samples``: one unit for the whole run,
        it weights this node's Δ in the mean); run the outer round if it is due and return its report."""
        if (tokens > 0) == (samples > 0):
            raise ValueError("pass exactly one of tokens=N or samples=N (N > 0)")
        unit = "tokens" if tokens > 0 else "samples"
        if self._unit and unit != self._unit:
            raise ValueError(f"this run counts {self._unit}; got {unit}")
        self._unit = unit
        if self._stop.is_set():
            raise RuntimeError("step() after close()")
        self.start()  # (once)
        self.round.count_step(tokens or samples)  # timed by the wall clock between calls
        applied = self.round.at_step_boundary()
        if applied is None:
            return None
        return RoundReport(
            round=self.num_rounds,
            kind=applied.kind,
            num_peers=applied.num_peers,
            param_hash=applied.param_hash,
            step=self.num_steps,
            weight=applied.weight,
            seconds_comm=applied.seconds_comm,
            shard=self.shard,
            reason=applied.reason,
        )

    # --- checkpoints ---

    def state_dict(self) -> dict[str, Any]:
        """Everything a bit-exact resume needs but the user's inner optimizer and data position:
        the module's state, the outer params and momentum, the counters and the swarm's residual
        (copies; save with ``torch.save``)."""
        module_state = {name: value.detach().clone() for name, value in self.module.state_dict().items()}
        swarm_state = self._session.state_dict() if self._session is not None else {}
        progress = self.round.progress
        return {
            "version": STATE_VERSION,
            "corpus_sha256": self.corpus_sha256,
            "param_hash": self.diloco.param_hash(),
            "module": module_state,
            "outer": self.diloco.state_dict(),
            "counters": {
                "num_steps": progress.step,
                "num_rounds": progress.round,
                "round_weight": progress.round_tokens,
                "phase_start_step": self.round.phase_start_step,
                "unit": self._unit,
                "shard": list(self.shard),
            },
            "swarm": swarm_state or self._pending_swarm_state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`: the swarm then sees the restored
        lineage). ConfigError if it was saved with another ``data_id`` or module size."""
        if self._started:
            raise RuntimeError("load_state_dict before start() (join_swarm(..., state=...) does this)")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"not a SwarmTrainer state (version {state.get('version')!r})")
        if state["corpus_sha256"] != self.corpus_sha256:
            raise ConfigError("this state was trained on another data_id")
        try:
            self.module.load_state_dict(state["module"])
            self.diloco.load_state_dict(state["outer"])
        except (RuntimeError, ValueError) as error:
            raise ConfigError(f"the state does not fit this module: {str(error).splitlines()[0]}") from None
        if self.diloco.param_hash() != state["param_hash"]:
            raise RuntimeError("restored global params do not match the saved param_hash")
        counters = state["counters"]
        self.round.restore(
            RoundProgress(
                step=int(counters["num_steps"]),
                round=int(counters["num_rounds"]),
                round_tokens=int(counters["round_weight"]),
            ),
            phase_start_step=int(counters["phase_start_step"]),
        )
        self._unit = str(counters["unit"])
        self._data.shard = (int(counters["shard"][0]), int(counters["shard"][1]))
        self._pending_swarm_state = dict(state.get("swarm", {}))


def join_swarm(
    module: nn.Module,
    *,
    run_name: str,
    data_id: str,
    peers: str | Sequence[str] = "",
    inner_steps: int | None = None,
    round_seconds: float | None = None,
    config: NodeConfig | None = None,
    state: Mapping[str, Any] | None = None,
    **options: Any,
) -> SwarmTrainer:
    """Join (or start) swarm ``run_name`` with ``module``, resumed from ``state`` if given.

    ``peers``: multiaddrs of running nodes (empty starts a new swarm); ``inner_steps`` H or
    ``round_seconds`` S: when a round is due; ``options``: any other NodeConfig field (``codec``,
    ``swarm_key_file``, ``aggregation``, ``min_peers``, ``listen``, ``run_dir``, ``client_mode=True``
    behind NAT, ``swarm=False`` to train alone, …) over ``config``."""
    if not isinstance(peers, str):
        peers = ",".join(peers)
    changes: dict[str, Any] = {"name": run_name, "peers": peers, **options}
    if inner_steps is not None:
        changes["inner_steps"] = inner_steps
    if round_seconds is not None:
        changes["round_seconds"] = round_seconds
    trainer = SwarmTrainer(module, config=api_config(config, **changes), data_id=data_id)
    try:
        if state is not None:
            trainer.load_state_dict(state)
    except BaseException:
        trainer.close()
        raise
    trainer.start()
    return trainer
