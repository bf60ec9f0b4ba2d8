"""SIGKILL a real node at random points of its checkpoint writes; it must always resume from the last
complete checkpoint, with the param_hash it saved.

    python scripts/tools/checkpoint_crash.py --trials 20

``node/train/checkpoint.py`` writes a checkpoint in stages: make ``step-<S>.tmp-<pid>/``, write
``tensors.safetensors`` and fsync it, write ``state.json`` durably, fsync the directory, rename it
to ``step-<S>``, write ``LATEST.tmp-<pid>`` and replace ``LATEST`` with it, fsync the root, then
prune the oldest checkpoints (rename each to a ``.tmp-`` name, then delete it). Killing the process
"at a random moment" with a timer mostly lands between saves; this script instead kills it
*inside* a write, deterministically: the node runs in a child process, forked from a server that
imported the node once (``dtnode join``, nano preset,
``--no-swarm``, a checkpoint every round of 2 inner steps) whose checkpoint module's file operations
are wrapped, and at the chosen stage of the chosen save the child SIGKILLs itself (no Python
unwinding, no ``finally``: exactly what a power cut or the OOM killer does). The torn stages write
only a random fraction of the file first.

Each trial picks a random save (the 2nd or 3rd of that run, so it completed one first) and a stage (each stage once per 11
trials, in a random order), runs the node in the
same run directory as the trials before (so it resumes, and meets the leftovers of earlier kills),
and checks, after the kill:

1. ``LATEST`` names the newest checkpoint whose save finished before the kill, or the one being
   written if the kill came after ``LATEST`` was replaced (the new checkpoint is then complete);
2. that checkpoint's ``state.json`` holds the param_hash the killed node computed when it saved it,
   and so does every other checkpoint the run saved that is still on disk;
3. the next run resumes from exactly that checkpoint, at its step, and the hash of the parameters
   it loaded equals that param_hash.

A last run without a kill checks 3. for the last trial, trains one more round and exits 0; its save
must sweep every ``.tmp-`` leftover away. Prints a JSON summary and a one-line verdict.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.common import REPO_ROOT, add_output_flags, exit_as_the_interpreter_would, print_json, write_json

STAGES = (
    "before-tensors",  # the tmp dir exists, empty
    "torn-tensors",  # part of tensors.safetensors written
    "tensors-unsynced",  # tensors.safetensors written, not fsynced
    "torn-json",  # part of state.json written
    "before-dir-fsync",  # both files durable, the tmp dir's entries not yet
    "before-rename",  # the complete tmp dir never moves into place
    "after-rename",  # step-<S> complete, LATEST still names the previous one
    "torn-latest",  # part of LATEST.tmp-<pid> written
    "before-latest-replace",  # LATEST.tmp-<pid> complete, LATEST unchanged
    "after-latest-replace",  # LATEST names the new checkpoint, the root not fsynced yet
    "mid-prune",  # an old checkpoint renamed to .tmp- for deletion, not yet deleted
)
NEW_IS_LATEST = frozenset({"after-latest-replace", "mid-prune"})
"""Stages after which LATEST already names the checkpoint being written."""


# --- the child: a real `dtnode join` with its checkpoint writes wrapped ---------------------------------


def emit(event: dict[str, Any]) -> None:
    """One JSON line to the parent; written and flushed before any kill, so it survives the kill."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


@dataclass
class SaveCounter:
    """Saves started by this process so far, and the name of the one under way."""

    number: int = 0
    name: str = ""


