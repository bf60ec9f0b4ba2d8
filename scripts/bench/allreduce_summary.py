"""The records of ``bench_allreduce.py``: one configuration, what its peers reported, and the verdicts.

``Setup`` is one configuration (N peers, E numbers, a codec, a link) with its planned times;
``PeerRun`` is what the N processes of one implementation left behind. ``summarize_dtnode`` and
``summarize_hivemind`` turn the peers' JSON reports into the record's fields, ``evaluate_targets``
judges the targets that apply, and ``summary_line`` says it all in one line. The fields and the
targets are defined in ``bench_allreduce.py``'s docstring.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.group import split_by_weight
from protocol.allreduce.sparse import is_sparse
from protocol.codecs import Codec, get_codec

HIVEMIND_CODECS = {"none": "none", "fp16": "fp16", "bf16": "fp16", "int8": "int8", "int4": "int8"}
"""dtnode's codec -> hivemind's closest; a codec missing here (topk: hivemind has no sparse codec) has no
hivemind run."""
# Timeouts are planned for this goodput where no cap is set (loopback on a loaded 2-core machine).
PLANNING_LOOPBACK_BYTES_PER_SECOND = 20e6
# Generous rate of regenerating vectors for the exact-mean checks (numbers per second per peer).
PLANNING_CHECK_NUMBERS_PER_SECOND = 10e6
TARGET_ELEMENTS = (25_000_000, 100_000_000)
TARGET_LINK_EFFICIENCY = 0.85
TARGET_SPEEDUP = 2.0
TARGET_MEMORY_X_VECTOR = 3.0
TARGET_SPARSE_LINK_EFFICIENCY = 1 / 1.25  # round time <= 1.25 x the sparse round's own link bound


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One configuration of the benchmark."""

    num_peers: int
    num_elements: int
    codec: str
    link_mbit: float | None
    num_rounds: int
    seed: int
    chunk_num_elements: int | None = None
    """Numbers per streamed chunk; None = the all-reduce's default for the codec."""
    in_place: bool = True
    """dtnode writes the average into each peer's vector (``allreduce(in_place=True)``), else a new tensor."""
    topk_density: float | None = None
    """topk: the fraction of numbers sent; None = the codec's default (and always None for a dense codec)."""
    kill_fault: str | None = None
    """"POINT[:CHUNK]" (a fault point of protocol/allreduce/faults.py): one more round after the timed
    ones, in which the last member SIGKILLs itself at that point; None = no such round."""

    @property
    def vector_bytes(self) -> int:
        return 4 * self.num_elements

    @property
    def codec_object(self) -> Codec:
        """The codec the peers run (with its density for topk)."""
        return get_codec(self.codec, density=self.topk_density)

    @property
    def killed_member(self) -> int | None:
        """The member killed in the last round (the last one), or None without --kill-member."""
        return None if self.kill_fault is None else self.num_peers - 1

    @property
    def num_worker_rounds(self) -> int:
        """Rounds each worker runs: the timed ones, then the kill round if any (its index: num_rounds)."""
        return self.num_rounds + (self.kill_fault is not None)

    def fault_plan(self) -> str:
        """The victim's --fault: POINT:ROUND:CHUNK:kill in the kill round."""
        assert self.kill_fault is not None
        point, _, chunk = self.kill_fault.partition(":")
        return f"{point}:{self.num_rounds}:{chunk or 0}:kill"

    def uplink_bytes_per_member(self) -> list[float]:
        """Bytes each member's uplink carries in one round, payloads only (no headers), equal bandwidths.

        Dense (the butterfly): 2 (N - 1) / N * wire_bytes for every member. Sparse (design (a) as built,
        protocol/allreduce/sparse.py): member i pushes its payload for every other part to that part's
        owner, then serves its own part's bundle (all N members' payloads for it) to the N - 1 others:
            up_i = sum_{j != i} k_j + (N - 1) * N * k_i
        with k_j one member's payload for part j, encoded chunk by chunk from the part's start; with
        equal parts ~ (N - 1)(N + 1) / N * k, k the whole vector's payload (ARCHITECTURE.md).
        """
        codec, num_peers = self.codec_object, self.num_peers
        if not is_sparse(codec):
            return [2 * (num_peers - 1) / num_peers * codec.encoded_num_bytes(self.num_elements)] * num_peers
        chunk = self.chunk_num_elements or AllReduceConfig.chunk_num_elements
        bounds = split_by_weight(self.num_elements, [1.0] * num_peers)
        part_bytes = []
        for start, stop in itertools.pairwise(bounds):
            num_full, rest = divmod(stop - start, chunk)
            part_bytes.append(
                num_full * codec.encoded_num_bytes(chunk) + (codec.encoded_num_bytes(rest) if rest else 0)
            )
        total = sum(part_bytes)
        return [total - k + (num_peers - 1) * num_peers * k for k in part_bytes]

    @property
    def link_bound_seconds(self) -> float | None:
        """Bytes on the busiest uplink / the cap (None on loopback)."""
        if not self.link_mbit:
            return None
        return max(self.uplink_bytes_per_member()) / (self.link_mbit * 1e6 / 8)

    def ideal_seconds(self, num_bytes: int) -> float:
        """Bandwidth-optimal all-reduce time of a num_bytes vector at the cap (or the planning rate)."""
        rate = self.link_mbit * 1e6 / 8 if self.link_mbit else PLANNING_LOOPBACK_BYTES_PER_SECOND
        return 2 * (self.num_peers - 1) / self.num_peers * num_bytes / rate

    @property
    def round_deadline_seconds(self) -> float:
        """Deadline of one round, for either implementation: ten times the fp32 ideal, at least 2 min."""
        return max(120.0, 10 * self.ideal_seconds(self.vector_bytes))

    @property
    def check_seconds(self) -> float:
        """Time allowed for a peer's exact-mean check: it regenerates all N vectors, N peers share 2 cores."""
        return self.num_peers**2 * self.num_elements / PLANNING_CHECK_NUMBERS_PER_SECOND + 30


