"""The node's Prometheus endpoint (``--metrics-port``): the metrics records as gauges and counters.

:class:`PrometheusExporter` is a sink of :class:`~node.metrics.MetricsWriter`: it reads the same
step and round records as ``metrics.jsonl`` (``node/metrics.py`` defines every field) and keeps
them on a registry of its own, served over HTTP by prometheus_client's server thread. A scrape
reads the latest values; nothing here waits on the training thread.

=========================================  =========  ===============================================
metric                                     type       from
=========================================  =========  ===============================================
``dtnode_loss``                            gauge      step ``loss`` (the latest inner step)
``dtnode_learning_rate``                   gauge      step ``lr``
``dtnode_tokens_per_second``               gauge      step ``tokens_per_s``
``dtnode_inner_step``                      gauge      step ``step`` (over the whole run)
``dtnode_training_tokens``                 gauge      ``tokens`` (this node's, over the whole run)
``dtnode_outer_round``                     gauge      round ``round``
``dtnode_eval_loss``                       gauge      round ``eval_loss``
``dtnode_peers``                           gauge      round ``peers`` (contributions in the mean)
``dtnode_round_duration_seconds``          histogram  ``seconds_compute + seconds_blocked``: the
                                                      training thread's time for the round
``dtnode_round_seconds{part}``             gauge      the latest round's ``compute``, ``comm``
                                                      (all-reduce wall time) and ``blocked``
``dtnode_bytes_sent_total{phase}``         counter    ``bytes_by_phase``: ``reduce_scatter``
                                                      (contributions) and ``all_gather`` (averages,
                                                      replicas); their sum is ``bytes_sent``
``dtnode_bytes_received_total{phase}``     counter    the same for ``bytes_recv``; ``state_sync``:
                                                      ``bytes_recv_state_sync``
``dtnode_codec_error``                     gauge      ``codec_error`` (NaN when nothing was encoded)
``dtnode_failures_total{kind}``            counter    ``failures_by_kind``
``dtnode_rounds_total{outcome}``           counter    ``averaged``, ``fell_back``, ``adopted`` or
                                                      ``caught_up`` (adopted with the round's mean)
``dtnode_utilization``                     gauge      ``utilization`` (NaN when not measured)
``dtnode_pseudo_gradient_norm``            gauge      ``pseudo_gradient_norm`` (of the mean applied)
``process_*``                              (several)  prometheus_client's process collector: resident
                                                      memory, CPU seconds, open file descriptors
=========================================  =========  ===============================================

Counts over the whole run (steps, tokens, rounds) are gauges: a resumed run continues them from its
checkpoint, which a Prometheus counter (starting at 0 in every process) cannot express. The
``_total`` counters count what this process saw.
"""

from __future__ import annotations

import math
import threading
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from node.metrics import FAILURE_KINDS

ROUND_OUTCOMES = ("averaged", "fell_back", "adopted", "caught_up")
ALLREDUCE_PHASES = ("reduce_scatter", "all_gather")
# Rounds last from seconds (a toy model on loopback) to an hour (a large model over a WAN).
ROUND_DURATION_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
SERVER_STOP_TIMEOUT_S = 5.0


def _gauge_value(value: Any) -> float:
    """A record value as a gauge value: null (not measured) is NaN, Prometheus' "no value"."""
    return math.nan if value is None else float(value)


class PrometheusExporter:
    """Gauges and counters of the metrics records, on a registry of its own (so that several
    exporters, e.g. in tests, never clash on prometheus_client's global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, open fds
        self.loss = Gauge("dtnode_loss", "Training loss of the latest inner step.", registry=registry)
        self.learning_rate = Gauge(
            "dtnode_learning_rate", "Inner AdamW learning rate of the latest step.", registry=registry
        )
        self.tokens_per_second = Gauge(
            "dtnode_tokens_per_second",
            "Training tokens per second of the latest inner step.",
            registry=registry,
        )
        self.inner_step = Gauge(
            "dtnode_inner_step",
            "Inner steps done over the whole run (a resumed run continues).",
            registry=registry,
        )
        self.training_tokens = Gauge(
            "dtnode_training_tokens", "Tokens this node trained on over the whole run.", registry=registry
        )
        self.outer_round = Gauge(
            "dtnode_outer_round", "Outer rounds applied over the whole run.", registry=registry
        )
        self.eval_loss = Gauge("dtnode_eval_loss", "Held-out loss after the latest round.", registry=registry)
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
        self.bytes_sent = Counter(
            "dtnode_bytes_sent", "Wire bytes this node sent, by phase.", ["phase"], registry=registry
        )
        self.bytes_received = Counter(
            "dtnode_bytes_received", "Wire bytes this node received, by phase.", ["phase"], registry=registry
        )
        self.codec_error = Gauge(
            "dtnode_codec_error",
            "Latest averaged round: norm of the error-feedback residual over the pseudo-gradient's.",
            registry=registry,
        )
        self.failures = Counter(
            "dtnode_failures",
            "Failures in outer rounds, by kind (node/metrics.py).",
            ["kind"],
            registry=registry,
        )
        self.rounds = Counter("dtnode_rounds", "Outer rounds, by outcome.", ["outcome"], registry=registry)
        self.utilization = Gauge(
            "dtnode_utilization",
            "Latest round: share of the training thread's time spent on inner steps.",
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
            self.bytes_sent.labels(phase=phase)
        for phase in (*ALLREDUCE_PHASES, "state_sync"):
            self.bytes_received.labels(phase=phase)
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome=outcome)
        for gauge in (
            self.loss,
            self.eval_loss,
            self.codec_error,
            self.utilization,
            self.pseudo_gradient_norm,
        ):
            gauge.set(math.nan)  # not measured before the first round
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # --- the sink ---

    def write(self, record: dict[str, Any]) -> None:
        """Update the metrics from one step or round record."""
        if "tokens" in record:
            self.training_tokens.set(record["tokens"])
        if record["kind"] == "step":
            self.loss.set(_gauge_value(record["loss"]))
            self.learning_rate.set(record["lr"])
            self.tokens_per_second.set(record["tokens_per_s"])
            self.inner_step.set(record["step"])
        elif record["kind"] == "round":
            self._write_round(record)

    def _write_round(self, record: dict[str, Any]) -> None:
        self.outer_round.set(record["round"])
        self.eval_loss.set(_gauge_value(record["eval_loss"]))
        self.peers.set(record["peers"])
        compute, comm = record["seconds_compute"], record["seconds_comm"]
        blocked = record.get("seconds_blocked", comm)
        self.round_duration.observe(compute + blocked)
        for part, seconds in (("compute", compute), ("comm", comm), ("blocked", blocked)):
            self.round_seconds.labels(part=part).set(seconds)
        by_phase = record.get("bytes_by_phase") or {}
        for phase in ALLREDUCE_PHASES:
            self.bytes_sent.labels(phase=phase).inc(by_phase.get(f"sent_{phase}", 0))
            self.bytes_received.labels(phase=phase).inc(by_phase.get(f"recv_{phase}", 0))
        self.bytes_received.labels(phase="state_sync").inc(record.get("bytes_recv_state_sync", 0))
        self.codec_error.set(_gauge_value(record.get("codec_error")))
        for kind, count in record.get("failures_by_kind", {}).items():
            self.failures.labels(kind=kind).inc(count)
        outcome = "averaged"
        if record["adopted"]:
            outcome = "caught_up" if record.get("caught_up") else "adopted"
        elif record["fell_back"]:
            outcome = "fell_back"
        self.rounds.labels(outcome=outcome).inc()
        self.utilization.set(_gauge_value(record.get("utilization")))
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
