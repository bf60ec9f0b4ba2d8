"""The run directory's ``metrics.jsonl``: one JSON object per inner step and per outer round.

Contract (read by ``dtnode report``, benchmarks and tests):

- ``{"kind": "step", "round", "step", "loss", "lr", "tokens", "tokens_per_s", "time"}`` after every
  inner step; ``round`` is the outer round the step belongs to (1-based), ``step`` the global inner
  step count after it, ``tokens`` this node's cumulative training tokens.
- ``{"kind": "round", "round", "eval_loss", "peers", "bytes_sent", "bytes_recv", "seconds_compute",
  "seconds_comm", "param_hash", "fell_back", "adopted", "shard", …}`` after every outer round;
  ``param_hash`` is the SHA-256 of the global params in canonical order, ``peers`` how many
  contributions the round's mean holds, ``fell_back`` that this node stepped on its own Δ (the
  swarm round failed), ``adopted`` that it replaced its state by the swarm's instead of stepping
  (then ``round`` is the swarm's), ``shard`` the ``[index, count]`` it reads in the next phase.

Lines are flushed as written, so a crash loses at most the line being written; a resumed run appends.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._handle: IO[str] = open(path, "a", buffering=1)  # line-buffered

    def write(self, record: dict[str, Any]) -> None:
        if self._handle.closed:  # written to after close() (e.g. a round finished after the loop): append
            self._handle = open(self.path, "a", buffering=1)
        # JSON has no NaN/Inf: a diverged loss is written as null rather than breaking readers.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._handle.write(json.dumps(clean, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._handle.close()


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