@dataclass(frozen=True, kw_only=True)
class PeerRun:
    """What the N processes of one implementation left behind."""

    stdouts: list[str]
    error: str | None
    """None if every peer exited 0; else which one failed (with its stderr's tail) or timed out."""
    tx_bytes: list[int] | None
    """Bytes each host's interface sent during the run (emulator only)."""


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize_dtnode(setup: Setup, run: PeerRun) -> dict[str, object]:
    """The dtnode fields of a configuration's record (see bench_allreduce.py) from its peers' JSON lines."""
    records = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in run.stdouts]
    expected = [setup.num_worker_rounds] * setup.num_peers
    if setup.killed_member is not None:
        expected[setup.killed_member] = setup.num_rounds  # it dies in the kill round, before its report
    if run.error or [len(peer) for peer in records] != expected:
        counts = [len(peer) for peer in records]
        return {"error": run.error or f"expected {expected} records per peer, got {counts}"}
    by_round = list(zip(*(peer[: setup.num_rounds] for peer in records), strict=True))  # [round][peer]
    identical = [len({r["sha256"] for r in peers}) == 1 for peers in by_round]
    per_round = [min(r["seconds"] for r in peers) for peers in by_round]
    timed = list(range(1, setup.num_rounds)) or [0]
    seconds = round(statistics.median(per_round[k] for k in timed), 4)
    wire_bytes = setup.codec_object.encoded_num_bytes(setup.num_elements)
    sent = statistics.mean(r["bytes_sent"] for k in timed for r in by_round[k])
    received = statistics.mean(r["bytes_recv"] for k in timed for r in by_round[k])
    last = by_round[-1]  # ru_maxrss only grows, so the last round holds each peer's peak
    peak_rss = max(r["peak_rss_bytes"] for r in last)
    above_baseline = max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in last)
    link_bound = setup.link_bound_seconds
    summary: dict[str, object] = {
        "seconds": seconds,
        "seconds_statistic": (
            f"median over rounds {timed[0]}..{timed[-1]} of the fastest peer's time"
            + (" (round 0, which opens the connections, is first_round_seconds)" if timed[0] else "")
        ),
        "first_round_seconds": per_round[0],
        "first_round_link_efficiency": rounded(link_bound / per_round[0] if link_bound else None),
        "seconds_per_round": per_round,
        "seconds_max_peer_per_round": [max(r["seconds"] for r in peers) for peers in by_round],
        "wire_bytes": wire_bytes,
        "wire_bytes_per_peer": round(sent),
        "wire_bytes_received_per_peer": round(received),
        "wire_bytes_ideal_per_peer": round(statistics.mean(setup.uplink_bytes_per_member())),
        "busiest_link_bytes": round(max(setup.uplink_bytes_per_member())),
        "link_bound_seconds": rounded(link_bound),
        "link_efficiency": rounded(link_bound / seconds if link_bound else None),
        "max_abs_error": max(r["max_abs_error"] for peers in by_round for r in peers),
        "max_abs_error_per_round": [max(r["max_abs_error"] for r in peers) for peers in by_round],
        "cpu_seconds_per_peer": rounded(
            statistics.mean(r["cpu_seconds"] for k in timed for r in by_round[k])
        ),
        "cpu_cores": os.cpu_count(),
        "cpu_bound_seconds": rounded(
            setup.num_peers
            * statistics.mean(r["cpu_seconds"] for k in timed for r in by_round[k])
            / (os.cpu_count() or 1)
        ),
        "peak_rss_bytes_per_peer": peak_rss,
        "peak_rss_bytes_per_round": [max(r["peak_rss_bytes"] for r in peers) for peers in by_round],
        "baseline_rss_bytes_per_peer": max(r["baseline_rss_bytes"] for r in last),
        "peak_rss_above_baseline_bytes": above_baseline,
        "peak_rss_x_vector": rounded(peak_rss / setup.vector_bytes, 3),
        "peak_rss_above_baseline_x_vector": rounded(above_baseline / setup.vector_bytes, 3),
        "bit_identical": all(identical),
        "bit_identical_per_round": identical,
        "fell_back": any(r["fell_back"] for peers in by_round for r in peers),
        "failures": sorted({f for peers in by_round for r in peers for f in r["failures"]}),
    }
    if run.tx_bytes is not None:
        summary["interface_tx_bytes_per_peer"] = round(
            statistics.mean(run.tx_bytes) / setup.num_worker_rounds
        )
    if setup.killed_member is not None:
        summary.update(summarize_kill_round(setup, records))
    return summary


