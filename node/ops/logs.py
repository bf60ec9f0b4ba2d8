"""Where the node's log lines go, and in which format (``--log-format text|json``).

Three setups, chosen once at start by :func:`configure_logging`:

- ``text`` on a pipe or file (a launcher, a script, a test): plain lines
  ``HH:MM:SS logger message`` on stderr. Scripts parse these (``scripts/bench/join_log.py``,
  ``scripts/bench/bench_utilization.py``), so their format does not change.
- ``text`` on a terminal: the same lines, printed through one shared rich console
  (:func:`terminal_console`) so that they scroll above the live display of ``node/ops/progress.py``
  instead of tearing it.
- ``json``: one JSON object per line, for log collectors: ``time`` (ISO 8601, UTC, milliseconds),
  ``level``, ``logger``, ``message``, then any ``extra={...}`` fields of the call, and
  ``exception`` / ``stack`` when the record carries them. No live display then: the stream is for
  machines.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
from datetime import UTC, datetime
from typing import IO, Any

from rich.console import Console

TEXT_FORMAT = "%(asctime)s %(name)s %(message)s"
TEXT_DATE_FORMAT = "%H:%M:%S"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",  # Python 3.12+
}


# Python's own level names, whatever a library renamed them to (hivemind makes WARNING "WARN"):
# a log collector keys on them.
_LEVEL_NAMES = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARNING",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRITICAL",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; values JSON cannot hold (paths, tensors' reprs) become strings."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": _LEVEL_NAMES.get(record.levelno, record.levelname),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and key not in payload:
                payload[key] = value
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            payload["stack"] = self.formatStack(record.stack_info)
        # JSON has no NaN/Infinity: a non-finite float (a diverged loss in an extra) is written as a string.
        clean = {
            k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in payload.items()
        }
        return json.dumps(clean, default=str)


@functools.cache
def terminal_console() -> Console:
    """The one rich console on stderr shared by the log handler and the live display."""
    return Console(stderr=True)


class ConsoleHandler(logging.Handler):
    """Prints formatted records through a rich console (plain text: no markup, no highlighting)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), markup=False, highlight=False, soft_wrap=True)
        except Exception:  # logging's contract: report a broken handler on stderr, never raise
            self.handleError(record)


def configure_logging(log_format: str = "text", *, stream: IO[str] | None = None) -> None:
    """Set up the root logger at INFO for ``log_format`` (see the module docstring).

    ``text`` leaves an already configured root logger alone (as ``logging.basicConfig`` does: a
    host such as pytest keeps its handlers); ``json`` replaces the handlers, since the CLI learns
    the format only after its first, text, setup.
    """
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, got {log_format!r}")
    stream = sys.stderr if stream is None else stream
    if log_format == "json":
        handler: logging.Handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
        logging.captureWarnings(True)  # a library's warning is a record too, not a non-JSON line
        # hivemind (the swarm's DHT) logs through a colored handler of its own that does not
        # propagate; send its records (and the libp2p daemon's it forwards) to ours instead.
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")
    elif stream is sys.stderr and stream.isatty():
        handler = ConsoleHandler(terminal_console())
        handler.setFormatter(logging.Formatter(TEXT_FORMAT, datefmt=TEXT_DATE_FORMAT))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    else:
        logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT, datefmt=TEXT_DATE_FORMAT, stream=stream)
