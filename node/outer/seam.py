"""The seam between the outer round and the swarm: what each hands the other, and nothing more.

Like torchft's Manager beside its training loop, the swarm side (``node/swarm/session.py``) never holds the
loop, and never calls back into it. The loop's outer round (``node/outer/round.py``) *tells* the
swarm what it needs, as arguments of the calls it makes:

==========================  ====================================================================
the round calls             with                                     the swarm answers
==========================  ====================================================================
``join(request)``           the model's identity, the state it holds  the swarm's state to adopt, or
                            now (:class:`JoinRequest`)                 none (:class:`JoinAnswer`)
``await_start_peers()``                                               the round-0 state to take
                                                                     and the data shard to read
                                                                     from step 1 (:class:`StartAnswer`)
``average(Δ, round=...)``   the lineage Δ was trained from, weight,   one :class:`RoundOutcome`
                            throughput (:class:`RoundRequest`)
``after_step(members)``     the round's group, once stepped through   the data shard to train next
                                                                     and where the group's phase
                                                                     ended (:class:`NextShard`)
``after_adopt(state)``      the swarm's state, once loaded            the spare data lane to read
                                                                     until the next round
``prepare_publish(snap)``   the state the next ``publish`` serves,    —
                            built on the averaging thread (overlap)
``publish(snapshot)``       the global state to serve now             —
``advertise_rate(tok/s)``   the phase's throughput so far and its    —
                            step time (every 1 s)
``phase_should_end()``                                                a catching-up node's phase ends
``moved_spare_lane()``                                                another spare lane: another node
                                                                     reads ours (we chose at once)
``lineage_peer_due()``                                                a node is fetching our state
``round_forming()``                                                   a peer of our lineage is ready
                                                                     for the next round (its first
                                                                     members reached H steps)
``await_round_forming(s)``                                            the same, waited for (at most s
                                                                     seconds)
``step_seconds_range()``                                              the shortest and longest step
                                                                     time our lineage's peers announce
==========================  ====================================================================

A round's outcome carries one :data:`RoundDecision`, the only thing anyone branches on (in one
``match``, ``OuterRound``), and its statistics (:class:`RoundStats`), which only the round record
reads. Background work (an overlapped round) is a future the loop polls at step boundaries, never a
callback into the loop from another thread.

Import direction: outer_round → swarm_seam ← swarm; swarm_state → swarm_seam. Nothing here imports
the loop, the swarm or DiLoCo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from protocol.statesync.snapshot import Snapshot
    from protocol.swarm.streams import StreamRunner

MAX_DUE_WAIT = timedelta(minutes=2)
"""The longest a node's inner phase runs past its end while a node fetches its lineage's state (the
loop trains on meanwhile, ``OuterRound``), and how far ahead a fetching node's estimate may lie for
the swarm to count it (``SwarmSession.lineage_peer_due``)."""

Boundary = tuple[int, dict[str, Any]]
"""(inner step, data position) at the end of a round's phase: what a snapshot of that round carries."""

Lineage = tuple[int, str]
"""(rounds applied, param_hash) of a node's global params."""

Stepped = tuple[torch.Tensor, torch.Tensor | None]
"""(global params, outer momentum): the outer state after one outer step."""

OuterStepper = Callable[[torch.Tensor, Stepped], Stepped]
"""``stepper(mean, start)``: the outer state one outer step with ``mean`` gives from ``start``, on
copies (``DiLoCo.stepped``): a pure function of its arguments and the outer optimizer's settings."""

FragmentStepper = Callable[[int, torch.Tensor, Stepped], Stepped]
"""``stepper(fragment, mean, start)``: the whole outer state that fragment ``fragment``'s outer step
with its round's mean (the fragment's numbers) gives from the whole ``start``, on copies
(``FragmentedOuterState.stepped``)."""

Assemble = Callable[[Sequence[torch.Tensor]], torch.Tensor]
"""``assemble(pieces)``: the whole-model vector of one vector per fragment (a state served in
fragments; ``FragmentedOuterState.assemble``)."""


@dataclass(frozen=True)
class AdoptedState:
    """A verified global state fetched from the swarm (or stepped to with its rounds' means), ready
    for the loop to load (``OuterRound``'s one adoption path)."""

    round: int
    param_hash: str
    global_params: torch.Tensor  # (N,) fp32
    outer_momentum: torch.Tensor | None  # (N,) fp32, None before the first outer step
    metadata: dict[str, Any]
    round_mean: Any = None
    """The ``swarm_state.RoundMean`` this state was stepped to with from ours (``caught_up_state``),
    None if it was fetched whole."""

    @property
    def caught_up(self) -> bool:
        return self.round_mean is not None

    @property
    def lineage(self) -> Lineage:
        return self.round, self.param_hash