def summarize_kill_round(setup: Setup, records: list[list[dict[str, Any]]]) -> dict[str, object]:
    """The kill round's fields: did every survivor hold the same bits, the mean of what was sent?"""
    survivors = [records[i][setup.num_rounds] for i in range(setup.num_peers) if i != setup.killed_member]
    fell_back = any(r["fell_back"] for r in survivors)
    identical = len({r["sha256"] for r in survivors}) == 1 and not fell_back
    return {
        "killed_member": setup.killed_member,
        "kill_fault": setup.fault_plan(),
        "killed_round_seconds": min(r["seconds"] for r in survivors),
        "killed_round_seconds_max_peer": max(r["seconds"] for r in survivors),
        "killed_round_max_abs_error": max(r["max_abs_error"] for r in survivors),
        "killed_round_fell_back": fell_back,
        "killed_round_failures": sorted({f for r in survivors for f in r["failures"]}),
        "killed_round_contributors": survivors[0]["contributors"],
        "killed_round_contributors_agree": len({json.dumps(r["contributors"]) for r in survivors}) == 1,
        "survivors_bit_identical": identical,
    }


def summarize_hivemind(setup: Setup, run: PeerRun) -> dict[str, object]:
    """The hivemind fields of a configuration's record from its peers' reports (one JSON line each)."""
    last_lines = [[line for line in out.splitlines() if line.startswith("{")][-1:] for out in run.stdouts]
    if not all(last_lines):
        return {"hivemind_ok": False, "hivemind_error": run.error or "a hivemind peer printed no report"}
    reports = [json.loads(lines[0]) for lines in last_lines]
    # A peer whose check failed says why in its report; the stderr tail (run.error) is the last resort.
    errors = [
        f"peer {i}: {r['error'] or 'not averaged'} (group {r['group_size']}/{setup.num_peers}, "
        f"relative L2 error {r['relative_l2_error']})"
        for i, r in enumerate(reports)
        if not r["averaged_ok"]
    ]
    allreduce = [r["allreduce_seconds"] for r in reports]
    timed = not errors and run.error is None and None not in allreduce
    peak_rss = max(r["peak_rss_bytes"] for r in reports)
    above_baseline = max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in reports)
    summary: dict[str, object] = {
        "hivemind_codec": HIVEMIND_CODECS[setup.codec],
        "hivemind_ok": not errors and run.error is None,
        "hivemind_error": "; ".join(errors) or run.error,
        "hivemind_seconds": rounded(min(allreduce)) if timed else None,
        "hivemind_seconds_max_peer": rounded(max(allreduce)) if timed else None,
        "hivemind_allreduce_seconds_per_peer": [rounded(seconds) for seconds in allreduce],
        "hivemind_step_seconds": rounded(max(r["seconds"] or 0.0 for r in reports)),
        "hivemind_max_abs_error": max(r["max_abs_error"] or 0.0 for r in reports) if timed else None,
        "hivemind_peak_rss_bytes_per_peer": peak_rss,
        "hivemind_baseline_rss_bytes_per_peer": max(r["baseline_rss_bytes"] for r in reports),
        "hivemind_peak_rss_children_bytes": max(r["peak_rss_children_bytes"] for r in reports),
        "hivemind_peak_rss_x_vector": rounded(peak_rss / setup.vector_bytes, 3),
        "hivemind_peak_rss_above_baseline_x_vector": rounded(above_baseline / setup.vector_bytes, 3),
    }
    if run.tx_bytes is not None:
        summary["hivemind_interface_tx_bytes_per_peer"] = round(statistics.mean(run.tx_bytes))
    return summary


