"""What ``dtnode swarm`` shows and reports: the nodes' round records as they are written, one line
per round per node, whether the nodes agree on ``param_hash``, and ``report.md``.

Pure reading and formatting (``node/launcher.py`` runs the processes); the records follow the
``metrics.jsonl`` contract of ``node/metrics.py``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
    """``node-1 round 3 | eval_loss 2.71 | peers 3 | 1.2 MB sent | param_hash 0cefb6a965``."""
    eval_loss = record.get("eval_loss")
    loss_text = "nan" if eval_loss is None else f"{eval_loss:.4f}"
    line = (
        f"{name} round {record['round']} | eval_loss {loss_text} | peers {record['peers']} | "
        f"{record['bytes_sent'] / 1e6:.1f} MB sent | param_hash {record['param_hash'][:10]}"
    )
    if record.get("fell_back"):
        line += " | fell back (own Δ)"
    if record.get("adopted"):
        line += " | adopted the swarm's state"
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


def report_markdown(report: Mapping[str, Any]) -> str:
    where = (
        "loopback" if report["link_mbit"] is None else f"WAN emulator, {report['link_mbit']:g} Mbit/s uplinks"
    )
    agreement = report["param_hash"]
    if agreement["all_agree"]:
        verdict = f"every node held the same param_hash after each of the {len(agreement['common_rounds'])} common round(s)"
    elif not agreement["common_rounds"]:
        verdict = "no round was recorded by every node"
    else:
        verdict = f"**param_hash differs between nodes in round(s) {agreement['disagreeing_rounds']}**"
    lines = [
        "# dtnode swarm report",
        "",
        f"{report['num_nodes']} node(s), {where}; stopped by: {report['stopped_by']}; "
        f"wall time {report['wall_seconds']:.1f} s.",
        "",
        f"param_hash: {verdict}.",
        "",
        "| node | exit code | rounds | eval_loss after each round | MB sent | MB received | fell back | adopted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for node in report["nodes"]:
        losses = ", ".join("nan" if loss is None else f"{loss:.4f}" for loss in node["eval_losses"])
        lines.append(
            f"| {node['name']} | {node['exit_code']} | {node['num_rounds']} | {losses or '-'} | "
            f"{node['bytes_sent'] / 1e6:.2f} | {node['bytes_recv'] / 1e6:.2f} | "
            f"{len(node['fell_back_rounds'])} | {len(node['adopted_rounds'])} |"
        )
    return "\n".join(lines) + "\n"
