"""The outer state's memory with streamed fragments: F fragments against one (issue 32, item 3).

One process per F (``--fragments``, default ``1,4``) builds a model (``--model``, tiny by default) and
its inner AdamW (its state allocated by one step), then the daemon's outer round on it
(``node.outer.round.OuterRound``: ``FlatOuterState`` for F = 1, ``FragmentedOuterState`` for F > 1,
τ = 0 so each round runs inside the step boundary that ends its phase), and runs ``--cycles`` × F
rounds of H inner steps. An inner step here moves every parameter by a seeded random amount (no
activations: the peaks are the outer round's alone). The swarm side is this node's own arithmetic
without sockets: its Δ to CPU fp32, the error-feedback residual (one per fragment, as
``SwarmSession.fragment_feedback``) encoded chunk by chunk with the codec (``--codec``, int8) and the
payload decoded into the mean; with ``--serve`` (default) every round's state is published as the
daemon publishes it (``OuterRound.snapshot``, the provider keeping the last two, as
``StateSyncConfig.num_snapshots_kept``).

Memory is the process's resident set with glibc's mmap threshold at 64 KiB (set before the child
starts, so a freed tensor leaves the resident set at once), its peak read from ``VmHWM`` after
resetting it (``/proc/self/clear_refs`` 5) right before each round's step boundary:

    resting_bytes     RSS after the outer state and the first round, before the measured rounds,
                      minus RSS with the model and inner optimizer only (θ_global, outer momentum,
                      residuals, the served snapshots)
    in_flight_bytes   max over the measured rounds of peak RSS during the round − RSS before it:
                      what a round in flight adds (Δ, its CPU copy, codec buffers, the mean, the
                      hash, the host copies of a newly published state)
    outer_peak_bytes  max over the rounds of peak RSS − RSS with model and inner optimizer only

Target: F's ``in_flight_bytes`` at most ``--max-ratio`` (0.35) of F = 1's. ``resting_bytes`` and
``outer_peak_bytes`` are reported beside it (θ_global, its momentum and the residuals are the same N
numbers split or not; the served state is the whole model by the join contract).

    python scripts/bench/bench_fragment_memory.py                 # tiny, F = 1 and 4, int8, served
    python scripts/bench/bench_fragment_memory.py --no-serve      # the round alone

Prints one JSON object per F, a summary object and a one-line summary; exit code 0 if the target is
met, 1 if not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.common import REPO_ROOT, add_output_flags, print_json, write_json

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "MALLOC_ARENA_MAX": "2"}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss() -> int:
    return 1024 * _status_kib("VmRSS")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def peak() -> int:
    return 1024 * _status_kib("VmHWM")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One F, in this process (the child)."""
    import torch

    from node.model.gpt import GPT, model_config
    from node.outer.diloco import DiLoCo
    from node.outer.fragments import FragmentedOuterState, FragmentSchedule, model_fragment_plan
    from node.outer.round import OuterRound, RoundSettings
    from node.outer.seam import Averaged, JoinAnswer, RoundOutcome, RoundRequest, RoundStats, StartAnswer
    from node.outer.state import outer_sgd_settings
    from protocol.allreduce.config import AllReduceConfig
    from protocol.codecs import get_codec
    from protocol.error_feedback import ErrorFeedback
    from protocol.statesync.config import StateSyncConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    fragments = args.fragments
    model = GPT(model_config(args.model))
    params = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    inner.step()  # the inner optimizer's state, allocated
    generator = torch.Generator().manual_seed(1)

    @torch.no_grad()
    def inner_step() -> None:
        for p in params:
            p.add_(torch.randn(p.shape, generator=generator) * 1e-3)

    codec = get_codec(args.codec)
    chunk = AllReduceConfig().chunk_num_elements
    kept = StateSyncConfig().num_snapshots_kept

    class MemberArithmetic:
        """This member's side of a round without sockets: Δ to CPU fp32, encoded chunk by chunk with
        its error feedback, the payload decoded into the mean."""

        def __init__(self, sizes: list[int]) -> None:
            self.feedback = [ErrorFeedback(size) for size in sizes]
            self.num_elements = sum(sizes)

        def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
            feedback = self.feedback[request.fragment or 0]
            values = vector.to("cpu", torch.float32).contiguous()
            mean = torch.empty_like(values)
            for start in range(0, values.numel(), chunk):
                payload = feedback.encode(codec, values[start : start + chunk], start)
                codec.decode_into(payload, mean[start : start + chunk])
            return RoundOutcome(Averaged(mean), RoundStats(num_peers=2))

    class ServingSwarm(MemberArithmetic):
        """The swarm side as far as memory goes: averages, and keeps the last published snapshots."""

        num_adoptions = 0

        def __init__(self, sizes: list[int]) -> None:
            super().__init__(sizes)
            self.served: deque[Any] = deque(maxlen=kept)

        def join(self, request: Any) -> JoinAnswer:
            return JoinAnswer()

        def await_start_peers(self) -> StartAnswer:
            return StartAnswer()

        def after_step(self, members: tuple[str, ...]) -> None:
            return None

        def after_adopt(self, state: Any) -> None:
            return None

        def moved_spare_lane(self) -> None:
            return None

        def prepare_publish(self, snapshot: Any) -> None:
            pass  # nothing is served beside it

        def publish(self, snapshot: Any, *, tokens_per_s: float) -> None:
            self.served.append(snapshot)

        def advertise_rate(self, tokens_per_s: float, *, step_seconds: float | None = None) -> None:
            pass  # nobody to tell

        def phase_should_end(self) -> bool:
            return False

        def lineage_peer_due(self) -> bool:
            return False

        def state_dict(self) -> dict[str, torch.Tensor]:
            return {}

        def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
            pass  # nothing kept

    class NoData:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None: ...

        def skip(self, num_steps: int) -> None: ...

        def reshard(self, shard_index: int, num_shards: int) -> None: ...

        def end_round(
            self, shard: Any, *, phase_shards: int | None = None, phase_tokens: int = 0
        ) -> None: ...

        def read_spare(self, lane: int, *, steps: int) -> None: ...

    baseline = rss()  # the model and its inner optimizer
    settings = outer_sgd_settings(0.7, 0.9, True)
    schedule = None
    if fragments > 1:
        outer: Any = FragmentedOuterState(params, model_fragment_plan(model, fragments), device=torch.device("cpu"),
                                          **settings)  # fmt: skip
        sizes = list(outer.fragment_sizes())
        schedule = FragmentSchedule(inner_steps=args.inner_steps, num_fragments=fragments, overlap_steps=0)
        diloco = DiLoCo(model, outer=outer)
    else:
        diloco = DiLoCo(model, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
        sizes = [diloco.num_elements]
    swarm = ServingSwarm(sizes) if args.serve else None
    averager = swarm if swarm is not None else MemberArithmetic(sizes)
    outer_round = OuterRound(
        diloco, averager=averager, swarm=swarm, data=NoData(), stop_requested=lambda: False,  # type: ignore[arg-type]
        settings=RoundSettings(inner_steps=args.inner_steps, model=args.model, corpus_sha256="none",
                               fragments=schedule),
    )  # fmt: skip
    outer_round.start()
    rounds: list[dict[str, int]] = []
    warm_rounds = fragments  # one cycle: every buffer of every fragment allocated once
    while len(rounds) < warm_rounds + args.cycles * fragments:
        inner_step()
        outer_round.count_step(1, 0.0)
        before = rss()
        reset_peak()
        applied = outer_round.at_step_boundary()
        top = peak()
        if applied is not None:
            rounds.append({"round": applied.round_index, "before": before, "peak": top, "after": rss()})
    outer_round.finish()
    measured = rounds[warm_rounds:]
    resting = measured[0]["before"] - baseline
    return {
        "fragments": fragments,
        "model": args.model,
        "num_elements": diloco.num_elements,
        "fp32_model_bytes": 4 * diloco.num_elements,
        "codec": args.codec,
        "serve": args.serve,
        "baseline_rss_bytes": baseline,
        "resting_bytes": resting,
        "in_flight_bytes": max(r["peak"] - r["before"] for r in measured),
        "outer_peak_bytes": max(r["peak"] for r in measured) - baseline,
        "rounds_measured": len(measured),
    }


def run_child(args: argparse.Namespace, fragments: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", "--fragments", str(fragments), "--model", args.model,
            "--inner-steps", str(args.inner_steps), "--cycles", str(args.cycles), "--codec", args.codec]  # fmt: skip
    if not args.serve:
        argv.append("--no-serve")
    done = subprocess.run(
        argv, cwd=REPO_ROOT, env=os.environ | MALLOC_ENV, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the F = {fragments} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fragments", default="1,4", help="comma list of F; the first is the reference (1)")
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--inner-steps", type=int, default=8, help="H")
    parser.add_argument("--cycles", type=int, default=2, help="measured rounds per fragment")
    parser.add_argument("--codec", default="int8", help="the payload codec")
    parser.add_argument("--serve", action=argparse.BooleanOptionalAction, default=True,
                        help="publish every round's state as the daemon does")  # fmt: skip
    parser.add_argument(
        "--max-ratio", type=float, default=0.35, help="target: in-flight bytes, F vs 1, at most"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_output_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        args.fragments = int(args.fragments)
        print(json.dumps(measure(args)), flush=True)
        return 0
    runs = [run_child(args, int(f)) for f in args.fragments.split(",")]
    reference = runs[0]
    for run in runs:
        print_json(run)
    ratios = {
        run["fragments"]: {
            key: round(run[key] / reference[key], 3) if reference[key] > 0 else None
            for key in ("in_flight_bytes", "resting_bytes", "outer_peak_bytes")
        }
        for run in runs[1:]
    }
    met = all(
        r["in_flight_bytes"] is not None and r["in_flight_bytes"] <= args.max_ratio for r in ratios.values()
    )
    summary = {"summary": True, "met": met, "max_ratio": args.max_ratio, "ratios": ratios}
    print_json(summary)
    write_json(args.json_out, {"runs": runs, "summary": summary})
    mib = 2**20
    parts = [
        f"F={r['fragments']}: in flight {r['in_flight_bytes'] / mib:.1f} MiB, resting {r['resting_bytes'] / mib:.1f} MiB, "
        f"outer peak {r['outer_peak_bytes'] / mib:.1f} MiB"
        for r in runs
    ]
    in_flight = ", ".join(f"F={f} x{r['in_flight_bytes']}" for f, r in ratios.items())
    print(f"bench_fragment_memory: {args.model} ({reference['fp32_model_bytes'] / mib:.1f} MiB fp32), {args.codec}, "
          f"{'served' if args.serve else 'not served'}: {'; '.join(parts)}; in flight {in_flight} "
          f"(target <= {args.max_ratio}): {'PASS' if met else 'FAIL'}")  # fmt: skip
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