def evaluate_targets(setup: Setup, record: dict[str, object]) -> dict[str, dict[str, object]]:
    """The targets (see bench_allreduce.py) that apply to this configuration, each with its verdict."""
    targets: dict[str, dict[str, object]] = {}
    in_range = TARGET_ELEMENTS[0] <= setup.num_elements <= TARGET_ELEMENTS[1]
    if in_range and setup.codec == "int8" and setup.link_mbit == 100 and setup.num_peers in (4, 8):
        value = record.get("link_efficiency")
        targets["link_efficiency"] = {"value": value, "min": TARGET_LINK_EFFICIENCY}
    if is_sparse(setup.codec_object) and setup.link_mbit == 100 and setup.num_peers in (4, 8):
        value = record.get("link_efficiency")
        targets["link_efficiency"] = {"value": value, "min": TARGET_SPARSE_LINK_EFFICIENCY}
    if setup.killed_member is not None:
        targets["survivors_bit_identical"] = {
            "value": record.get("survivors_bit_identical"),
            "expected": True,
        }
    if in_range and setup.codec == "int8" and setup.link_mbit is None and setup.num_peers in (2, 4):
        value = record.get("speedup_vs_hivemind")
        targets["speedup_vs_hivemind"] = {"value": value, "min": TARGET_SPEEDUP}
    targets["peak_rss_above_baseline_x_vector"] = {
        "value": record.get("peak_rss_above_baseline_x_vector"),
        "max": TARGET_MEMORY_X_VECTOR,
    }
    for target in targets.values():
        value = target["value"]
        if value is None:
            target["pass"] = False  # the run failed, so the target is not met
        elif "expected" in target:
            target["pass"] = value == target["expected"]
        elif "min" in target:
            target["pass"] = value >= target["min"]  # type: ignore[operator]
        else:
            target["pass"] = value <= target["max"]  # type: ignore[operator]
    return targets


def summary_line(r: dict[str, Any]) -> str:
    """One human-readable line for a record: times, speedup, errors, memory, agreement, verdicts."""
    link = f"{r['link_mbit']:g} Mbit/s" if r["link_mbit"] else "loopback"
    head = f"N={r['peers']} {r['codec']} E={r['elements']:,} {link}:"
    if "error" in r:
        return f"{head} dtnode FAILED: {r['error']}"
    parts = [f"dtnode {r['seconds']:.2f} s (first round {r['first_round_seconds']:.2f} s"]
    if r["link_bound_seconds"] is not None:
        parts[0] += (
            f"; link bound {r['link_bound_seconds']:.2f} s, efficiency {r['link_efficiency']:.2f}"
            f", first round {r['first_round_link_efficiency']:.2f}"
        )
    parts[0] += f"; {r['cpu_seconds_per_peer']:.2f} CPU-s per peer on {r['cpu_cores']} cores"
    parts[0] += f", CPU bound {r['cpu_bound_seconds']:.2f} s)"
    if r.get("hivemind_seconds") is not None:
        parts.append(f"hivemind {r['hivemind_seconds']:.2f} s -> {r['speedup_vs_hivemind']:.2f}x")
    elif "hivemind_ok" in r:
        parts.append(f"hivemind FAILED: {r['hivemind_error']}")
    elif r.get("hivemind_skipped"):
        parts.append(f"no hivemind run: {r['hivemind_skipped']}")
    errors = f"err {r['max_abs_error']:.3g}"
    if r.get("hivemind_max_abs_error") is not None:
        errors += f" (hivemind {r['hivemind_max_abs_error']:.3g})"
    rss = f"peak RSS {r['peak_rss_x_vector']:.2f}x vector"
    rss += f", {r['peak_rss_above_baseline_x_vector']:.2f}x above the pre-round baseline"
    if r.get("hivemind_peak_rss_x_vector") is not None:
        rss += f" (hivemind {r['hivemind_peak_rss_x_vector']:.2f}x"
        rss += f", {r['hivemind_peak_rss_above_baseline_x_vector']:.2f}x)"
    parts += [errors, rss]
    if r["fell_back"] or r["failures"]:
        parts.append(f"fell back: {r['fell_back']}, {len(r['failures'])} failure(s) recorded")
    parts.append("bit-identical" if r["bit_identical"] else "NOT bit-identical")
    if "survivors_bit_identical" in r:
        parts.append(
            f"member {r['killed_member']} killed at {r['kill_fault']}: survivors "
            + ("bit-identical" if r["survivors_bit_identical"] else "NOT bit-identical")
            + f" in {r['killed_round_seconds']:.2f} s, err {r['killed_round_max_abs_error']:.3g}"
        )
    verdicts = ", ".join(f"{name} {'PASS' if t['pass'] else 'FAIL'}" for name, t in r["targets"].items())
    return f"{head} {' | '.join(parts)} | targets: {verdicts}"