def install_hooks(kill_save: int, kill_stage: str, torn_fraction: float) -> None:
    """Wrap node.train.checkpoint's file operations: SIGKILL ourselves at ``kill_stage`` of the first save
    numbered ``kill_save`` or later that reaches it (no prune happens while few checkpoints exist)."""
    import node.train.checkpoint as checkpoint
    import node.train.checkpoint_writer as writer_module

    saves = SaveCounter()

    def at(stage: str) -> None:
        if stage == kill_stage and saves.number >= kill_save:
            emit({"event": "kill", "save": saves.name, "stage": stage})
            os.kill(os.getpid(), signal.SIGKILL)

    real_save_checkpoint = writer_module.save_checkpoint

    def save_checkpoint(
        root: Path, name: str, state: dict[str, Any], meta: dict[str, Any], *, keep: int
    ) -> Path:
        saves.number += 1
        saves.name = name
        path = real_save_checkpoint(root, name, state, meta, keep=keep)
        emit({"event": "saved", "name": name, "step": meta["step"], "param_hash": meta["param_hash"]})
        return path

    writer_module.save_checkpoint = save_checkpoint  # the writer thread calls it by this name

    real_save_file = checkpoint.save_file

    def save_file(tensors: dict[str, Any], filename: Any, metadata: dict[str, str] | None = None) -> None:
        at("before-tensors")
        real_save_file(tensors, filename, metadata)
        if kill_stage == "torn-tensors" and saves.number >= kill_save:
            os.truncate(filename, int(os.path.getsize(filename) * torn_fraction))
        at("torn-tensors")
        at("tensors-unsynced")

    checkpoint.save_file = save_file

    real_write_durable = checkpoint._write_durable

    def write_durable(path: Path, data: bytes) -> None:
        stage = "torn-json" if path.name == "state.json" else "torn-latest"
        if kill_stage == stage and saves.number >= kill_save:
            path.write_bytes(data[: int(len(data) * torn_fraction)])
        at(stage)
        real_write_durable(path, data)

    checkpoint._write_durable = write_durable

    real_fsync_dir = checkpoint._fsync_dir

    def fsync_dir(path: Path) -> None:
        at("before-dir-fsync" if ".tmp-" in path.name else "after-latest-replace")
        real_fsync_dir(path)

    checkpoint._fsync_dir = fsync_dir

    real_point_latest = checkpoint._point_latest

    def point_latest(root: Path, name: str) -> None:
        if (root / name).exists() and ".tmp-" not in name:
            at("after-rename")
        real_point_latest(root, name)

    checkpoint._point_latest = point_latest

    real_rename, real_replace, real_rmtree = os.rename, os.replace, shutil.rmtree

    def rename(source: Any, destination: Any) -> None:
        if Path(source).name.startswith("step-") and ".tmp-" in Path(source).name:
            at("before-rename")
        real_rename(source, destination)

    def replace(source: Any, destination: Any) -> None:
        if Path(destination).name == checkpoint.LATEST:
            at("before-latest-replace")
        real_replace(source, destination)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if ".tmp-" in Path(path).name and Path(path).name.endswith(f".tmp-{os.getpid()}"):
            at("mid-prune")
        real_rmtree(path, *args, **kwargs)

    os.rename, os.replace, shutil.rmtree = rename, replace, rmtree  # type: ignore[assignment]


def report_resume() -> None:
    """After the trainer restored a checkpoint, tell the parent which one and the loaded params' hash."""
    import node.train.trainer as trainer_module

    real_restore = trainer_module.Trainer._restore

    def restore(self: Any, path: Path) -> None:
        real_restore(self, path)  # raises if the params do not match the saved param_hash
        emit(
            {
                "event": "resumed",
                "name": path.name,
                "step": self.progress.step,
                "param_hash": self.diloco.param_hash(),
            }
        )

    trainer_module.Trainer._restore = restore  # type: ignore[method-assign]


def node_flags(corpus: Path, run_dir: Path, max_rounds: int) -> list[str]:
    return [
        "join", "--no-swarm", "--model", "nano", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "2",
        "--eval-batches", "1", "--data", str(corpus), "--run-dir", str(run_dir), "--log-every", "1000",
        "--keep-checkpoints", "2", "--checkpoint-every", "1", "--threads", "1", "--max-rounds", str(max_rounds),
    ]  # fmt: skip


def child(args: argparse.Namespace) -> int:
    report_resume()
    if args.kill_stage:
        install_hooks(args.kill_save, args.kill_stage, args.torn_fraction)
    from node.ops.cli import main

    return main(node_flags(Path(args.data), Path(args.run_dir), args.max_rounds))


# --- the parent: trials ----------------------------------------------------------------------------------


