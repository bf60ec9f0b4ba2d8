"""`dtnode report`: valid PNGs and a report.md whose numbers are the metrics' own, for a node's run
dir (a real short training) and for a swarm dir (hand-written records with hand-computed totals)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest

from node.ops.cli import main
from node.ops.launcher import write_plots_report
from node.ops.metrics import read_metrics
from node.ops.report import PLOT_FILES, REPORT_FILE, round_utilization, running_mean
from tests.node.run_support import one_torch_thread, train_short_run, write_corpus

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# One xdist worker takes the whole module: its tests share a trained run (a module fixture).
pytestmark = pytest.mark.xdist_group("node.test_report")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with one_torch_thread():  # tiny steps on a shared machine: one thread is faster
        yield


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real node run: two rounds of H=3 on the nano preset."""
    path = tmp_path_factory.mktemp("run")
    train_short_run(write_corpus(tmp_path_factory.mktemp("corpus")), path)
    return path


def assert_valid_pngs(directory: Path) -> None:
    for name in PLOT_FILES:
        path = directory / name
        assert path.read_bytes()[:8] == PNG_MAGIC, name
        pixels = matplotlib.image.imread(path)  # decodes the whole image
        assert pixels.ndim == 3 and pixels.shape[0] >= 300 and pixels.shape[1] >= 500, (name, pixels.shape)
        assert float(pixels[..., :3].std()) > 0.01, f"{name} is blank"


