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
``dtnode_round``                                gauge      round ``round``: the rounds the node's global
                                                           params have been through (an adoption may
                                                           set it back: a gauge, not a counter)
``dtnode_last_round_timestamp_seconds``         gauge      round ``time``: when the latest round ended
                                                           (Unix time; ``time() - …`` is its age)
``dtnode_params_info{round,param_hash}``        gauge      1; the latest round and the first 16 hex
                                                           digits of its ``param_hash`` (one series)
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
``dtnode_codec_error_ratio``                    gauge      ``codec_error`` (of the latest round that
                                                           encoded something)
``dtnode_failures_total{kind}``                 counter    ``failures_by_kind``
``dtnode_round_outcomes_total{outcome}``        counter    ``averaged``, ``solo`` (no other node in the round),
                                                           ``fell_back``, ``adopted`` or ``caught_up``
                                                           (adopted with the round's mean)
``dtnode_utilization_ratio``                    gauge      ``utilization`` (of the latest round that
                                                           measured it)
``dtnode_blocked_ratio``                        gauge      ``blocked_share``: time waiting for the swarm
``dtnode_pseudo_gradient_norm``                 gauge      ``pseudo_gradient_norm`` (of the mean applied)
``process_*``                                   (several)  prometheus_client's process collector: resident
                                                           memory, CPU seconds, open file descriptors
==============================================  =========  ==========================================

A gauge is absent from a scrape until the node has a value for it (no NaN stands for "not
measured yet": an alert rule compares numbers, and NaN compares false with every one); a field a
record leaves null (a swarm of one encodes nothing: no ``codec_error``) keeps the gauge's latest
measured value. Only a diverged training loss is NaN: it was measured, and NaN is what it is.

What to alert on, e.g.:

- a stall: ``time() - dtnode_last_round_timestamp_seconds > 3 * <round period>`` (or
  ``changes(dtnode_round[15m]) == 0``);
- a split swarm (two lineages that never average again): nodes at one round with different params,
  ``count by (round) (count by (round, param_hash) (dtnode_params_info)) > 1``;
- a node left alone: ``dtnode_peers == 1`` for several rounds.

The three run-wide counters (steps, tokens, rounds) continue from the checkpoint when a run
resumes, so across a restart they keep growing rather than falling to 0 (what Prometheus would read
as a counter reset); they are absent from a scrape until the process writes its first record. The
other ``_total`` counters count what this process saw (they start at 0 in every process).

The endpoint has no authentication: it binds ``--metrics-listen`` (loopback by default), and
exposing it further (``--metrics-listen 0.0.0.0``, a published container port) is for a network
only the operator's Prometheus reaches.
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from node import __version__
from node.ops.metrics import FAILURE_KINDS

ROUND_OUTCOMES = ("averaged", "solo", "fell_back", "adopted", "caught_up")
ALLREDUCE_PHASES = ("reduce_scatter", "all_gather")
# Rounds last from seconds (a toy model on loopback) to an hour (a large model over a WAN).
ROUND_DURATION_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
SERVER_STOP_TIMEOUT_S = 5.0
# The param_hash digits in dtnode_params_info: 64 bits tell lineages apart; the whole hash is in
# metrics.jsonl.
PARAM_HASH_DIGITS = 16
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
# Unlabelled gauges: metric name -> help. Each is absent from a scrape until it has a value.
GAUGES = {
    "dtnode_loss": "Training loss of the latest inner step.",
    "dtnode_learning_rate": "Inner AdamW learning rate of the latest step.",
    "dtnode_tokens_per_second": "Training tokens per second of the latest inner step.",
    "dtnode_round": "Outer rounds the node's global params have been through (an adoption may set it back).",
    "dtnode_last_round_timestamp_seconds": "Unix time at which the node's latest outer round ended.",
    "dtnode_eval_loss": "Held-out loss of the latest round that measured it.",
    "dtnode_peers": "Contributions in the latest round's mean (1 = this node alone).",
    "dtnode_codec_error_ratio": (
        "Latest round that encoded: norm of the error-feedback residual over the pseudo-gradient's."
    ),
    "dtnode_utilization_ratio": (
        "Latest round: share of the wall time since the previous round spent on inner steps."
    ),
    "dtnode_blocked_ratio": (
        "Latest round: share of the wall time since the previous round spent waiting for the swarm."
    ),
    "dtnode_pseudo_gradient_norm": "Norm of the mean pseudo-gradient of the latest round.",
}
# Round record field -> the gauge it sets (a null field leaves the gauge as it was).
ROUND_GAUGES = {
    "round": "dtnode_round",
    "time": "dtnode_last_round_timestamp_seconds",
    "eval_loss": "dtnode_eval_loss",  # null in rounds that did not evaluate (--eval-every)
    "peers": "dtnode_peers",
    "codec_error": "dtnode_codec_error_ratio",  # null when nothing was encoded
    "utilization": "dtnode_utilization_ratio",
    "blocked_share": "dtnode_blocked_ratio",
    "pseudo_gradient_norm": "dtnode_pseudo_gradient_norm",
}


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


class LatestValues(Collector):
    """The unlabelled gauges (:data:`GAUGES`) and ``dtnode_params_info``: each the latest value the
    records gave it, absent until they gave one. A scrape reads a dict a writer replaces values of
    (one reference each): it sees the old value or the new one."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.params: dict[str, str] | None = None  # the labels of dtnode_params_info

    def set(self, name: str, value: float | None) -> None:
        """``name`` to ``value``; None (not measured) leaves it as it was."""
        assert name in GAUGES, name
        if value is not None:
            self.values[name] = float(value)

    def collect(self) -> Iterator[GaugeMetricFamily | InfoMetricFamily]:
        values = dict(self.values)
        for name, documentation in GAUGES.items():
            if name in values:
                yield GaugeMetricFamily(name, documentation, value=values[name])
        params = self.params
        if params is not None:
            yield InfoMetricFamily(
                "dtnode_params",
                f"The latest round and the first {PARAM_HASH_DIGITS} hex digits of the param_hash of the "
                "global params it left (value 1); nodes of one swarm agree at each round.",
                value=params,
            )


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
        self.latest = LatestValues()
        registry.register(self.latest)
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
        # Every known label of a counter exists from the start at 0, so rate() and alerts see a series
        # before the first event rather than none.
        for phase in ALLREDUCE_PHASES:
            self.sent_bytes.labels(phase=phase)
        for phase in (*ALLREDUCE_PHASES, "state_sync"):
            self.received_bytes.labels(phase=phase)
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)
        for outcome in ROUND_OUTCOMES:
            self.round_outcomes.labels(outcome=outcome)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # --- the sink ---

    def write(self, record: dict[str, Any]) -> None:
        """Update the metrics from one step or round record."""
        self.run_totals.update(record)
        if record["kind"] == "step":
            # A diverged loss is NaN in the record (null in metrics.jsonl): measured, so shown as NaN.
            self.latest.set("dtnode_loss", math.nan if record["loss"] is None else record["loss"])
            self.latest.set("dtnode_learning_rate", record["lr"])
            self.latest.set("dtnode_tokens_per_second", record["tokens_per_s"])
        elif record["kind"] == "round":
            self._write_round(record)

    def _write_round(self, record: dict[str, Any]) -> None:
        for field, name in ROUND_GAUGES.items():
            self.latest.set(name, record.get(field))
        self.latest.params = {
            "round": str(record["round"]),
            "param_hash": str(record["param_hash"])[:PARAM_HASH_DIGITS],
        }
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
        for kind, count in record.get("failures_by_kind", {}).items():
            self.failures.labels(kind=kind).inc(count)
        outcome = "averaged"
        if record["adopted"]:
            outcome = "caught_up" if record.get("caught_up") else "adopted"
        elif record["fell_back"]:
            outcome = "fell_back"
        elif record.get("solo"):  # a round of this node alone: nothing was averaged
            outcome = "solo"
        self.round_outcomes.labels(outcome=outcome).inc()

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
