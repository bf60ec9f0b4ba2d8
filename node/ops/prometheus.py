"""The node's Prometheus endpoint (``--metrics-port``): the metrics records as Prometheus metrics.

:class:`PrometheusExporter` is a sink of :class:`~node.ops.metrics.MetricsWriter`: it reads the same
step and round records as ``metrics.jsonl`` (``node/ops/metrics.py`` defines every field) and keeps
them on a registry of its own, served over HTTP by prometheus_client's server thread. A scrape
reads the latest values; nothing here waits on the training thread. Names follow Prometheus'
conventions: base units in the name (``_bytes``, ``_seconds``), counters end in ``_total``, shares
in ``_ratio`` (0..1), build facts as ``dtnode_build_info`` (value 1, facts in labels).

==============================================  =========  ==========================================
metric                                          type       from
==============================================  =========  ==========================================
``dtnode_build_info{version,python,torch}``     gauge      1; dtnode's, Python's and torch's versions
``dtnode_loss``                                 gauge      step ``loss`` (the latest inner step)
``dtnode_learning_rate``                        gauge      step ``lr``
``dtnode_tokens_per_second``                    gauge      step ``tokens_per_s``
``dtnode_inner_steps_total``                    counter    step ``step``: over the whole run
``dtnode_training_tokens_total``                counter    ``tokens``: this node's, over the whole run
``dtnode_outer_rounds_total``                   counter    round ``round``: over the whole run
``dtnode_eval_loss``                            gauge      the latest round's ``eval_loss`` that was
                                                           measured (``--eval-every``)
``dtnode_peers``                                gauge      round ``peers`` (contributions in the mean)
``dtnode_round_duration_seconds``               histogram  ``seconds_compute + seconds_blocked``: the
                                                           training thread's time for the round
``dtnode_round_seconds{part}``                  gauge      the latest round's ``compute``, ``comm``
                                                           (all-reduce wall time) and ``blocked``
``dtnode_sent_bytes_total{phase}``              counter    ``bytes_by_phase``: ``reduce_scatter``
                                                           (contributions) and ``all_gather`` (averages,
                                                           replicas); their sum is ``bytes_sent``
``dtnode_received_bytes_total{phase}``          counter    the same for ``bytes_recv``; ``state_sync``:
                                                           ``bytes_recv_state_sync``
``dtnode_codec_error_ratio``                    gauge      ``codec_error`` (NaN when nothing was encoded)
``dtnode_failures_total{kind}``                 counter    ``failures_by_kind``
``dtnode_round_outcomes_total{outcome}``        counter    ``averaged``, ``fell_back``, ``adopted`` or
                                                           ``caught_up`` (adopted with the round's mean)
``dtnode_utilization_ratio``                    gauge      ``utilization`` (NaN when not measured)
``dtnode_blocked_ratio``                        gauge      ``blocked_share``: time waiting for the swarm
``dtnode_pseudo_gradient_norm``                 gauge      ``pseudo_gradient_norm`` (of the mean applied)
``process_*``                                   (several)  prometheus_client's process collector: resident
                                                           memory, CPU seconds, open file descriptors
==============================================  =========  ==========================================

The three run-wide counters (steps, tokens, rounds) continue from the checkpoint when a run
resumes, so across a restart they keep growing rather than falling to 0 (what Prometheus would read
as a counter reset); they are absent from a scrape until the process writes its first record. The
other ``_total`` counters count what this process saw (they start at 0 in every process).
"""

from __future__ import annotations

import math
import platform
import threading
from collections.abc import Iterator
from importlib import metadata
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from node import __version__
from node.ops.metrics import FAILURE_KINDS