# --- what one round decided ------------------------------------------------------------------------


@dataclass(frozen=True)
class Averaged:
    """The group's weighted mean Δ̄ arrived: outer step with it."""

    mean: torch.Tensor  # (N,) fp32


@dataclass(frozen=True)
class FellBack:
    """No usable mean (too few peers, a failed all-reduce, no state to adopt): outer step with this
    node's own Δ; the next round's lineage check brings it back to the swarm."""

    own: torch.Tensor  # (N,) fp32
    reason: str


@dataclass(frozen=True)
class Adopt:
    """This node missed the round or is off the swarm's lineage: load the swarm's state instead of
    stepping (fetched whole, or caught up with the rounds' means: ``state.caught_up``)."""

    state: AdoptedState


RoundDecision = Averaged | FellBack | Adopt


@dataclass(frozen=True, kw_only=True)
class RoundStats:
    """What a round cost and who was in it: read by the round record (``node/ops/metrics.py``), never
    branched on."""

    num_peers: int = 1  # nodes whose Δ is in the mean (1: only ours; 0: adopted)
    members: tuple[str, ...] = ()  # the round's group (peer ids); empty without one
    bytes_sent: int = 0
    bytes_recv: int = 0
    bytes_by_phase: dict[str, int] = field(default_factory=dict)
    """bytes_sent / bytes_recv split by all-reduce phase: {"sent_reduce_scatter", "sent_all_gather",
    "recv_reduce_scatter", "recv_all_gather"} (empty if nothing went over the wire)."""
    failures: tuple[str, ...] = ()  # human-readable reasons, one per failed peer or phase
    failures_by_kind: dict[str, int] = field(default_factory=dict)  # node/ops/metrics.py FAILURE_KINDS
    codec_error: float | None = None  # ‖error-feedback residual‖ / ‖Δ‖; None if nothing was encoded
    bytes_recv_state_sync: int = 0  # the swarm's state fetched since the previous round
    seconds_forming: float | None = None  # agreeing on the round's group (None: no swarm round)
    seconds_allreduce: float | None = None  # the group's all-reduce (None: it did not run)
    streams: int | None = None  # all-reduce streams the round ran on (None: it did not run)
    density: float | None = (
        None  # share of Δ's numbers the wire codec sends (top-k: k / block; None: no all-reduce)
    )


@dataclass(frozen=True)
class RoundOutcome:
    """The swarm's one answer to a round: what to do, and what it cost."""

    decision: RoundDecision
    stats: RoundStats = field(default_factory=RoundStats)


@dataclass(frozen=True, kw_only=True)
class RoundRequest:
    """What the swarm needs to know about the round it is asked to average."""

    round_index: int  # the round being formed (1-based)
    weight: float  # tokens (or samples) this node trained for it: its Δ's weight in the mean
    lineage: Lineage  # (round, param_hash) of the global params Δ was trained from
    tokens_per_s: float  # this node's throughput in the phase (advertised in its record)
    fragment: int | None = None
    """With ``--fragments``: the fragment whose Δ_f this round averages (its own vector, payload and
    error feedback); None: the whole model's Δ."""
    send_window: timedelta | None = None
    """Spread what this node sends in the round's all-reduce over about this long (``--pace-sends``:
    an overlapped fragment round, ``node/outer/pace.py``); None: at full rate."""


@dataclass(frozen=True, kw_only=True)
class JoinRequest:
    """What the swarm needs from the loop to join: the model's identity and the state held now."""

    num_elements: int
    """Numbers in the flat global params."""
    corpus_sha256: str
    """The data identity a fetched state must carry (corpus and tokenizer)."""
    held: Snapshot
    """The global state the loop holds now (served if it is the swarm's)."""
    stepper: OuterStepper
    """Steps a copy of an outer state with a round's mean (catching up with the rounds' means)."""
    stop_requested: Callable[[], bool]
    """True once the node is asked to stop: the swarm's waits end early."""
    open_streams: Callable[[], StreamRunner] | None = None
    """The all-reduce streams 1..S-1 on the local ranks (``--swarm-streams S > 1``), else None."""
    identity: str = ""
    """What this node trains, as an opaque digest (:func:`node.swarm.state.run_identity`): only nodes
    of one identity share rounds and states."""
    rank: int | None = None
    """This node's place in the swarm's member order, fixed by its run (None: ordered by peer id)."""
    fragment_sizes: tuple[int, ...] = ()
    """With ``--fragments``: the numbers of each fragment's vector (a round averages one of them, and
    keeps its own error feedback); empty: every round averages the whole model's vector."""
    fragment_stepper: FragmentStepper | None = None
    """With ``--fragments``: steps a copy of the whole outer state with one fragment round's mean
    (catching up with the fragment rounds' means)."""
    fragment_assemble: Assemble | None = None
    """With ``--fragments``: puts a state served in fragments together (``node.swarm.state.served_state``)."""


