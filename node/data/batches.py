"""Sharded, deterministic, resumable training batches and a fixed validation set.

Windows
-------
The training stream (``Corpus.train``, N tokens) is cut into ``num_windows = (N - 1) // seq_len``
windows; window ``w`` is ``tokens[w*T : w*T + T + 1]`` with ``T = seq_len``. Consecutive windows
share exactly one boundary token (the last token of window ``w`` is the first of ``w + 1``), which
is what the next-token shift needs: ``x = window[:-1]`` and ``y = window[1:]``, so every token but
the very first is a target exactly once per epoch. Windows ignore document boundaries on purpose:
``EOS`` inside a window teaches the model where documents end, and no token is wasted on padding
(the same choice as nanoGPT and GPT-2 pre-training). Reading by window index instead of by random
offset makes "which data did shard i see" a finite set we can reason about and test.

Epochs and shards
-----------------
Epoch ``e`` visits the windows in a permutation fixed by ``(seed, e)``. The permutation sorts the
windows by a 64-bit SplitMix64 hash of ``(seed, e, window)``: it is plain integer arithmetic, so it
is the same on every peer whatever its numpy or torch version (their generators promise no stream
stability across releases) and costs one argsort per epoch.

Training proceeds in rounds. ``position`` is a *global* offset into the epoch's permutation,
identical on every peer. In one round the ``num_shards`` peers together consume the
``num_shards * batch_size`` permutation entries starting at ``position``; shard ``i`` takes those
at ``position + i + num_shards * k`` for ``k < batch_size`` (so with no reshard, shard ``i`` reads
exactly the positions ``p`` with ``p % num_shards == i``). Then every peer advances ``position`` by
``num_shards * batch_size``. A round that would run past the end of the permutation is skipped and
the next epoch starts at position 0; the skipped tail (< one round) differs from epoch to epoch.

Why disjoint: within one round the shards take distinct residues of one block of positions, and
rounds use non-overlapping blocks, so two shards of the same ``num_shards`` never read the same
window in an epoch, provided all peers call ``next_batch`` in lockstep (once per inner step).

Reshard rule: ``reshard(shard_index, num_shards)`` keeps ``epoch`` and ``position`` and only changes
how the next rounds are divided. Everything before ``position`` was consumed under the old
membership and everything from ``position`` on is split among the new one, so no two live peers
read the same window from the reshard to the end of the epoch. The daemon must reshard every peer
at the same global position: at an outer-round boundary, :meth:`ShardedBatches.end_round` puts
every member of the round's group there first (below); a joining peer first copies a live peer's
``state_dict()`` (``load_state_dict``) and reads a spare lane until that boundary.

Spare lanes
-----------
A node that starts reading after its round began (it adopted the lineage's state mid-phase: a late
joiner, or a starter past the start barrier's assignment) holds no shard of the round: shards
``0 .. n-1`` are the members'. It reads *spare lane* ``j`` (``read_spare``; lane ``n + j`` of the
round) until the next reshard. A round that starts at ``(epoch, P)`` with phases of ``H`` steps has
its members read positions ``P .. P + H*n*B - 1`` of that epoch; spare lane ``j`` reads the ``H*B``
positions just behind them, ``P - (j+1)*H*B .. P - j*H*B - 1`` (modulo the epoch's windows, so at
an epoch's start they are its last ones), ``B`` at a time in order, wrapping within them if the
lane is read for more than ``H`` steps. These are positions the lineage consumed earlier in the
epoch (or reaches last): no member reads them again this epoch, so the spare lane never duplicates
a live member's window, in this round or a later one of the epoch, as long as ``(n + j + 1)*H*B``
positions fit in the epoch; lanes ``j`` are distinct per node (the swarm's records say which are
held: ``protocol/membership/shards.py``). The position still advances by ``n*B`` per step, in
lockstep with the members, so at the round's end the node reshards at the same position as they.

With rounds due by time (``--round-seconds``) a phase has no fixed length, so a lane's length is not
bounded by ``H``: ``read_spare(lane, steps=0)`` reads lane ``j``'s ``k``-th batch at the ``B``
positions ``P - (b+1)*B .. P - b*B - 1`` with ``b = 2**j * (2k + 1) - 1`` (lane 0 takes every other
batch behind ``P``, lane 1 every fourth from the second, ...): every lane is endless and no two
lanes share a position, so a joiner that trains more steps than ``H`` never re-reads its own lane
nor reads another's (a WARNING says when the lane reaches back past the epoch's start into the
windows the members read this round).

One agreed position at a round's end
------------------------------------
Each node's ``position`` moves by ``n*B`` per batch it reads, with its own ``n`` and its own number
of batches; nodes that read a phase with different shard counts (starters that passed the start
barrier at one moment on different views) or different numbers of steps (``--round-seconds``, where
a fast node trains more steps than a slow one) end it at different positions. So the round's end
does not keep each node's own position: :meth:`end_round` puts every member at one position
computed from what the round's group agreed on. The loader remembers where its phase started
(``(epoch, P)``, set by every reshard and load: the lineage's position at the previous round's end,
the same on every member by induction) and moves from there as :meth:`skip` would by
``max(reads, ceil(T_max / (B*seq_len)))`` batches of ``m`` shards, where ``T_max`` is the most tokens
any member of the group trained in the phase (each member's token count is in the group's spec,
the same on every member), ``reads`` the batches this loader read or skipped in the phase (a floor
for a node that skipped its phase's rest, never above the others' in an agreed round), and ``m`` the
shard count the phase was read as: the lineage's (the count the previous round's group assigned,
the same on every member), or in a run's first round, whose phase the start barrier assigned
(possibly from different views), the round's group size. Every member's reads of the phase lie
below that position (each read at most ``T_max`` tokens' batches, interleaved by ``m``), so the
next phase re-reads none of them. In a run where every member reads the same phase (``H`` steps
of the same count) the position is the one each reached on its own: the same data, the same
param_hash as before. A node that read a phase with another count than the agreed one (a first
round's race) may have read positions past the agreed one: the next phase may read those again,
once, in another round; never two live nodes the same position in one round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from node.data.corpus import Corpus, load_corpus
from node.data.tokenizer import BOS, EOS, PAD, RESERVED, VOCAB_SIZE, TokenArray, decode, encode

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "RESERVED",
    "VOCAB_SIZE",
    "NODE_LANE_KEYS",
    "Corpus",
    "ShardedBatches",
    "SpareLane",
    "decode",
    "encode",
    "eval_batches",
    "load_corpus",
    "window_permutation",
]

log = logging.getLogger(__name__)

_UINT64_MAX: Final = (1 << 64) - 1
_GOLDEN_GAMMA: Final = np.uint64(0x9E3779B97F4A7C15)  # odd, so i -> base + i * gamma is injective


def _check_uint64(name: str, value: int) -> None:
    if not 0 <= value <= _UINT64_MAX:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")


def _mix64(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer (Steele et al., 2014): a bijection on uint64 with full avalanche."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def window_permutation(num_windows: int, *, seed: int, epoch: int) -> npt.NDArray[np.int64]:
    """The order in which epoch ``epoch`` visits windows ``0 .. num_windows - 1``.

    Window ``w``'s sort key is ``mix64(base + w * gamma)`` with ``base`` derived from ``(seed,
    epoch)``; both maps are bijections on uint64, so keys are distinct and the order has no ties.
    """
    _check_uint64("seed", seed)
    _check_uint64("epoch", epoch)
    base = _mix64(_mix64(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch))  # (1,)
    keys = _mix64(base + np.arange(num_windows, dtype=np.uint64) * _GOLDEN_GAMMA)  # (num_windows,)
    return np.argsort(keys, kind="stable").astype(np.int64)


def _gather_windows(
    tokens: TokenArray, windows: npt.NDArray[np.int64], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` for the given window indices: x is each window minus its last token, y minus its first."""
    offsets = windows[:, None] * seq_len + np.arange(seq_len + 1)  # (B, T + 1)
    # Fancy indexing a memmap pages in only these B windows, never the whole file.
    chunk = torch.from_numpy(tokens[offsets].astype(np.int64))  # (B, T + 1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, T), (B, T)


