"""The run directory's ``metrics.jsonl``: one JSON object per inner step and per outer round.

Contract (read by ``dtnode report``, benchmarks and tests):

- ``{"kind": "step", "round", "step", "loss", "lr", "tokens", "tokens_per_s", "time"}`` after every
  inner step; ``round`` is the outer round the step belongs to (1-based), ``step`` the global inner
  step count after it, ``tokens`` this node's cumulative training tokens.
- ``{"kind": "round", "round", "eval_loss", "peers", "bytes_sent", "bytes_recv", "seconds_compute",
  "seconds_comm", "param_hash", "fell_back", "solo", "adopted", "shard", …}`` after every outer round;
  ``param_hash`` is the SHA-256 of the global params in canonical order, ``peers`` how many
  contributions the round's mean holds, ``fell_back`` that this node stepped on its own Δ (the
  swarm round failed), ``adopted`` that it replaced its state by the swarm's instead of stepping
  (then ``round`` and ``param_hash`` are those of the state adopted), ``shard`` the
  ``[index, count]`` it reads in the next phase,
  ``members`` the peer ids of the round's agreed group (empty without one: solo, failed, adopted),
  ``rss_bytes`` the node's resident memory when the record was written (null off Linux).
  Also in every round record:

  - ``seconds_forming`` / ``seconds_allreduce``: the parts of ``seconds_comm`` spent agreeing on the
    round's group and in its all-reduce, ``streams`` the all-reduce streams it ran on
    (``--swarm-streams``); null when there was no swarm round or no all-reduce. ``allreduce_share``:
    ``seconds_allreduce / seconds_wall``, the all-reduce's share of the round (with ``--overlap`` it
    runs beside the next phase's inner steps: ``blocked_share`` is what the training waited);
    ``density``: the share of the pseudo-gradient's numbers the wire codec sent (1 for the dense
    codecs, k / block for top-k); both null without an all-reduce.
  - ``seconds_wall``: wall seconds since the node's previous round record (the first: since its first
    inner step in this process); ``utilization`` the share of them spent on inner steps,
    ``seconds_compute / seconds_wall`` — everything else (waiting for the swarm, the outer step, eval,
    hashing, the checkpoint's host copy) counts against it; ``seconds_blocked``: how long the training
    thread waited for the swarm, and ``blocked_share`` = ``seconds_blocked / seconds_wall``. Both
    shares null when no phase ran alongside the round (the one applied after a run's last overlapped
    phase). Older records lack ``seconds_wall``: their ``utilization`` was
    ``seconds_compute / (seconds_compute + seconds_blocked)``.
  - ``eval_loss``: the mean held-out loss of the global params the record's ``param_hash`` names,
    every ``--eval-every`` rounds and at the run's last round; null in the others. With
    ``--eval-background`` it is computed while the next phase trains and the record is written once
    it is in (a few steps later, still in round order; ``time`` and ``seconds_wall`` stay those of
    the round's end; ``node/train/round_end.py``).
  - ``bytes_sent`` / ``bytes_recv``: wire bytes of the round's all-reduce (reduce-scatter and
    all-gather together), split in ``bytes_by_phase`` (``sent_reduce_scatter``, ``sent_all_gather``,
    ``recv_reduce_scatter``, ``recv_all_gather``: contributions vs averages and replicas; empty when
    nothing went over the wire); ``bytes_recv_state_sync``: verified bytes of the swarm's state this node
    fetched (joining, or re-syncing after a missed round) since the previous round record.
  - ``caught_up``: with ``adopted``, the node was at most two rounds behind and stepped to the swarm's state
    itself with those rounds' means (their wire codec's bytes; ``node/swarm/session.py``), not by a whole fetch.
  - ``codec_error``: ``‖residual‖ / ‖Δ‖`` after an averaged round, the error-feedback residual (what
    the wire codec lost of this round's contribution and of the parts it broadcast) relative to the
    pseudo-gradient; 0 with the lossless codec ``none``, null when nothing was encoded (a swarm of
    one, a failed or missed round).
  - ``fragment``: with ``--fragments``, the fragment the round synchronised (round r: r mod F), and
    ``fragment_hash`` the SHA-256 of that fragment's global params after it (null after an adoption);
    ``param_hash`` stays the whole model's. Both null without fragments.
  - ``failures_by_kind``: ``{kind: count}`` of what went wrong in the round (``node/swarm/session.py``):
    ``peer`` (one per peer lost, contribution left out, part moved or refused in the round's
    all-reduce), ``fell_back`` (the all-reduce could not finish: own Δ), ``round_failed`` (no group
    formed in time), ``timeout`` (the swarm missed its own deadline), ``missed`` (a group formed
    without us), ``resync`` (off the swarm's lineage), ``state_sync`` (no source delivered the
    swarm's state, also counted when joining). Empty for a clean round.

Lines are flushed as written, so a crash loses at most the line being written; a resumed run appends.

Every record also goes, in order, to the writer's *sinks* (:class:`MetricsSink`): the Prometheus
exporter (``node/ops/prometheus.py``) and the progress display (``node/ops/progress.py``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from node.outer.round import RoundApplied

# The kinds of ``failures_by_kind`` (see above), in the order a round can meet them.
FAILURE_KINDS = ("peer", "fell_back", "round_failed", "timeout", "missed", "resync", "state_sync")


class MetricsSink(Protocol):
    """Something else that reads every record as it is written (a metrics endpoint, a display)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Appends records to ``path`` and hands each one to ``sinks``; :meth:`close` closes them too."""

    def __init__(self, path: Path, *, sinks: Sequence[MetricsSink] = ()) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.sinks = tuple(sinks)
        self._handle: IO[str] = open(path, "a", buffering=1)  # line-buffered

    def write(self, record: dict[str, Any]) -> None:
        if self._handle.closed:  # written to after close() (e.g. a round finished after the loop): append
            self._handle = open(self.path, "a", buffering=1)
        # JSON has no NaN/Inf: a diverged loss is written as null rather than breaking readers.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._handle.write(json.dumps(clean, separators=(",", ":")) + "\n")
        for sink in self.sinks:  # the raw record: a sink may show a non-finite loss as it is
            sink.write(record)

    def close(self) -> None:
        self._handle.close()
        for sink in self.sinks:
            sink.close()


def utilization(compute_seconds: float, wall_seconds: float) -> float | None:
    """Inner compute over wall time (see the contract above); None if no phase ran or no time passed."""
    if compute_seconds <= 0 or wall_seconds <= 0:
        return None
    return compute_seconds / wall_seconds


def run_utilization(rounds: Iterable[Mapping[str, Any]]) -> tuple[float, float, float | None]:
    """Over a run's round records: (Σ ``seconds_compute``, Σ ``seconds_wall``, their ratio or None).

    The records' wall intervals tile the run from its first inner step to its last record, so this
    is the run's inner compute over its wall time, the last round included (with ``--overlap`` that
    round trains nothing: the final all-reduce, the last eval and checkpoint are its whole wall time),
    where a mean of the per-round ``utilization`` would leave that round out (it is null). Records
    without ``seconds_wall`` (written before it existed) are left out of both sums.
    """
    timed = [record for record in rounds if record.get("seconds_wall") is not None]
    compute = sum(float(record.get("seconds_compute") or 0.0) for record in timed)
    wall = sum(float(record["seconds_wall"]) for record in timed)
    return compute, wall, utilization(compute, wall)


def byte_text(num_bytes: float) -> str:
    """A byte count as a person reads it: ``812 B``, ``12.3 kB``, ``1.52 MB``, ``2.04 GB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{1 if unit == 'kB' else 2}f} {unit}"
    return f"{num_bytes:.0f} B"