@dataclass(frozen=True)
class JoinAnswer:
    """How a node starts: on its own state (``adopt`` None), or on the swarm's, which it serves once
    loaded. ``serve`` False: serve nothing yet (an older state of the swarm's that only brings it
    closer, or our own state while we still fetch the swarm's: a record of it would count for a
    lineage the swarm is not on). ``spare_lane``: with ``adopt``, the spare data lane to read until
    the next round (``node/data/batches.py``: the lineage's members read the round's shards)."""

    adopt: AdoptedState | None = None
    serve: bool = True
    spare_lane: int | None = None


@dataclass(frozen=True, kw_only=True)
class NextShard:
    """What a round's group agreed about the data (``after_step``): every member moves to one data
    position and reads its shard from there (``node/data/batches.py``, "One agreed position at a
    round's end"), whatever shard count or number of steps it read the phase with."""

    shard_index: int
    num_shards: int
    """The shard (index, count) to read from the next phase on: its place among the group's members."""
    phase_shards: int | None
    """The shard count the phase that just ended counts as read with: None for the lineage's (the
    count the previous round's group assigned, the same on every member), else the group's size (a
    run's first round, whose shards the start barrier assigned from each node's own view)."""
    phase_tokens: int
    """The most tokens any member of the group trained in the phase (the group's spec says each
    member's): how far the phase read, with ``--round-seconds`` where members train uneven steps."""


@dataclass(frozen=True)
class StartAnswer:
    """What the start barrier settled before the first inner step: the swarm's round-0 state to take
    (``adopt``: our round-0 params differ from the lineage the barrier's nodes follow), and the data
    shard (index, count) to read from step 1 (None: keep the configured one), or beside whose
    ``count`` shards to read spare lane ``spare_lane`` (nodes past the barrier read another
    assignment than this node's view gives: ``protocol/membership/shards.py``)."""

    adopt: AdoptedState | None = None
    shard: tuple[int, int] | None = None
    spare_lane: int | None = None


class Averager(Protocol):
    """Averages a flat fp32 pseudo-gradient across the swarm (``SwarmSession``), or a swarm of one."""

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome: ...


class SoloAverager:
    """A swarm of one: the mean of one vector is itself."""

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        return RoundOutcome(Averaged(vector))


class SwarmSide(Averager, Protocol):
    """What the outer round calls on the swarm (``node.swarm.session.SwarmSession``); see the table above."""

    num_adoptions: int

    def join(self, request: JoinRequest) -> JoinAnswer: ...

    def await_start_peers(self) -> StartAnswer: ...

    def after_step(self, members: tuple[str, ...]) -> NextShard | None: ...

    def after_adopt(self, state: AdoptedState) -> int | None: ...

    def moved_spare_lane(self) -> int | None: ...

    def prepare_publish(self, snapshot: Snapshot) -> None:
        """On the thread that built ``snapshot`` (overlap: the averaging thread, once the round's step
        is applied): build what :meth:`publish` serves beside it, so that publishing it from the
        training thread only swaps it in."""
        ...

    def publish(self, snapshot: Snapshot, *, tokens_per_s: float) -> None: ...

    def advertise_rate(self, tokens_per_s: float, *, step_seconds: float | None = None) -> None:
        """Our throughput and step time now (the median of our last inner steps; None: not measured
        yet), in our record from the next heartbeat on."""
        ...

    def lift_pace(self, round_index: int) -> None:
        """Paced round ``round_index`` (``RoundRequest.send_window``) sends the rest at full rate,
        whether its all-reduce has begun or not: the loop waits on it now. Safe beside the round in
        flight (it only tells the swarm's loop)."""
        ...

    def phase_should_end(self) -> bool: ...

    def lineage_peer_due(self) -> bool: ...

    def round_forming(self) -> bool: ...

    def await_round_forming(self, seconds: float) -> bool: ...

    def step_seconds_range(self) -> tuple[float, float] | None:
        """The shortest and the longest step time the live peers of our lineage announce (None: none
        announces one)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...