ROUND_OUTCOMES = ("averaged", "fell_back", "adopted", "caught_up")
ALLREDUCE_PHASES = ("reduce_scatter", "all_gather")
# Rounds last from seconds (a toy model on loopback) to an hour (a large model over a WAN).
ROUND_DURATION_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
SERVER_STOP_TIMEOUT_S = 5.0
# Run-wide counters: metric name (without _total), help, record field, the record kinds it is read from.
RUN_TOTALS = (
    (
        "dtnode_inner_steps",
        "Inner steps done over the whole run (a resumed run continues).",
        "step",
        ("step",),
    ),
    (
        "dtnode_training_tokens",
        "Tokens this node trained on over the whole run.",
        "tokens",
        ("step", "round"),
    ),
    (
        "dtnode_outer_rounds",
        "Outer rounds applied over the whole run (a resumed run continues).",
        "round",
        ("round",),
    ),
)


def _gauge_value(value: Any) -> float:
    """A record value as a gauge value: null (not measured) is NaN, Prometheus' "no value"."""
    return math.nan if value is None else float(value)


def build_facts() -> dict[str, str]:
    """The labels of ``dtnode_build_info``."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    return {"version": __version__, "python": platform.python_version(), "torch": torch_version}


class RunTotals(Collector):
    """Counters of the whole run, taken from the records (which continue from the checkpoint) rather
    than counted from 0 in this process; nothing is exported before the first record sets them."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}

    def update(self, record: dict[str, Any]) -> None:
        for name, _, key, kinds in RUN_TOTALS:
            if record["kind"] in kinds and key in record:
                self._values[name] = float(record[key])

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, documentation, _, _ in RUN_TOTALS:
            if name in self._values:
                yield CounterMetricFamily(name, documentation, value=self._values[name])