def table_row(report: str, node_name: str) -> list[str]:
    (line,) = [line for line in report.splitlines() if line.startswith(f"| {node_name} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.timeout(90)
def test_report_of_a_node_run(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / REPORT_FILE)
    assert_valid_pngs(run_dir)
    report = (run_dir / REPORT_FILE).read_text()
    for name in PLOT_FILES:
        assert f"]({name})" in report
    rounds = read_metrics(run_dir / "metrics.jsonl", "round")
    steps = read_metrics(run_dir / "metrics.jsonl", "step")
    row = table_row(report, run_dir.name)
    assert row[1:4] == ["6", "2", f"{steps[-1]['tokens']:,}"]
    assert row[4] == f"{np.mean([s['loss'] for s in steps[-10:]]):.4f}"
    assert row[5] == f"{rounds[-1]['eval_loss']:.4f}"
    assert row[6] == f"{min(r['eval_loss'] for r in rounds):.4f}"
    compute = sum(r["seconds_compute"] for r in rounds)
    assert row[12] == f"{compute / sum(r['seconds_wall'] for r in rounds):.3f}"  # the run's, not a mean
    assert row[9:12] == ["-", "-", "-"]  # a node alone: no all-reduce, no bytes per round nor density
    assert row[15] == rounds[-1]["param_hash"][:12] and row[16] == "yes"  # the run exported its model


def step_record(step: int, time: float, loss: float | None) -> dict[str, Any]:
    return {"kind": "step", "round": 1, "step": step, "loss": loss, "lr": 1e-3, "tokens": 100 * step,
            "tokens_per_s": 1000.0, "time": time}  # fmt: skip


def round_record(
    round_index: int, time: float, *, sent: int, param_hash: str, **extra: Any
) -> dict[str, Any]:
    return {"kind": "round", "round": round_index, "step": 2 * round_index, "eval_loss": 3.0 / round_index,
            "peers": 2, "bytes_sent": sent, "bytes_recv": sent + 1000, "seconds_compute": 3.0,
            "seconds_comm": 1.0, "seconds_blocked": 1.0, "param_hash": param_hash, "tokens": 200 * round_index,
            "time": time, **extra}  # fmt: skip


def write_swarm(root: Path, node_hashes: list[list[str]], **extra: Any) -> None:
    """node-<i>/metrics.jsonl with two steps then one round per hash (``extra`` in each); a diverged
    (null) step loss."""
    for index, hashes in enumerate(node_hashes):
        records = [step_record(1, 1000.0 + index, 5.0), step_record(2, 1001.0 + index, None)]
        records += [
            round_record(r + 1, 1002.0 + 10 * r, sent=1_500_000 * (index + 1), param_hash=h, **extra)
            for r, h in enumerate(hashes)
        ]
        (root / f"node-{index}").mkdir(parents=True)
        (root / f"node-{index}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.timeout(60)
def test_report_of_a_swarm_dir(tmp_path: Path) -> None:
    root, out = tmp_path / "swarm", tmp_path / "out"
    # Top-k at 62 of 4096; each 4 s round spent 0.5 s in its all-reduce.
    write_swarm(
        root, [["aaaa", "bbbb"], ["aaaa", "bbbb"]], density=62 / 4096, seconds_allreduce=0.5, seconds_wall=4.0
    )
    assert main(["report", str(root), "--out", str(out)]) == 0
    assert_valid_pngs(out)
    report = (out / REPORT_FILE).read_text()
    # node-1 sent 3.0 MB in each of its 2 rounds and received 1000 B more each time.
    assert table_row(report, "node-1")[7:9] == ["6.00", "6.00"]
    assert table_row(report, "node-0")[7:9] == ["3.00", "3.00"]
    # Per round node-1 moved 3.0 MB out and 3.001 MB in; density 62 / 4096; all-reduce 2 x 0.5 s of 2 x 4 s.
    assert table_row(report, "node-1")[9:12] == ["6.001", "1.51%", "12.5%"]
    assert table_row(report, "node-0")[9:12] == ["3.001", "1.51%", "12.5%"]
    # Utilization 3 s compute / 4 s wall; the null loss is skipped in the mean of the last steps.
    assert table_row(report, "node-0")[12] == "0.750" and table_row(report, "node-0")[4] == "5.0000"
    assert "every node held the same param_hash after each of the 2 common round(s)" in report
    assert table_row(report, "node-0")[16] == "no"  # no model.safetensors in these dirs


@pytest.mark.timeout(60)
def test_report_flags_disagreeing_hashes_and_compares_runs(tmp_path: Path) -> None:
    write_swarm(tmp_path / "a", [["aaaa", "bbbb"], ["aaaa", "cccc"]])
    write_swarm(tmp_path / "b", [["aaaa"], ["aaaa"], ["aaaa"]])
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    report = (tmp_path / "a" / REPORT_FILE).read_text()
    assert "**param_hash differs between nodes in round(s) [2]**" in report
    assert all(f"| b/node-{i} |" in report for i in range(3)) and "| a/node-1 |" in report


@pytest.mark.timeout(60)
def test_the_launcher_report_opens_the_swarm_report(tmp_path: Path) -> None:
    write_swarm(tmp_path, [["aaaa"], ["aaaa"]])
    node = {"name": "node-0", "exit_code": 0, "num_rounds": 1, "eval_losses": [3.0], "bytes_sent": 1,
            "bytes_recv": 1, "fell_back_rounds": [], "adopted_rounds": []}  # fmt: skip
    launcher_report = {
        "num_nodes": 2, "link_mbit": None, "stopped_by": "finished", "wall_seconds": 12.0,
        "param_hash": {"common_rounds": [1], "disagreeing_rounds": [], "all_agree": True},
        "nodes": [node, {**node, "name": "node-1"}],
    }  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(launcher_report))
    write_plots_report(tmp_path)
    report = (tmp_path / REPORT_FILE).read_text()
    assert report.startswith("# dtnode report") and "## Swarm" in report
    assert "every node held the same param_hash" in report and "![loss](loss.png)" in report
    assert_valid_pngs(tmp_path)
    write_plots_report(tmp_path / "empty")  # nothing to plot: a warning, not an error


@pytest.mark.timeout(60)
def test_a_dir_without_metrics_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no metrics.jsonl" in err and len(err.strip().splitlines()) == 1


def test_running_mean_matches_a_naive_loop() -> None:
    values = np.array([1.0, math.nan, 3.0, 4.0, 10.0, math.nan, math.nan, 2.0])
    window = 3
    expected = []
    for end in range(1, len(values) + 1):
        kept = [v for v in values[max(0, end - window) : end] if not math.isnan(v)]
        expected.append(sum(kept) / len(kept) if kept else math.nan)
    np.testing.assert_allclose(running_mean(values, window), expected, rtol=1e-12)


def test_utilization_of_older_records_is_computed() -> None:
    assert round_utilization({"utilization": 0.4}) == 0.4
    assert math.isnan(round_utilization({"utilization": None, "seconds_compute": 3.0}))
    assert round_utilization({"seconds_compute": 3.0, "seconds_comm": 1.0}) == 0.75  # before seconds_blocked
    assert math.isnan(round_utilization({"seconds_compute": 0.0, "seconds_comm": 1.0}))


def solo_run(tmp_path: Path) -> list[Any]:
    """A swarm of one: every round 1 contribution and 0 bytes on the wire (flat series)."""
    from node.ops.report import load_runs

    run_dir = tmp_path / "solo"
    run_dir.mkdir()
    records = [
        {"kind": "round", "round": r, "step": 3 * r, "eval_loss": 3.0 - 0.1 * r, "peers": 1, "bytes_sent": 0,
         "bytes_recv": 0, "seconds_compute": 1.0, "seconds_comm": 0.01, "param_hash": "aa", "tokens": 100 * r,
         "fell_back": False, "adopted": False, "time": 1000.0 + r}
        for r in range(1, 4)
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return load_runs([run_dir])


def test_flat_series_get_axes_from_zero_and_counts_whole_ticks(tmp_path: Path) -> None:
    from node.ops.report import plot_bytes, plot_peers

    runs = solo_run(tmp_path)
    bytes_figure = plot_bytes(runs, tmp_path / "bytes.png")
    for ax in bytes_figure.axes:  # 0 MB throughout: 0..1, not matplotlib's -0.04..0.04
        assert ax.get_ylim() == (0.0, 1.0)
    peers_figure = plot_peers(runs, tmp_path / "peers.png")
    (ax,) = peers_figure.axes
    assert ax.get_ylim() == (0.0, 2.0)  # a flat count of 1: 0..2, not 0.95..1.05
    ticks = [tick for tick in ax.get_yticks() if 0 <= tick <= 2]
    assert ticks and all(float(tick).is_integer() for tick in ticks), ticks
    # A larger count stays whole too, and a rising MB series keeps its top.
    runs[0].rounds[-1]["peers"] = 7
    runs[0].rounds[-1]["bytes_sent"] = 4_000_000
    assert plot_peers(runs, tmp_path / "peers.png").axes[0].get_ylim() == (0.0, 8.0)
    cumulative, _ = plot_bytes(runs, tmp_path / "bytes.png").axes
    assert cumulative.get_ylim() == pytest.approx((0.0, 4.2))


def section_rows(report: str, title: str) -> list[list[str]]:
    """The table rows (cells) of section ``## title``, its header and rule left out."""
    section = report.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


@pytest.mark.timeout(60)
def test_report_shows_rounds_and_bytes_per_fragment_and_the_links_busy_share(tmp_path: Path) -> None:
    """Two nodes, F = 2: round r synchronises fragment r mod 2; node i sends 1.5 (i + 1) MB a round
    and each round lasts 4 s of wall time, on 8 Mbit/s (1 MB/s) uplinks."""
    for index in range(2):
        records = [step_record(1, 1000.0, 5.0)]
        records += [
            round_record(
                r,
                1000.0 + 4 * r,
                sent=1_500_000 * (index + 1),
                param_hash=f"h{r}",
                fragment=r % 2,
                fragment_hash=f"f{r}",
                seconds_wall=4.0,
            )  # fmt: skip
            for r in range(1, 6)
        ]
        (tmp_path / f"node-{index}").mkdir()
        (tmp_path / f"node-{index}" / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
    node = {"name": "node-0", "exit_code": 0, "num_rounds": 5, "eval_losses": [3.0] * 5, "bytes_sent": 1,
            "bytes_recv": 1, "fell_back_rounds": [], "adopted_rounds": []}  # fmt: skip
    launcher_report = {
        "num_nodes": 2, "link_mbit": 8.0, "stopped_by": "finished", "wall_seconds": 30.0,
        "param_hash": {"common_rounds": [1, 2, 3, 4, 5], "disagreeing_rounds": [], "all_agree": True},
        "nodes": [node, {**node, "name": "node-1"}],
    }  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(launcher_report))
    write_plots_report(tmp_path)
    report = (tmp_path / REPORT_FILE).read_text()
    # Fragment 0: rounds 2 and 4; fragment 1: rounds 1, 3 and 5. Node 1 sends 3 MB a round, receives 1 kB more.
    assert section_rows(report, "Fragments") == [
        ["node-0", "0", "2", "3.00", "3.00"],
        ["node-0", "1", "3", "4.50", "4.50"],
        ["node-1", "0", "2", "6.00", "6.00"],
        ["node-1", "1", "3", "9.00", "9.00"],
    ]
    # Busy share: 5 x 1.5 MB over (1 MB/s x 5 x 4 s) = 37.5%; node 1 sends twice as much: 75%.
    assert section_rows(report, "Link") == [
        ["node-0", "7.50", "20.0", "37.5%"],
        ["node-1", "15.00", "20.0", "75%"],
    ]


@pytest.mark.timeout(60)
def test_report_says_when_the_link_rate_is_not_known_and_has_no_fragments_without_them(
    tmp_path: Path,
) -> None:
    write_swarm(tmp_path, [["aaaa", "bbbb"], ["aaaa", "bbbb"]], seconds_wall=4.0)
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / REPORT_FILE).read_text()
    assert "the link rate is not known" in report and section_rows(report, "Link") == []
    assert "## Fragments" not in report