def wire_text(record: Mapping[str, Any], *, received: bool) -> list[str]:
    """The round's wire bytes at its payload's density, and the all-reduce's share of the round's wall
    time; empty for a round without an all-reduce (a swarm of one, a missed or adopted round)."""
    density, share = record.get("density"), record.get("allreduce_share")
    parts = []
    if density is not None:
        sent = f"sent {byte_text(record.get('bytes_sent') or 0)}"
        if received:
            sent += f" recv {byte_text(record.get('bytes_recv') or 0)}"
        parts.append(f"{sent} at density {100 * density:.3g}%")
    if share is not None:
        parts.append(f"all-reduce {share:.0%} of the round" if received else f"all-reduce {share:.0%}")
    return parts


def current_rss_bytes() -> int | None:
    """This process's resident memory now (Linux ``/proc/self/status`` VmRSS); None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def read_metrics(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The complete records of a metrics file (of ``kind`` only, if given), in file order; empty if
    the file does not exist yet. A torn last line (a crash, or a writer still at it) is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or (isinstance(record, dict) and record.get("kind") == kind):
            records.append(record)
    return records


def round_record(
    applied: RoundApplied,
    *,
    progress: Any,
    wall_seconds: float,
    eval_loss: float | None,
    overlap: bool,
    shard: tuple[int, int],
) -> dict[str, Any]:
    """A ``round`` record (the contract above) of one applied round: the round's statistics straight
    from the swarm's outcome (``applied.stats``), the loop's counters (``progress``: step, round,
    tokens) and timings. ``wall_seconds``: since the previous round record."""
    stats, blocked, wall = applied.stats, applied.seconds_waited, wall_seconds
    compute_seconds = applied.compute_seconds
    return {
        "kind": "round",
        "round": progress.round,
        "step": progress.step,
        "eval_loss": eval_loss,
        "peers": stats.num_peers,
        "bytes_sent": stats.bytes_sent,
        "bytes_recv": stats.bytes_recv,
        "seconds_compute": compute_seconds,
        "seconds_comm": applied.seconds_comm,
        "seconds_blocked": blocked,
        "seconds_forming": stats.seconds_forming,
        "seconds_allreduce": stats.seconds_allreduce,
        "streams": stats.streams,
        "density": stats.density,
        "allreduce_share": (
            stats.seconds_allreduce / wall if stats.seconds_allreduce is not None and wall > 0 else None
        ),
        "seconds_wall": wall,
        # Inner compute / wall time since the previous record, and the share of it spent waiting for
        # the swarm (node/ops/metrics.py); None for the round applied after a run's last overlapped phase.
        "utilization": utilization(compute_seconds, wall),
        "blocked_share": (blocked / wall) if compute_seconds > 0 and wall > 0 else None,
        "overlap": overlap,
        "param_hash": applied.param_hash,
        "fragment": applied.fragment,
        "fragment_hash": applied.fragment_hash or None,
        "pseudo_gradient_norm": applied.pseudo_gradient_norm,
        "tokens": progress.tokens,
        "fell_back": applied.kind == "fell_back",
        "solo": applied.kind == "solo",  # a round of this node alone: its own Δ, no group to average with
        "adopted": applied.kind == "adopted",
        # Adopted by stepping with the round's mean from our own state, not by a whole-state fetch.
        "caught_up": applied.caught_up,
        "shard": list(shard),
        "members": list(stats.members),
        "rss_bytes": current_rss_bytes(),
        "bytes_recv_state_sync": stats.bytes_recv_state_sync,
        "bytes_by_phase": stats.bytes_by_phase,
        "codec_error": stats.codec_error,
        "failures_by_kind": stats.failures_by_kind,
        "time": time.time(),
    }