def _forked_child(argv: list[str], events_path: str, log_path: str, env: dict[str, str]) -> None:
    """In a child forked from the server: ``--child ARGV`` with stdout (the events) and stderr (the
    node's log) in files, ended as the interpreter ends (non-daemon threads joined, atexit run)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, events_path), (2, log_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    exit_as_the_interpreter_would(lambda: child(build_parser().parse_args(argv)))


def _forkserver() -> multiprocessing.context.ForkServerContext:
    """The forkserver, with the node's modules among those it imports once when it starts (a fresh
    interpreter per run would import torch and the node again: ~3 CPU-s, as much as its training)."""
    context = multiprocessing.get_context("forkserver")
    asked = getattr(multiprocessing.forkserver._forkserver, "_preload_modules", None) or []
    context.set_forkserver_preload(
        sorted({*asked, "node.ops.cli", "node.train.trainer"})
    )  # add, never replace
    return context


def run_child(
    corpus: Path,
    run_dir: Path,
    log_path: Path,
    *,
    max_rounds: int,
    kill: tuple[int, str, float] | None,
    timeout: float,
) -> tuple[int, list[dict[str, Any]]]:
    """Run the node to its end (a kill or max_rounds), forked from the preloaded server; its exit
    code (-SIGKILL after a kill) and its JSON events."""
    argv = ["--child", "--data", str(corpus), "--run-dir", str(run_dir), "--max-rounds", str(max_rounds)]
    if kill is not None:
        argv += ["--kill-save", str(kill[0]), "--kill-stage", kill[1], "--torn-fraction", str(kill[2])]
    events_path = log_path.with_name(f"{log_path.stem}.events")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = _forkserver().Process(target=_forked_child, args=(argv, str(events_path), str(log_path), env))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join(10)
        raise subprocess.TimeoutExpired(f"checkpoint_crash child {argv}", timeout)
    lines = events_path.read_text().splitlines() if events_path.exists() else []
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert process.exitcode is not None
    return process.exitcode, events


def latest_name(root: Path) -> str | None:
    pointer = root / "LATEST"
    return pointer.read_text().strip() if pointer.is_file() else None


def saved_meta(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / name / "state.json").read_text())["meta"]


def check_resume(events: list[dict[str, Any]], expected: dict[str, Any] | None) -> str:
    """'' if the run resumed from ``expected`` (name, step, param_hash), else what went wrong."""
    resumed = [e for e in events if e["event"] == "resumed"]
    if expected is None:
        return "" if not resumed else f"resumed from {resumed[0]['name']} with no complete checkpoint"
    if not resumed:
        return f"did not resume (expected {expected['name']})"
    got = resumed[0]
    for key in ("name", "step", "param_hash"):
        if got[key] != expected[key]:
            return f"resumed {key}={got[key]!r}, expected {expected[key]!r}"
    return ""


def run_trials(
    num_trials: int,
    *,
    random_seed: int = 0,
    max_kill_save: int = 3,
    work_dir: Path | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run the trials in one run directory (each resumes from what the previous kill left); each kill
    comes in the 2nd to ``max_kill_save``-th save of its run, so every run completes a save first and
    the checkpoint to resume from is a new one each time."""
    rng = random.Random(random_seed)
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="checkpoint-crash-"))
    corpus = work_dir / "corpus.txt"
    corpus.write_text(inspect.getsource(inspect))  # ~130 KB of text, the same every run
    run_dir = work_dir / "run"
    root = run_dir / "checkpoints"
    trials: list[dict[str, Any]] = []
    complete: dict[str, Any] | None = None  # the last complete checkpoint: name, step, param_hash
    # Every stage once per len(STAGES) trials, in a random order; a random save and torn fraction each.
    stages = [
        stage for _ in range(-(-num_trials // len(STAGES))) for stage in rng.sample(STAGES, len(STAGES))
    ]
    for index in range(num_trials):
        kill = (rng.randint(2, max_kill_save), stages[index], round(rng.uniform(0.0, 1.0), 3))
        started = time.monotonic()
        code, events = run_child(
            corpus, run_dir, work_dir / f"trial-{index}.log", max_rounds=10_000, kill=kill, timeout=120
        )
        trial: dict[str, Any] = {
            "trial": index,
            "kill_save": kill[0],
            "stage": kill[1],
            "torn_fraction": kill[2],
        }
        problems = [check_resume(events, complete)]
        saved = [e for e in events if e["event"] == "saved"]
        killed = [e for e in events if e["event"] == "kill"]
        if code != -signal.SIGKILL or not killed:
            problems.append(f"the node was not killed (exit code {code})")
        else:
            trial["killed_in"] = killed[0]["save"]
            if saved:
                complete = {key: saved[-1][key] for key in ("name", "step", "param_hash")}
            if kill[1] in NEW_IS_LATEST:  # the killed save had replaced LATEST: its checkpoint is complete
                name = killed[0]["save"]
                meta = saved_meta(root, name)
                complete = {"name": name, "step": meta["step"], "param_hash": meta["param_hash"]}
            expected_name = None if complete is None else complete["name"]
            if latest_name(root) != expected_name:
                problems.append(f"LATEST names {latest_name(root)}, expected {expected_name}")
            elif (
                complete is not None
                and saved_meta(root, complete["name"])["param_hash"] != complete["param_hash"]
            ):
                problems.append("the checkpoint's param_hash differs from the one the node saved")
            # Every save this run finished (still on disk) holds the params the node had: a save that
            # met a complete directory of its name left there by an earlier kill ("after-rename")
            # adopts it without writing, which is right only if training is deterministic.
            for event in saved:
                if (root / event["name"] / "state.json").is_file():
                    if saved_meta(root, event["name"])["param_hash"] != event["param_hash"]:
                        problems.append(f"{event['name']} on disk holds other params than the node saved")
        trial.update(
            expected_latest=None if complete is None else complete["name"],
            leftovers=sorted(p.name for p in root.glob("*.tmp-*")) if root.is_dir() else [],
            seconds=round(time.monotonic() - started, 1),
            problems=[p for p in problems if p],
        )
        trials.append(trial)
        log(json.dumps(trial))
    # The last trial's kill is checked by a run that resumes, trains one more round and exits cleanly.
    final_rounds = (complete["step"] // 2 if complete else 0) + 1
    code, events = run_child(
        corpus, run_dir, work_dir / "final.log", max_rounds=final_rounds, kill=None, timeout=120
    )
    final_problems = [p for p in (check_resume(events, complete),) if p]
    if code != 0:
        final_problems.append(f"the final run exited {code}")
    leftovers = sorted(p.name for p in root.glob("*.tmp-*"))
    if leftovers:
        final_problems.append(f"leftovers after a clean save: {leftovers}")
    summary = {
        "trials": trials,
        "final_run": {
            "exit_code": code,
            "resumed": [e for e in events if e["event"] == "resumed"],
            "problems": final_problems,
        },
        "stages_hit": sorted({t["stage"] for t in trials}),
        "num_trials": num_trials,
        "num_failed": sum(bool(t["problems"]) for t in trials) + bool(final_problems),
        "work_dir": str(work_dir),
    }
    summary["ok"] = summary["num_failed"] == 0
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="Kills to inject (each resumes the last).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random saves, stages and fractions.")
    add_output_flags(parser)  # --json-out: the summary
    parser.add_argument("--child", action="store_true", help="Run the node (internal).")
    parser.add_argument("--data", default="", help="(child) corpus file.")
    parser.add_argument("--run-dir", default="", help="(child) run directory.")
    parser.add_argument("--max-rounds", type=int, default=10_000, help="(child) rounds to train.")
    parser.add_argument("--kill-save", type=int, default=1, help="(child) kill in this save or a later one.")
    parser.add_argument("--kill-stage", default="", choices=("", *STAGES), help="(child) the write stage.")
    parser.add_argument(
        "--torn-fraction", type=float, default=0.5, help="(child) fraction of a torn file written."
    )
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.child:
        return child(args)
    summary = run_trials(args.trials, random_seed=args.seed)
    print_json(summary)
    write_json(args.json_out, summary)
    verdict = "PASS" if summary["ok"] else "FAIL"
    print(
        f"{verdict}: {args.trials} SIGKILLs during checkpoint writes ({len(summary['stages_hit'])} of "
        f"{len(STAGES)} stages), {summary['num_failed']} failed; every restart resumed from the last "
        "complete checkpoint with its saved param_hash"
        if summary["ok"]
        else f"{verdict}: see the trials above"
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