_SPARE_KEYS: Final = ("spare_lane", "spare_steps", "spare_epoch", "spare_anchor", "spare_reads")
_PHASE_KEYS: Final = ("phase_epoch", "phase_position", "phase_reads")
NODE_LANE_KEYS: Final = frozenset({"shard_index", *_SPARE_KEYS, *_PHASE_KEYS})
"""The ``state_dict`` keys that are this node's lane or phase, not the lineage's data position: a
served state leaves them out (every member serves the same metadata; ``node/swarm/state.py``)."""


@dataclass
class SpareLane:
    """Spare lane ``lane`` of the round that started at ``(epoch, anchor)`` (module docstring)."""

    lane: int  # j: lane num_shards + j of the round
    steps: int  # H: the lane holds steps * batch_size positions (0: endless, --round-seconds)
    epoch: int  # the epoch and position the round started from
    anchor: int
    reads: int = 0  # batches read on the lane so far
    warned: bool = False  # an endless lane said it reached the members' windows (read_spare, steps 0)


class ShardedBatches:
    """Shard ``shard_index`` of ``num_shards``'s batches over ``tokens`` (see the module docstring)."""

    def __init__(
        self,
        tokens: TokenArray,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        shard_index: int = 0,
        num_shards: int = 1,
    ) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tokens.shape}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_windows = max(tokens.size - 1, 0) // seq_len
        _check_uint64("seed", seed)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.shard_index = 0
        self.num_shards = 1
        self.spare: SpareLane | None = None  # a spare lane until the next reshard (module docstring)
        # Where the phase under way started and how many batches it read or skipped since: what
        # end_round moves the agreed distance from (module docstring, "One agreed position").
        self.phase_start = (0, 0)
        self.phase_reads = 0
        self.reshard(shard_index, num_shards)
        self._permutations: dict[int, npt.NDArray[np.int64]] = {}  # by epoch: the last two used

    @property
    def windows_per_round(self) -> int:
        """Permutation entries all shards together consume per ``next_batch`` call."""
        return self.num_shards * self.batch_size

    @property
    def batches_per_epoch(self) -> int:
        """Full rounds per epoch, i.e. ``next_batch`` calls per shard per epoch with no reshard."""
        return self.num_windows // self.windows_per_round

    def reshard(self, shard_index: int, num_shards: int) -> None:
        """Read as shard ``shard_index`` of ``num_shards`` from the current global position on."""
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"need 0 <= shard_index < num_shards, got {shard_index} of {num_shards}")
        if self.num_windows < num_shards * self.batch_size:
            raise ValueError(
                f"{self.tokens.size} tokens make {self.num_windows} windows of {self.seq_len + 1} tokens, "
                f"fewer than num_shards * batch_size = {num_shards * self.batch_size}"
            )
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.spare = None
        self.phase_start, self.phase_reads = (self.epoch, self.position), 0

    def end_round(
        self, shard: tuple[int, int] | None, *, phase_shards: int | None = None, phase_tokens: int = 0
    ) -> None:
        """A round ended (module docstring, "One agreed position at a round's end"). Its group agreed
        (``shard``: ours among them, (index, count)): move to the position the phase's start advances
        to by the group's reads of it, then read that shard. ``phase_shards``: the count the phase
        counts as read with (None: this loader's, the lineage's since the previous round);
        ``phase_tokens``: the most tokens a member of the group trained in the phase. ``shard``
        None (no group: a swarm of one, a round without one): our own position goes on, and the next
        phase starts from it."""
        if shard is None:
            self.phase_start, self.phase_reads = (self.epoch, self.position), 0
            return
        tokens_per_batch = self.batch_size * self.seq_len
        reads = max(self.phase_reads, -(-phase_tokens // tokens_per_batch))
        count = self.num_shards if phase_shards is None else phase_shards
        if count < 1:
            raise ValueError(f"phase_shards must be >= 1, got {phase_shards}")
        self.epoch, self.position = self.phase_start
        self.num_shards = count  # (skip moves by this count's blocks; reshard below sets the next)
        self.skip(reads)
        self.reshard(*shard)

    def read_spare(self, lane: int, *, steps: int) -> None:
        """Read spare lane ``lane`` of the round that starts at the current position, whose phases are
        ``steps`` inner steps long, until the next :meth:`reshard` (module docstring). On a spare
        lane already: move to lane ``lane`` of the same round (another node reads ours), at the
        same step of it."""
        if lane < 0 or steps < 0:
            raise ValueError(f"need lane >= 0 and steps >= 0, got lane {lane} and steps {steps}")
        if self.spare is not None:
            self.spare.lane = lane
        else:
            epoch, position = self.epoch, self.position
            if position + self.windows_per_round > self.num_windows:  # the round's first step wraps
                epoch, position = epoch + 1, 0
            self.spare = SpareLane(lane=lane, steps=steps, epoch=epoch, anchor=position)
        needed = (self.num_shards + lane + 1) * self.spare.steps * self.batch_size
        if self.spare.steps and needed > self.num_windows:
            log.warning("spare data lane %d: the round's %d shards and %d spare lane(s) of %d steps need %d "
                        "windows, the epoch has %d: it may read windows a shard reads",
                        lane, self.num_shards, lane + 1, self.spare.steps, needed, self.num_windows)  # fmt: skip

    @property
    def lane(self) -> tuple[int, int]:
        """(index, count) of what this loader reads: shard ``index`` of ``count``, or with
        ``index >= count`` spare lane ``index - count`` beside the ``count`` shards."""
        if self.spare is not None:
            return self.num_shards + self.spare.lane, self.num_shards
        return self.shard_index, self.num_shards

    def window_indices(self, epoch: int) -> npt.NDArray[np.int64]:
        """Windows this shard reads in ``epoch`` if it starts at position 0 with no reshard: (batches, B)."""
        permutation = window_permutation(self.num_windows, seed=self.seed, epoch=epoch)
        rounds = permutation[: self.batches_per_epoch * self.windows_per_round]
        # Round r's block is rounds[r*n*B : (r+1)*n*B]; shard i takes its entries i, i+n, i+2n, ...
        blocks = rounds.reshape(self.batches_per_epoch, self.batch_size, self.num_shards)
        return blocks[:, :, self.shard_index]  # (batches_per_epoch, B)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``, each (batch_size, seq_len) int64; ``y[:, t]`` is the token after ``x[:, t]``."""
        if self.position + self.windows_per_round > self.num_windows:
            self.epoch += 1
            self.position = 0
        if self.spare is None:
            block = self._permutation_of(self.epoch)[self.position : self.position + self.windows_per_round]
            windows = block[self.shard_index :: self.num_shards]  # (B,)
        else:
            windows = self._spare_windows(self.spare)  # (B,)
        assert windows.shape == (self.batch_size,)
        self.position += self.windows_per_round  # in lockstep with the shards, spare lane or not
        self.phase_reads += 1
        return _gather_windows(self.tokens, windows, self.seq_len)

    def _spare_windows(self, spare: SpareLane) -> npt.NDArray[np.int64]:
        """The spare lane's next batch: ``B`` positions of the ``H*B`` just behind its round's, or with
        an endless lane (``steps`` 0) of batch ``2**lane * (2*reads + 1) - 1`` behind them."""
        if spare.steps:
            region = spare.anchor - (spare.lane + 1) * spare.steps * self.batch_size
            start = region + (spare.reads % spare.steps) * self.batch_size
        else:
            behind = (2**spare.lane * (2 * spare.reads + 1) - 1) * self.batch_size
            start = spare.anchor - behind - self.batch_size
            read_ahead = self.phase_reads * self.windows_per_round  # the members' reads this round so far
            if behind + self.batch_size + read_ahead > self.num_windows and not spare.warned:
                spare.warned = True
                log.warning("spare data lane %d reaches back past the epoch's start into the windows the round's "
                            "members read (%d windows in the epoch): it may read windows a shard reads",
                            spare.lane, self.num_windows)  # fmt: skip
        positions = (start + np.arange(self.batch_size, dtype=np.int64)) % self.num_windows  # (B,)
        spare.reads += 1
        return self._permutation_of(spare.epoch)[positions]

    def _permutation_of(self, epoch: int) -> npt.NDArray[np.int64]:
        """Epoch ``epoch``'s window order, built once (a spare lane may read the epoch before the
        shards' for a round that crosses an epoch's end: two are kept)."""
        permutation = self._permutations.get(epoch)
        if permutation is None:
            permutation = window_permutation(self.num_windows, seed=self.seed, epoch=epoch)
            kept = (epoch - 1, epoch + 1)
            self._permutations = {e: p for e, p in self._permutations.items() if e in kept}
            self._permutations[epoch] = permutation
        return permutation

    def skip(self, num_steps: int) -> None:
        """Advance the position as ``num_steps`` calls of ``next_batch`` would, reading nothing.

        A node that ended an inner phase early (a joiner catching up with its swarm) skips the
        windows its peers read meanwhile, so the swarm's positions agree again.
        """
        for _ in range(num_steps):
            if self.position + self.windows_per_round > self.num_windows:
                self.epoch += 1
                self.position = 0
            self.position += self.windows_per_round
        self.phase_reads += num_steps

    def state_dict(self) -> dict[str, int]:
        """Everything needed to continue exactly where this loader stands (the spare lane's keys only
        while it reads one)."""
        state = {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "seq_len": self.seq_len,
        }
        spare = self.spare
        if spare is not None:
            values = (spare.lane, spare.steps, spare.epoch, spare.anchor, spare.reads)
            state.update(zip(_SPARE_KEYS, values, strict=True))
        if self.phase_reads:  # mid-phase: where it started (at a round's end it is the position itself)
            phase = (*self.phase_start, self.phase_reads)
            state.update(zip(_PHASE_KEYS, phase, strict=True))
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (taken from this or a peer's loader over the same tokens)."""
        if state["seq_len"] != self.seq_len:
            raise ValueError(f"state is for seq_len {state['seq_len']}, this loader has {self.seq_len}")
        if state["epoch"] < 0 or not 0 <= state["position"] <= self.num_windows:
            raise ValueError(
                f"bad epoch/position {state['epoch']}/{state['position']} for {self.num_windows} windows"
            )
        _check_uint64("seed", state["seed"])
        self.reshard(state["shard_index"], state["num_shards"])
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._permutations = {}  # the seed may have changed: rebuild the permutations lazily
        if "spare_lane" in state:
            lane, steps, epoch, anchor, reads = (int(state[key]) for key in _SPARE_KEYS)
            if lane < 0 or steps < 0 or epoch < 0 or not 0 <= anchor <= self.num_windows or reads < 0:
                raise ValueError(f"bad spare lane {[state[key] for key in _SPARE_KEYS]}")
            self.spare = SpareLane(lane=lane, steps=steps, epoch=epoch, anchor=anchor, reads=reads)
        self.phase_start, self.phase_reads = (self.epoch, self.position), 0
        if "phase_reads" in state:
            epoch, position, reads = (int(state[key]) for key in _PHASE_KEYS)
            if epoch < 0 or not 0 <= position <= self.num_windows or reads < 0:
                raise ValueError(f"bad phase start {[state[key] for key in _PHASE_KEYS]}")
            self.phase_start, self.phase_reads = (epoch, position), reads


def eval_batches(
    val: TokenArray, seq_len: int, batch_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches, the same on every peer.

    ``num_batches * batch_size`` windows (same layout as training) are picked evenly spaced over the
    whole stream, so the estimate covers every validation document rather than the first few. With
    fewer windows, as many full batches as fit are returned, or one smaller batch of all windows.
    """
    if seq_len < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(
            f"seq_len, batch_size, num_batches must be >= 1, got {seq_len}, {batch_size}, {num_batches}"
        )
    num_windows = max(val.size - 1, 0) // seq_len
    if num_windows == 0:
        raise ValueError(f"validation stream has {val.size} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    if num_windows < batch_size:
        return [_gather_windows(val, np.arange(num_windows, dtype=np.int64), seq_len)]
    num_batches = min(num_batches, num_windows // batch_size)
    num_picked = num_batches * batch_size
    picked = np.arange(num_picked, dtype=np.int64) * num_windows // num_picked  # evenly spaced, distinct
    return [_gather_windows(val, batch, seq_len) for batch in picked.reshape(num_batches, batch_size)]
