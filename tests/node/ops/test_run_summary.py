"""The end-of-run line: read back from metrics.jsonl, only this process's rounds, and said plainly."""

from __future__ import annotations

import json
from pathlib import Path

from node.ops.run_summary import format_duration, summarize_run, summary_line
from node.swarm.setup import reachable_first


def round_record(round: int, time: float, **fields: object) -> dict[str, object]:
    record: dict[str, object] = {
        "kind": "round", "round": round, "step": 3 * round, "eval_loss": 3.0 - 0.25 * round, "peers": 2,
        "bytes_sent": 1_000_000, "bytes_recv": 2_000_000, "bytes_recv_state_sync": 0, "time": time,
    }  # fmt: skip
    record.update(fields)
    return record


def write(path: Path, records: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_a_resumed_run_sums_only_its_own_rounds(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    write(
        metrics,
        [
            round_record(1, 100.0, seconds_compute=50.0, seconds_wall=51.0),  # the previous process
            {"kind": "step", "round": 2, "step": 4, "loss": 3.0, "time": 200.5},
            round_record(2, 201.0, bytes_recv_state_sync=500_000, seconds_compute=118.0, seconds_wall=121.0),
            # An overlapped run's last round trains nothing: its wall time counts, its utilization is null.
            round_record(3, 202.0, eval_loss=None, seconds_compute=0.0, seconds_wall=14.0, utilization=None),
        ],
    )
    summary = summarize_run(metrics, started=200.0, ended=534.0)
    assert (summary.num_rounds, summary.first_round, summary.last_round) == (2, 2, 3)
    assert (summary.eval_loss, summary.eval_round) == (2.5, 2)
    assert summary.bytes_sent == 2_000_000 and summary.bytes_received == 4_500_000
    assert (summary.compute_seconds, summary.rounds_wall_seconds) == (118.0, 135.0)
    assert summary.utilization == 118.0 / 135.0
    line = summary_line(summary, tmp_path)
    assert line == (
        "run ended: 2 rounds (2-3), held-out loss 2.5000 (round 2), sent 2.0 MB, received 4.5 MB, "
        "utilization 0.87 (inner compute 1 min 58 s of 2 min 15 s from the first step to the last round), "
        f"5 min 34 s; metrics {metrics} (plots: dtnode report {tmp_path})"
    )


def test_a_run_without_rounds_says_so(tmp_path: Path) -> None:
    summary = summarize_run(tmp_path / "metrics.jsonl", started=0.0, ended=42.4)  # no file yet
    assert summary.num_rounds == 0 and summary.eval_loss is None
    assert summary_line(summary, tmp_path).startswith(
        "run ended: no round completed, no held-out loss measured"
    )
    assert [format_duration(s) for s in (0.04, 0.4, 9.94, 9.96, 59.6, 61, 3600 * 2 + 180)] == [
        "0.0 s",
        "0.4 s",
        "9.9 s",
        "10 s",
        "1 min 00 s",
        "1 min 01 s",
        "2 h 03 min",
    ]


def test_a_short_run_states_its_compute_and_wall_time_to_a_tenth_of_a_second(tmp_path: Path) -> None:
    """A run of a few seconds: its compute and wall time are not rounded into "0 s of 1 s", which
    would not give its utilization back (0.31)."""
    metrics = tmp_path / "metrics.jsonl"
    write(metrics, [round_record(1, 10.0, seconds_compute=0.38, seconds_wall=1.24)])
    summary = summarize_run(metrics, started=9.0, ended=12.5)
    line = summary_line(summary, tmp_path)
    assert (
        "utilization 0.31 (inner compute 0.4 s of 1.2 s from the first step to the last round), 3.5 s;"
        in line
    )


def test_the_join_banner_lists_addresses_other_machines_can_dial_first() -> None:
    addresses = ["/ip4/127.0.0.1/tcp/7001/p2p/Q", "/ip4/10.0.0.5/tcp/7001/p2p/Q", "/ip6/::1/tcp/7001/p2p/Q",
                 "/ip4/192.168.1.2/tcp/7001/p2p/Q"]  # fmt: skip
    assert reachable_first(addresses) == [
        "/ip4/10.0.0.5/tcp/7001/p2p/Q", "/ip4/192.168.1.2/tcp/7001/p2p/Q",
        "/ip4/127.0.0.1/tcp/7001/p2p/Q", "/ip6/::1/tcp/7001/p2p/Q",
    ]  # fmt: skip