class PrometheusExporter:
    """Gauges and counters of the metrics records, on a registry of its own (so that several
    exporters, e.g. in tests, never clash on prometheus_client's global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, open fds
        Info("dtnode_build", "The dtnode build this node runs (value 1).", registry=registry).info(
            build_facts()
        )
        self.run_totals = RunTotals()
        registry.register(self.run_totals)
        self.loss = Gauge("dtnode_loss", "Training loss of the latest inner step.", registry=registry)
        self.learning_rate = Gauge(
            "dtnode_learning_rate", "Inner AdamW learning rate of the latest step.", registry=registry
        )
        self.tokens_per_second = Gauge(
            "dtnode_tokens_per_second",
            "Training tokens per second of the latest inner step.",
            registry=registry,
        )
        self.eval_loss = Gauge(
            "dtnode_eval_loss", "Held-out loss of the latest round that measured it.", registry=registry
        )
        self.peers = Gauge(
            "dtnode_peers",
            "Contributions in the latest round's mean (1 = this node alone).",
            registry=registry,
        )
        self.round_duration = Histogram(
            "dtnode_round_duration_seconds",
            "Training-thread time per outer round: inner steps plus waiting for the swarm.",
            buckets=ROUND_DURATION_BUCKETS,
            registry=registry,
        )
        self.round_seconds = Gauge(
            "dtnode_round_seconds",
            "The latest round's inner-step compute, all-reduce (comm) and blocked-on-the-swarm seconds.",
            ["part"],
            registry=registry,
        )
        self.sent_bytes = Counter(
            "dtnode_sent_bytes", "Wire bytes this node sent, by phase.", ["phase"], registry=registry
        )
        self.received_bytes = Counter(
            "dtnode_received_bytes", "Wire bytes this node received, by phase.", ["phase"], registry=registry
        )
        self.codec_error = Gauge(
            "dtnode_codec_error_ratio",
            "Latest averaged round: norm of the error-feedback residual over the pseudo-gradient's.",
            registry=registry,
        )
        self.failures = Counter(
            "dtnode_failures",
            "Failures in outer rounds, by kind (node/ops/metrics.py).",
            ["kind"],
            registry=registry,
        )
        self.round_outcomes = Counter(
            "dtnode_round_outcomes",
            "Outer rounds this process ended, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.utilization = Gauge(
            "dtnode_utilization_ratio",
            "Latest round: share of the wall time since the previous round spent on inner steps.",
            registry=registry,
        )
        self.blocked = Gauge(
            "dtnode_blocked_ratio",
            "Latest round: share of the wall time since the previous round spent waiting for the swarm.",
            registry=registry,
        )
        self.pseudo_gradient_norm = Gauge(
            "dtnode_pseudo_gradient_norm",
            "Norm of the mean pseudo-gradient of the latest round.",
            registry=registry,
        )
        # Every known label exists from the start at 0, so rate() and alerts see a series before
        # the first event rather than none.
        for phase in ALLREDUCE_PHASES:
            self.sent_bytes.labels(phase=phase)
        for phase in (*ALLREDUCE_PHASES, "state_sync"):
            self.received_bytes.labels(phase=phase)
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)
        for outcome in ROUND_OUTCOMES:
            self.round_outcomes.labels(outcome=outcome)
        for gauge in (
            self.loss,
            self.eval_loss,
            self.codec_error,
            self.utilization,
            self.blocked,
            self.pseudo_gradient_norm,
        ):
            gauge.set(math.nan)  # not measured before the first round
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # --- the sink ---

    def write(self, record: dict[str, Any]) -> None:
        """Update the metrics from one step or round record."""
        self.run_totals.update(record)
        if record["kind"] == "step":
            self.loss.set(_gauge_value(record["loss"]))
            self.learning_rate.set(record["lr"])
            self.tokens_per_second.set(record["tokens_per_s"])
        elif record["kind"] == "round":
            self._write_round(record)

    def _write_round(self, record: dict[str, Any]) -> None:
        if record.get("eval_loss") is not None:  # null: this round did not evaluate (--eval-every)
            self.eval_loss.set(float(record["eval_loss"]))
        self.peers.set(record["peers"])
        compute, comm = record["seconds_compute"], record["seconds_comm"]
        blocked = record.get("seconds_blocked", comm)
        self.round_duration.observe(compute + blocked)
        for part, seconds in (("compute", compute), ("comm", comm), ("blocked", blocked)):
            self.round_seconds.labels(part=part).set(seconds)
        by_phase = record.get("bytes_by_phase") or {}
        for phase in ALLREDUCE_PHASES:
            self.sent_bytes.labels(phase=phase).inc(by_phase.get(f"sent_{phase}", 0))
            self.received_bytes.labels(phase=phase).inc(by_phase.get(f"recv_{phase}", 0))
        self.received_bytes.labels(phase="state_sync").inc(record.get("bytes_recv_state_sync", 0))
        self.codec_error.set(_gauge_value(record.get("codec_error")))
        for kind, count in record.get("failures_by_kind", {}).items():
            self.failures.labels(kind=kind).inc(count)
        outcome = "averaged"
        if record["adopted"]:
            outcome = "caught_up" if record.get("caught_up") else "adopted"
        elif record["fell_back"]:
            outcome = "fell_back"
        self.round_outcomes.labels(outcome=outcome).inc()
        self.utilization.set(_gauge_value(record.get("utilization")))
        self.blocked.set(_gauge_value(record.get("blocked_share")))
        self.pseudo_gradient_norm.set(_gauge_value(record.get("pseudo_gradient_norm")))

    # --- the HTTP endpoint ---

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port (``port``
        0 = any free one). OSError if the address cannot be bound."""
        if self._server is not None:
            raise RuntimeError("the exporter is already serving")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    @property
    def port(self) -> int | None:
        """The port being served, None when not serving."""
        return None if self._server is None else int(self._server.server_port)

    def close(self) -> None:
        """Stop serving (idempotent); the metrics keep their values."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()  # returns once serve_forever has left its loop (it polls every 0.5 s)
        server.server_close()
        if thread is not None:
            thread.join(timeout=SERVER_STOP_TIMEOUT_S)
