"""What a person watching the node sees: a live display on a terminal, plain log lines otherwise.

Both are sinks of :class:`~node.ops.metrics.MetricsWriter`, so they show exactly the records written
to ``metrics.jsonl``:

- :class:`PlainProgress` (stderr is not a terminal, or ``--log-format json``): one log line every
  ``log_every`` inner steps and one per outer round, in the format scripts parse::

      round 3 | step 120 (20/50) | loss 2.3456 | lr 1.00e-03 | 12,345 tok/s
      round 3 done | eval_loss 2.4000 | peers 2 | compute 40.0s comm 1.20s (blocked 1.20s) | sent 1.52 MB recv 1.49 MB at density 1.51% | all-reduce 3% of the round | param_hash 0a1b2c3d4e5f

  (the bytes, density and all-reduce parts only for a round whose all-reduce ran; with
  ``--fragments`` the line names the round's fragment and that fragment's hash before the whole
  model's: ``| fragment 2 3f9a0c1d2e4b | param_hash …``)

- :class:`LiveProgress` (``--log-format text`` on a terminal): a rich display redrawn in place::

      round 4 inner steps ━━━━━━━━╸           20/50 0:01:02 loss 2.3456 | lr 1.00e-03 | 12,345 tok/s
      outer rounds        ━━━━━━━━━━━━        3/5   0:03:10
      round 3: eval_loss 2.4000 | peers 2 | comm 1.20s | codec error 0.52% | utilization 97% | sent 1.52 MB at density 1.51% | all-reduce 3%

  (the last line adds the round's failures by kind, and whether it fell back or adopted the
  swarm's state). The round lines above still scroll by as log lines, printed through the console
  shared with the log handler (``node/ops/logs.py``) so they never tear the display.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

from node.config import NodeConfig
from node.ops.logs import terminal_console
from node.ops.metrics import wire_text

log = logging.getLogger("dtnode")


class PlainProgress:
    """Log lines for steps (every ``log_every``, unless ``log_steps`` is off) and rounds."""

    def __init__(self, *, inner_steps: int, log_every: int, log_steps: bool = True) -> None:
        if inner_steps < 1 or log_every < 1:
            raise ValueError(f"inner_steps and log_every must be >= 1, got {inner_steps} and {log_every}")
        self.inner_steps = inner_steps
        self.log_every = log_every
        self.log_steps = log_steps

    def write(self, record: dict[str, Any]) -> None:
        if record["kind"] == "step" and self.log_steps and record["step"] % self.log_every == 0:
            in_round = (record["step"] - 1) % self.inner_steps + 1
            log.info(
                "round %d | step %d (%d/%d) | loss %.4f | lr %.2e | %s tok/s",
                record["round"], record["step"], in_round, self.inner_steps,
                record["loss"], record["lr"], f"{record['tokens_per_s']:,.0f}",
            )  # fmt: skip
        elif record["kind"] == "round":
            wire = "".join(f" | {part}" for part in wire_text(record, received=True))
            wire += fragment_text(record)
            log.info(
                "round %d done | eval_loss %s | peers %d | compute %.1fs comm %.2fs (blocked %.2fs)%s | param_hash %s",
                record["round"], eval_text(record), record["peers"], record["seconds_compute"],
                record["seconds_comm"], record["seconds_blocked"], wire, record["param_hash"][:12],
            )  # fmt: skip

    def close(self) -> None:
        """Nothing to release: every line was logged as its record came."""


def fragment_text(record: dict[str, Any]) -> str:
    """`` | fragment f <its hash>`` for a fragment's round (``--fragments``), else nothing."""
    fragment = record.get("fragment")
    if fragment is None:
        return ""
    return f" | fragment {fragment} {(record.get('fragment_hash') or '-')[:12]}"


def eval_text(record: dict[str, Any]) -> str:
    """The round's held-out loss, or ``-`` in a round without eval (``--eval-every``)."""
    loss = record.get("eval_loss")
    return "-" if loss is None else f"{loss:.4f}"


def round_status(record: dict[str, Any]) -> str:
    """The live display's summary of a round record."""
    parts = [
        *([f"fragment {record['fragment']}"] if record.get("fragment") is not None else []),
        f"eval_loss {eval_text(record)}",
        f"peers {record['peers']}",
        f"comm {record['seconds_comm']:.2f}s",
    ]
    if record.get("codec_error") is not None:
        parts.append(f"codec error {record['codec_error']:.2%}")
    if record.get("utilization") is not None:
        parts.append(f"utilization {record['utilization']:.0%}")
    parts += wire_text(record, received=False)
    failures = record.get("failures_by_kind") or {}
    if failures:
        parts.append("failures " + ", ".join(f"{kind} {count}" for kind, count in sorted(failures.items())))
    if record.get("adopted"):
        parts.append("adopted the swarm's state")
    elif record.get("fell_back"):
        parts.append("fell back to own Δ")
    elif record.get("solo"):
        parts.append("solo (no other node in the round)")
    return " | ".join(parts)


class _Display(Progress):
    """The bars, with the last round's summary as one line under them."""

    round_line: Text = Text("")

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        yield self.round_line


class LiveProgress:
    """Bars of inner steps and outer rounds redrawn on ``console``; round lines are still logged.

    The display starts with the first record (the start-up log lines print normally before it)
    and stops, leaving its last frame on screen, at :meth:`close`.
    """

    def __init__(self, console: Console, *, inner_steps: int, log_every: int, max_rounds: int = 0) -> None:
        self.inner_steps = inner_steps
        self.rounds_log = PlainProgress(inner_steps=inner_steps, log_every=log_every, log_steps=False)
        self.display = _Display(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            # On a narrow terminal the status is cut with an ellipsis, never the counts.
            TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
            console=console,
        )
        self._steps: TaskID = self.display.add_task("round 1 inner steps", total=inner_steps, status="")
        self._rounds: TaskID = self.display.add_task("outer rounds", total=max_rounds or None, status="")
        self._started = False

    def write(self, record: dict[str, Any]) -> None:
        if not self._started:
            self.display.start()
            self._started = True
        if record["kind"] == "step":
            self.display.update(
                self._steps,
                description=f"round {record['round']} inner steps",
                completed=(record["step"] - 1) % self.inner_steps + 1,
                status=f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s",
            )
        elif record["kind"] == "round":
            self.display.update(self._rounds, completed=record["round"])
            line = f"round {record['round']}: {round_status(record)}"
            self.display.round_line = Text(line, no_wrap=True, overflow="ellipsis")
            self.rounds_log.write(record)

    def close(self) -> None:
        """Stop redrawing (idempotent); the last frame stays on the terminal."""
        if self._started:
            self._started = False
            self.display.stop()


def progress_sink(config: NodeConfig, *, is_terminal: bool | None = None) -> PlainProgress | LiveProgress:
    """The live display if stderr is a terminal (``is_terminal``, default: ask stderr) and the log
    format is text, else the plain lines."""
    if is_terminal is None:
        is_terminal = sys.stderr.isatty()
    if config.metrics.log_format == "text" and is_terminal:
        return LiveProgress(
            terminal_console(),
            inner_steps=config.inner.steps,
            log_every=config.metrics.log_every,
            max_rounds=config.run.max_rounds,
        )
    return PlainProgress(inner_steps=config.inner.steps, log_every=config.metrics.log_every)
