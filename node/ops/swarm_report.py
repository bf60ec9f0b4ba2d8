"""What ``dtnode swarm`` shows and reports: the nodes' round records as they are written, one line
per round per node, whether the nodes agree on ``param_hash``, how much of the run each node spent
averaging with others (participation), the verdict on the run, and ``report.md``.

Pure reading and formatting (``node/ops/launcher.py`` runs the processes); the records follow the
``metrics.jsonl`` contract of ``node/ops/metrics.py``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from node.ops.metrics import byte_text, wire_text

log = logging.getLogger("dtnode.swarm")


class MetricsTail:
    """The round records appended to one ``metrics.jsonl`` since this tail was made (as ``tail -f``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # A resumed run appends to the file: report only what this launch adds.
        self._offset = path.stat().st_size if path.exists() else 0
        self._partial = b""

    def read_rounds(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s: skipping an unreadable line", self.path)
                continue
            if isinstance(record, dict) and record.get("kind") == "round":
                records.append(record)
        return records


def round_line(name: str, record: Mapping[str, Any]) -> str:
    """``node-1 round 3 | eval_loss 2.71 | peers 3 | sent 1.52 MB at density 1.51% | all-reduce 3% |
    param_hash 0cefb6a965`` (``sent 0 B`` for a round without an all-reduce; ``| fragment 3
    7a1c0e9b2d`` before the param_hash for a fragment's round, ``--fragments``)."""
    eval_loss = record.get("eval_loss")
    loss_text = "-" if eval_loss is None else f"{eval_loss:.4f}"  # not evaluated this round (--eval-every)
    wire = wire_text(record, received=False) or [f"sent {byte_text(record.get('bytes_sent') or 0)}"]
    line = (
        f"{name} round {record['round']} | eval_loss {loss_text} | peers {record['peers']} | "
        f"{' | '.join(wire)} | "
    )
    if record.get("fragment") is not None:
        line += f"fragment {record['fragment']} {(record.get('fragment_hash') or '-')[:10]} | "
    line += f"param_hash {record['param_hash'][:10]}"
    if record.get("fell_back"):
        line += " | fell back (own Δ)"
    if record.get("adopted"):
        line += " | adopted the swarm's state"
    if record.get("solo"):
        line += " | solo (no other node in the round)"
    return line


def hash_agreement(rounds_per_node: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The rounds every node recorded, and those whose ``param_hash`` differs between nodes.

    After an outer round every member must hold the same global params, so any disagreement is a
    bug or a split into two lineages (a node that fell back or adopted shows up here too).
    """
    # A node's last record of a round wins (a node that adopted may record a round twice).
    hashes = [{int(r["round"]): str(r["param_hash"]) for r in rounds} for rounds in rounds_per_node]
    common = sorted(set.intersection(*(set(h) for h in hashes))) if hashes else []
    disagreeing = [r for r in common if len({h[r] for h in hashes}) > 1]
    return {
        "common_rounds": common,
        "disagreeing_rounds": disagreeing,
        "all_agree": bool(common) and not disagreeing,
    }


def is_averaged(record: Mapping[str, Any]) -> bool:
    """Whether the node that wrote this round record contributed to a mean of two or more nodes:
    ``peers >= 2`` and it neither fell back to its own Δ nor adopted the swarm's state instead."""
    return int(record.get("peers") or 0) >= 2 and not record.get("fell_back") and not record.get("adopted")


def node_participation(rounds: Sequence[Mapping[str, Any]], *, skip_through: int = 0) -> dict[str, Any]:
    """One node's participation: averaged (node, round) pairs / all its pairs.

    The node's pairs are the rounds ``first + 1 .. last``, ``first`` and ``last`` the lowest and the
    highest round it recorded: its first round is how it entered the swarm (a node that joins late
    may spend it catching up), every later round is one it was alive for. A pair is averaged if the
    node's last record of that round (a node that fell back and then adopted the round's canonical
    state records it twice) passes :func:`is_averaged`; a round in the range it has no record of (it
    skipped the round while catching up) is not. ``participation`` is None without any pair.
    ``skip_through``: rounds up to this one are left out too (a benchmark that froze the node lets
    it come back first).
    ``final_param_hash`` / ``final_round``: of the node's last round record in file order.
    """
    by_round = {int(r["round"]): r for r in rounds}
    if not by_round:
        empty = {"first_round": None, "final_round": None, "final_param_hash": None}
        return empty | {"num_pairs": 0, "num_averaged": 0, "participation": None}
    first, last = min(by_round), max(by_round)
    pairs = range(max(first, skip_through) + 1, last + 1)
    num_averaged = sum(1 for r in pairs if r in by_round and is_averaged(by_round[r]))
    return {
        "first_round": first,
        "final_round": int(rounds[-1]["round"]),
        "final_param_hash": str(rounds[-1]["param_hash"]),
        "num_pairs": len(pairs),
        "num_averaged": num_averaged,
        "participation": num_averaged / len(pairs) if pairs else None,
    }


def swarm_participation(per_node: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The swarm's participation from :func:`node_participation` of every node: all nodes' averaged
    pairs / all nodes' pairs (None without any pair)."""
    num_pairs = sum(int(node["num_pairs"]) for node in per_node)
    num_averaged = sum(int(node["num_averaged"]) for node in per_node)
    return {
        "num_pairs": num_pairs,
        "num_averaged": num_averaged,
        "participation": num_averaged / num_pairs if num_pairs else None,
    }


def run_problems(names: Sequence[str], rounds_per_node: Sequence[Sequence[Mapping[str, Any]]]) -> list[str]:
    """Why a run whose nodes all stopped by themselves did not do its job; empty if it did.

    A swarm run must end on one model averaged by several nodes, so each of these is a failure:
    a node recorded no round; the nodes' last round records (in file order) hold different
    ``param_hash`` (a split into lineages, or a node that stopped rounds behind); a round every node
    recorded ended on different ``param_hash`` (:func:`hash_agreement`); with two or more nodes, no
    record of any node averaged two or more nodes (:func:`is_averaged`: every node trained alone).
    """
    problems = []
    silent = [name for name, rounds in zip(names, rounds_per_node, strict=True) if not rounds]
    if silent:
        problems.append(f"{', '.join(silent)} recorded no round")
    finals = {name: rounds[-1] for name, rounds in zip(names, rounds_per_node, strict=True) if rounds}
    if len({str(r["param_hash"]) for r in finals.values()}) > 1:
        listed = ", ".join(
            f"{name} {str(r['param_hash'])[:10]} (round {r['round']})" for name, r in finals.items()
        )
        problems.append(f"final param_hash differs: {listed}")
    disagreeing = hash_agreement(rounds_per_node)["disagreeing_rounds"]
    if disagreeing:
        problems.append(f"param_hash differs in common round(s) {disagreeing}")
    if len(names) >= 2 and not any(is_averaged(r) for rounds in rounds_per_node for r in rounds):
        problems.append("no round averaged two or more nodes")
    return problems


def interrupted_run_problems(rounds_per_node: Sequence[Sequence[Mapping[str, Any]]]) -> list[str]:
    """What a run stopped by a signal got wrong before the stop; empty if nothing.

    A stopped run has not finished its job, so :func:`run_problems`' "no round averaged" and "final
    param_hash differs" do not apply (its nodes may stop a round apart, and a node whose peers left
    first may fall back alone in its last round). A split does: a round every node recorded, other
    than any node's last, that ended on different ``param_hash``.
    """
    settled = []
    for rounds in rounds_per_node:
        last = max((int(r["round"]) for r in rounds), default=None)
        settled.append([r for r in rounds if int(r["round"]) != last])
    disagreeing = hash_agreement(settled)["disagreeing_rounds"] if all(settled) else []
    return [f"param_hash differs in common round(s) {disagreeing} before the stop"] if disagreeing else []


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def hash_verdict(agreement: Mapping[str, Any]) -> str:
    """One sentence on ``hash_agreement``'s result (``report.md`` of ``dtnode swarm`` and ``dtnode
    report``): identical after every common round, no common round, or the rounds that differ."""
    if agreement["all_agree"]:
        return f"every node held the same param_hash after each of the {len(agreement['common_rounds'])} common round(s)"
    if not agreement["common_rounds"]:
        return "no round was recorded by every node"
    return f"**param_hash differs between nodes in round(s) {agreement['disagreeing_rounds']}**"


def report_markdown(report: Mapping[str, Any]) -> str:
    """The launcher's summary; reports written before participation was recorded render without it."""
    where = (
        "loopback" if report["link_mbit"] is None else f"WAN emulator, {report['link_mbit']:g} Mbit/s uplinks"
    )
    verdict = hash_verdict(report["param_hash"])
    lines = [
        "# dtnode swarm report",
        "",
        f"{report['num_nodes']} node(s), {where}; stopped by: {report['stopped_by']}; "
        f"wall time {report['wall_seconds']:.1f} s.",
        "",
        f"param_hash: {verdict}.",
        "",
    ]
    if "problems" in report:
        problems = report["problems"]
        lines += [f"Verdict: {'**' + '; '.join(problems) + '**' if problems else 'ok'}.", ""]
    if "participation" in report:
        swarm = report["participation"]
        lines += [
            f"Participation: {_percent(swarm['participation'])} ({swarm['num_averaged']} of "
            f"{swarm['num_pairs']} (node, round) pairs after each node's first round averaged two or "
            "more nodes).",
            "",
        ]
    lines += [
        "| node | exit code | rounds | eval_loss after each round | MB sent | MB received | fell back | adopted "
        "| participation | utilization | final round | final param_hash |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for node in report["nodes"]:
        losses = ", ".join("-" if loss is None else f"{loss:.4f}" for loss in node["eval_losses"])
        pairs = f" ({node['num_averaged']}/{node['num_pairs']})" if "num_pairs" in node else ""
        final_hash = node.get("final_param_hash")
        busy = node.get("utilization")  # the run's inner compute / wall time (older reports lack it)
        lines.append(
            f"| {node['name']} | {node['exit_code']} | {node['num_rounds']} | {losses or '-'} | "
            f"{node['bytes_sent'] / 1e6:.2f} | {node['bytes_recv'] / 1e6:.2f} | "
            f"{len(node['fell_back_rounds'])} | {len(node['adopted_rounds'])} | "
            f"{_percent(node.get('participation'))}{pairs} | {'-' if busy is None else f'{busy:.2f}'} | "
            f"{node.get('final_round') or '-'} | "
            f"{final_hash[:10] if final_hash else '-'} |"
        )
    return "\n".join(lines) + "\n"
