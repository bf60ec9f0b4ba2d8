"""The Prometheus endpoint: fetched over real HTTP, parsed with prometheus_client's own parser.

The reference for every value is the record it came from: hand-written records for the exporter
alone, and ``metrics.jsonl`` (the file the same records went to) for a real trainer. The round
record's swarm fields (failures by kind, codec error, state-sync bytes) are checked against a
hand-built round result and the codec's own encode/decode.
"""

from __future__ import annotations

import inspect
import math
import platform
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from node import __version__
from node.config import ConfigError, NodeConfig
from node.ops.metrics import FAILURE_KINDS, current_rss_bytes, read_metrics
from node.ops.prometheus import PrometheusExporter
from node.outer.seam import Averaged, FellBack, RoundRequest
from node.swarm.session import SwarmSession
from node.train.trainer import Trainer
from protocol.allreduce.allreduce import AllReduceResult
from protocol.codecs import get_codec
from protocol.error_feedback import ErrorFeedback
from protocol.swarm.result import GroupAveraged, RoundNotFormed, RoundResult

HTTP_TIMEOUT_S = 10

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> tuple[Samples, dict[str, str]]:
    """Every sample of ``/metrics`` as {(name, sorted labels): value}, and each family's type."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S) as response:
        text = response.read().decode()
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def exporter() -> Iterator[PrometheusExporter]:
    exporter = PrometheusExporter()
    yield exporter
    exporter.close()


def step_record(step: int, loss: float, **fields: Any) -> dict[str, Any]:
    return {"kind": "step", "round": 1, "step": step, "loss": loss, "lr": 1e-3, "tokens": 128 * step,
            "tokens_per_s": 1000.0 + step, "time": 0.0, **fields}  # fmt: skip


def round_record(round: int, **fields: Any) -> dict[str, Any]:
    record = {
        "kind": "round", "round": round, "step": 3 * round, "eval_loss": 2.5, "peers": 3,
        "bytes_sent": 1000, "bytes_recv": 2000, "seconds_compute": 4.0, "seconds_comm": 1.5,
        "seconds_blocked": 1.0, "utilization": 0.8, "param_hash": "ab" * 32, "pseudo_gradient_norm": 0.25,
        "tokens": 384 * round, "fell_back": False, "adopted": False, "shard": [0, 3],
        "bytes_recv_state_sync": 0, "codec_error": 0.004, "failures_by_kind": {}, "time": 0.0,
        "bytes_by_phase": {"sent_reduce_scatter": 600, "sent_all_gather": 400,
                           "recv_reduce_scatter": 1500, "recv_all_gather": 500},
    }  # fmt: skip
    record.update(fields)
    return record


@pytest.mark.timeout(30)
def test_endpoint_reports_the_records_it_was_given(exporter: PrometheusExporter) -> None:
    port = exporter.serve("127.0.0.1", 0)
    assert port > 0 and exporter.port == port
    samples, types = scrape(port)
    # Before any record: the labelled counters exist at 0; no gauge has a value yet, so none is in
    # the scrape (no NaN stands in for one).
    assert value(samples, "dtnode_failures_total", kind="peer") == 0
    assert value(samples, "dtnode_received_bytes_total", phase="state_sync") == 0
    assert not [key for key, sample in samples.items() if math.isnan(sample)]
    # (prometheus_client adds a <counter>_created gauge beside each counter: its own convention.)
    dtnode_gauges = {
        name
        for name, _ in samples
        if types.get(name) == "gauge" and name.startswith("dtnode_") and not name.endswith("_created")
    }
    assert dtnode_gauges == {"dtnode_build_info"}
    # The run-wide counters come from the records (a resumed run continues them): none yet.
    assert not [name for name, _ in samples if name.startswith(("dtnode_inner_steps", "dtnode_outer_rounds"))]
    # The process collector: this process's resident memory, as the kernel reports it.
    rss = current_rss_bytes()
    assert rss is not None and 0.5 * rss < value(samples, "process_resident_memory_bytes") < 2 * rss

    exporter.write(step_record(1, 3.5))
    exporter.write(step_record(2, 3.25))
    samples, _ = scrape(port)
    # Steps, no round yet: the step gauges are in, the round's are still absent.
    assert value(samples, "dtnode_loss") == 3.25
    for name in ("dtnode_round", "dtnode_last_round_timestamp_seconds", "dtnode_params_info", "dtnode_eval_loss",
                 "dtnode_peers", "dtnode_codec_error_ratio", "dtnode_utilization_ratio"):  # fmt: skip
        assert not [key for key in samples if key[0] == name], name
    exporter.write(round_record(1, failures_by_kind={"peer": 2}, time=1_700_000_000.5))
    samples, _ = scrape(port)
    assert value(samples, "dtnode_round") == 1
    assert value(samples, "dtnode_last_round_timestamp_seconds") == 1_700_000_000.5
    assert value(samples, "dtnode_params_info", round="1", param_hash="ab" * 8) == 1
    exporter.write(step_record(3, 3.0))
    exporter.write(
        round_record(2, peers=1, fell_back=True, bytes_sent=10, bytes_recv=20, bytes_recv_state_sync=4096,
                     bytes_by_phase={"sent_reduce_scatter": 7, "sent_all_gather": 3,
                                     "recv_reduce_scatter": 15, "recv_all_gather": 5},
                     codec_error=None, utilization=None, seconds_compute=100.0, seconds_comm=30.0,
                     seconds_blocked=30.0, failures_by_kind={"peer": 1, "fell_back": 1}, eval_loss=2.25,
                     param_hash="0123456789abcdef" * 4, time=1_700_000_060.25)
    )  # fmt: skip
    samples, types = scrape(port)

    assert types["dtnode_loss"] == "gauge" and types["dtnode_sent_bytes"] == "counter"
    assert types["dtnode_round_duration_seconds"] == "histogram"
    # The latest step.
    assert value(samples, "dtnode_loss") == 3.0
    assert value(samples, "dtnode_tokens_per_second") == 1003.0
    assert value(samples, "dtnode_learning_rate") == 1e-3
    assert value(samples, "dtnode_inner_steps_total") == 3
    # The latest round: a gauge of its number and its end time, one info series of its params.
    assert value(samples, "dtnode_outer_rounds_total") == 2
    assert types["dtnode_round"] == "gauge" and value(samples, "dtnode_round") == 2
    assert value(samples, "dtnode_last_round_timestamp_seconds") == 1_700_000_060.25
    assert [key for key in samples if key[0] == "dtnode_params_info"] == [
        ("dtnode_params_info", (("param_hash", "0123456789abcdef"), ("round", "2")))
    ]
    assert value(samples, "dtnode_eval_loss") == 2.25
    assert value(samples, "dtnode_peers") == 1
    # Not measured in round 2 (null): the latest measured value stays, never NaN.
    assert value(samples, "dtnode_codec_error_ratio") == 0.004
    assert value(samples, "dtnode_utilization_ratio") == 0.8
    assert value(samples, "dtnode_round_seconds", part="compute") == 100.0
    assert value(samples, "dtnode_round_seconds", part="comm") == 30.0
    assert value(samples, "dtnode_round_seconds", part="blocked") == 30.0
    assert value(samples, "dtnode_training_tokens_total") == 768  # the round record's, written last
    # Summed over both rounds.
    assert value(samples, "dtnode_sent_bytes_total", phase="reduce_scatter") == 607
    assert value(samples, "dtnode_sent_bytes_total", phase="all_gather") == 403
    assert value(samples, "dtnode_received_bytes_total", phase="reduce_scatter") == 1515
    assert value(samples, "dtnode_received_bytes_total", phase="all_gather") == 505
    assert value(samples, "dtnode_received_bytes_total", phase="state_sync") == 4096
    assert value(samples, "dtnode_failures_total", kind="peer") == 3
    assert value(samples, "dtnode_failures_total", kind="fell_back") == 1
    assert value(samples, "dtnode_failures_total", kind="timeout") == 0
    assert value(samples, "dtnode_round_outcomes_total", outcome="averaged") == 1
    assert value(samples, "dtnode_round_outcomes_total", outcome="fell_back") == 1
    assert value(samples, "dtnode_round_outcomes_total", outcome="adopted") == 0
    # Round durations 4 + 1 = 5 s and 100 + 30 = 130 s.
    assert value(samples, "dtnode_round_duration_seconds_count") == 2
    assert value(samples, "dtnode_round_duration_seconds_sum") == 135.0
    assert value(samples, "dtnode_round_duration_seconds_bucket", le="5.0") == 1
    assert value(samples, "dtnode_round_duration_seconds_bucket", le="120.0") == 1
    assert value(samples, "dtnode_round_duration_seconds_bucket", le="300.0") == 2

    # A round without an eval (--eval-every) keeps the latest measured held-out loss.
    exporter.write(round_record(3, eval_loss=None, peers=2))
    samples, _ = scrape(port)
    assert value(samples, "dtnode_eval_loss") == 2.25 and value(samples, "dtnode_outer_rounds_total") == 3

    # Two adoptions: a whole-state fetch and a step with the round's mean; then an adoption of a
    # lineage at a lower round: the round gauge goes down (a counter could not).
    exporter.write(round_record(4, adopted=True, peers=0))
    exporter.write(round_record(5, adopted=True, caught_up=True, peers=0))
    samples, _ = scrape(port)
    assert value(samples, "dtnode_round") == 5
    exporter.write(round_record(2, adopted=True, peers=0, param_hash="cd" * 32))
    samples, _ = scrape(port)
    assert value(samples, "dtnode_round") == 2
    assert [key for key in samples if key[0] == "dtnode_params_info"] == [
        ("dtnode_params_info", (("param_hash", "cd" * 8), ("round", "2")))
    ]
    assert value(samples, "dtnode_round_outcomes_total", outcome="adopted") == 2
    assert value(samples, "dtnode_round_outcomes_total", outcome="caught_up") == 1
    assert value(samples, "dtnode_round_outcomes_total", outcome="averaged") == 2

    exporter.close()
    with pytest.raises(urllib.error.URLError):
        scrape(port)


# Units a name may carry, as Prometheus' naming guide asks: base units, plural, last before _total.
UNIT_WORDS = {"bytes": "_bytes", "seconds": "_seconds", "ratio": "_ratio", "utilization": "_ratio"}


@pytest.mark.timeout(30)
def test_metric_names_follow_prometheus_conventions(exporter: PrometheusExporter) -> None:
    """Parsed with prometheus_client's own parser: counters end in _total, units are suffixes,
    shares are _ratio, every family has help, and dtnode_build_info says which build runs."""
    port = exporter.serve("127.0.0.1", 0)
    exporter.write(step_record(1, 3.5))
    exporter.write(round_record(1))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S) as response:
        text = response.read().decode()
    families = [
        family
        for family in text_string_to_metric_families(text)
        # prometheus_client's text format adds a <counter>_created gauge (the creation time) beside
        # each counter and histogram: its own convention, left out here.
        if family.name.startswith("dtnode_") and not family.name.endswith("_created")
    ]
    names = {f.name: f.type for f in families}
    assert len(names) >= 18
    for family in families:
        assert re.fullmatch(r"dtnode_[a-z][a-z0-9_]*", family.name), family.name
        assert family.documentation.strip(), family.name
        sample_names = {sample.name for sample in family.samples}
        if family.type == "counter":
            assert {name.removesuffix("_created") for name in sample_names} == {family.name + "_total"}
        else:
            assert not family.name.endswith("_total"), family.name  # only counters say total
        if family.type == "histogram":
            assert family.name.endswith("_seconds") or family.name.endswith("_bytes"), family.name
        base = family.name
        for word, suffix in UNIT_WORDS.items():
            if word in base.split("_"):
                assert base.endswith(suffix), f"{family.name}: {word} must be the {suffix} suffix"
        for sample in family.samples:
            if family.name.endswith("_ratio") and not math.isnan(sample.value):
                assert 0 <= sample.value <= 1, (sample.name, sample.value)
    # The old names are gone.
    for old in ("dtnode_bytes_sent", "dtnode_bytes_received", "dtnode_utilization", "dtnode_codec_error",
                "dtnode_inner_step", "dtnode_outer_round", "dtnode_rounds"):  # fmt: skip
        assert old not in names
    assert (
        names["dtnode_sent_bytes"] == names["dtnode_inner_steps"] == names["dtnode_outer_rounds"] == "counter"
    )
    (build,) = [f for f in families if f.name == "dtnode_build_info"]
    (sample,) = build.samples
    assert sample.value == 1 and sample.labels["version"] == __version__
    assert sample.labels["python"] == platform.python_version()
    assert sample.labels["torch"] == torch.__version__


def test_a_taken_port_is_an_error(exporter: PrometheusExporter) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            exporter.serve("127.0.0.1", taken.getsockname()[1])


def test_metrics_port_and_host_are_validated() -> None:
    with pytest.raises(ConfigError, match="metrics_port"):
        NodeConfig.from_flat(metrics_port=70000)
    assert NodeConfig().metrics.port == 0  # off unless asked for
    # The endpoint has no authentication: loopback unless the operator says otherwise.
    assert NodeConfig().metrics.listen == "127.0.0.1"
    for host in ("0.0.0.0", "::1", "[::]", "metrics.example"):
        assert NodeConfig.from_flat(metrics_listen=host).metrics.listen == host
    for wrong in ("0.0.0.0:9400", "", "a b", "http://x"):
        with pytest.raises(ConfigError, match="metrics_listen is a host"):
            NodeConfig.from_flat(metrics_listen=wrong)


def free_port() -> int:
    """A port free right now (the OS's choice for port 0); the trainer binds it a moment later."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(60)
def test_trainer_serves_its_metrics_over_http(tmp_path: Path) -> None:
    """Scraped before and after the first round: the round's gauges appear with it, none is NaN
    before; the endpoint binds loopback although the node listens on every interface."""
    corpus = tmp_path / "text.txt"
    corpus.write_text(inspect.getsource(inspect))
    port = free_port()
    config = NodeConfig.from_flat(
        model="nano", seq_len=32, batch_size=4, inner_steps=3, eval_batches=2, warmup_steps=2, total_steps=30,
        data=str(corpus), run_dir=str(tmp_path / "run"), log_every=100, listen="0.0.0.0:0", metrics_port=port,
        eval_every=1,
    )  # fmt: skip
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = Trainer(config)
    try:
        (exporter,) = [sink for sink in trainer.metrics.sinks if isinstance(sink, PrometheusExporter)]
        assert exporter._server is not None and exporter._server.server_address[0] == "127.0.0.1"
        for _ in range(config.inner.steps):  # what Trainer.run does, stopped before it closes the endpoint
            trainer.metrics.write(trainer.inner_step())
        before, _ = scrape(port)
        assert trainer.round.at_step_boundary() is not None  # the phase's end: its round is recorded
        samples, _ = scrape(port)
    finally:
        trainer.metrics.close()
        trainer.round.close()
        torch.set_num_threads(previous_threads)
    steps = read_metrics(tmp_path / "run" / "metrics.jsonl", kind="step")
    (round_,) = read_metrics(tmp_path / "run" / "metrics.jsonl", kind="round")
    assert [r["step"] for r in steps] == [1, 2, 3]
    # Before the round: the steps' gauges, nothing of a round, and no NaN anywhere.
    assert value(before, "dtnode_loss") == steps[-1]["loss"]
    assert value(before, "dtnode_inner_steps_total") == 3
    assert not [key for key, sample in before.items() if math.isnan(sample)]
    assert not [key for key in before if key[0] in ("dtnode_round", "dtnode_last_round_timestamp_seconds",
                                                     "dtnode_params_info", "dtnode_eval_loss", "dtnode_peers")]  # fmt: skip
    # After it: its number, end time and params, as metrics.jsonl has them.
    assert value(samples, "dtnode_round") == 1
    assert value(samples, "dtnode_last_round_timestamp_seconds") == round_["time"]
    assert value(samples, "dtnode_params_info", round="1", param_hash=round_["param_hash"][:16]) == 1
    assert value(samples, "dtnode_loss") == steps[-1]["loss"]
    assert value(samples, "dtnode_tokens_per_second") == steps[-1]["tokens_per_s"]
    assert value(samples, "dtnode_inner_steps_total") == 3
    assert value(samples, "dtnode_outer_rounds_total") == round_["round"] == 1
    assert value(samples, "dtnode_eval_loss") == round_["eval_loss"]
    assert value(samples, "dtnode_peers") == 1  # a swarm of one
    assert value(samples, "dtnode_utilization_ratio") == round_["utilization"]
    assert value(samples, "dtnode_round_seconds", part="compute") == round_["seconds_compute"]
    assert value(samples, "dtnode_sent_bytes_total", phase="reduce_scatter") == 0
    # Nothing was encoded (a swarm of one): no codec error, in the record or the scrape.
    assert round_["codec_error"] is None and ("dtnode_codec_error_ratio", ()) not in samples
    assert round_["failures_by_kind"] == {} and round_["bytes_recv_state_sync"] == 0
    assert round_["density"] is None and round_["allreduce_share"] is None  # no all-reduce ran
    assert round_["solo"] and value(samples, "dtnode_round_outcomes_total", outcome="solo") == 1
    assert value(samples, "dtnode_round_outcomes_total", outcome="averaged") == 0
    with pytest.raises(urllib.error.URLError):  # closed with the metrics writer
        scrape(port)


class FakeSwarm:
    """Just enough of SwarmNode for SwarmSession.average: run_round returns a prepared result, and
    like the real all-reduce encodes the vector through the error feedback."""

    def __init__(self, result: RoundResult | Exception) -> None:
        self.result = result
        self.codec = get_codec("int8")

    def run_round(
        self, vector: torch.Tensor, *, error_feedback: ErrorFeedback | None, **_: Any
    ) -> RoundResult:
        if isinstance(self.result, Exception):
            raise self.result
        assert error_feedback is not None
        error_feedback.encode(self.codec, vector, 0)
        return self.result


def session_with(result: RoundResult | Exception, num_elements: int) -> SwarmSession:
    session = SwarmSession(FakeSwarm(result), joining=False)  # type: ignore[arg-type]
    session.error_feedback = ErrorFeedback(num_elements)
    return session


def round_one(weight: float) -> RoundRequest:
    """The first round's request, from the initial params (what ``OuterRound`` hands the swarm)."""
    return RoundRequest(round_index=1, weight=weight, lineage=(0, "00" * 32), tokens_per_s=1.0)


def test_round_outcome_carries_the_top_k_codecs_density() -> None:
    vector = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    allreduce = AllReduceResult(
        averaged=vector, contributors=[["a", "b"]], producers=["a"], fell_back=False, failures=[],
        bytes_sent=11, bytes_recv=22, seconds=0.1, bytes_sent_by_phase={}, bytes_recv_by_phase={},
    )  # fmt: skip
    result = GroupAveraged(
        round=1,
        group=SimpleNamespace(member_ids=("a", "b"), num_streams=1),  # type: ignore[arg-type]
        allreduce=allreduce,
    )
    session = session_with(result, vector.numel())
    session.swarm.codec = get_codec("topk", density=0.03)  # type: ignore[misc]  # the fake's attribute
    stats = session.average(vector, round_one(weight=10.0)).stats
    assert stats.density == 123 / 4096  # ceil(0.03 x 4096) of each block of 4096


def test_round_outcome_carries_failures_by_kind_codec_error_and_state_sync_bytes() -> None:
    vector = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    allreduce = AllReduceResult(
        averaged=vector * 0.5, contributors=[["a", "b"]], producers=["a"], fell_back=False,
        failures=["peer c failed: gone", "contribution of d left out"], bytes_sent=111, bytes_recv=222, seconds=0.1,
        bytes_sent_by_phase={"reduce_scatter": 100, "all_gather": 11},
        bytes_recv_by_phase={"reduce_scatter": 200, "all_gather": 22},
    )  # fmt: skip
    result = GroupAveraged(
        round=1,
        group=SimpleNamespace(member_ids=("a", "b"), num_streams=1),  # type: ignore[arg-type]
        allreduce=allreduce,
    )
    session = session_with(result, vector.numel())
    session._bytes_state_sync, session._state_sync_failures = 5000, 1  # a fetch while joining, one failed
    outcome = session.average(vector, round_one(weight=10.0))
    stats = outcome.stats

    codec = get_codec("int8")  # reference: what int8 loses of the vector, by the codec alone
    decoded = codec.decode_into(codec.encode(vector.clone()), torch.empty_like(vector))
    expected = float(torch.linalg.vector_norm(vector - decoded) / torch.linalg.vector_norm(vector))
    assert stats.codec_error == pytest.approx(expected, rel=1e-6) and 0 < expected < 0.01
    assert stats.failures_by_kind == {"peer": 2, "state_sync": 1}
    assert stats.seconds_allreduce == 0.1 and stats.streams == 1 and stats.seconds_forming == 0.0
    assert (stats.bytes_sent, stats.bytes_recv, stats.bytes_recv_state_sync) == (111, 222, 5000)
    assert stats.bytes_by_phase == {
        "sent_reduce_scatter": 100, "sent_all_gather": 11, "recv_reduce_scatter": 200, "recv_all_gather": 22
    }  # fmt: skip
    assert stats.num_peers == 2 and stats.members == ("a", "b")
    assert stats.density == 1.0  # int8 sends every number
    assert isinstance(outcome.decision, Averaged) and torch.equal(outcome.decision.mean, allreduce.averaged)
    # Reported once: the next round starts from zero.
    assert session._bytes_state_sync == 0 and session._state_sync_failures == 0
    assert set(stats.failures_by_kind) <= set(FAILURE_KINDS)


@pytest.mark.parametrize(
    ("result", "kind"),
    [
        (RoundNotFormed(round=1, reason="only 1 peer ready"), "round_failed"),
        (TimeoutError("swarm loop"), "timeout"),
    ],
)
def test_a_failed_round_counts_its_kind_and_has_no_codec_error(
    result: RoundResult | Exception, kind: str
) -> None:
    vector = torch.ones(10)
    outcome = session_with(result, vector.numel()).average(vector, round_one(weight=1.0))
    assert outcome.stats.failures_by_kind == {kind: 1}
    assert isinstance(outcome.decision, FellBack) and outcome.stats.codec_error is None
    torch.testing.assert_close(outcome.decision.own, vector)  # its own Δ
