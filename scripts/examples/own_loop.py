"""Your own model, optimizer and loop in a dtnode swarm (the Python API, ``node/api.py``).

A small residual MLP (not dtnode's GPT) learns a fixed random "teacher" function from a toy
dataset generated on the fly; each node trains on the data shard the swarm assigns it. The loop is
the usual ``zero_grad / backward / step`` with its own AdamW; ``swarm.step(samples=n)`` after each
inner step runs DiLoCo's outer round when it is due.

Start a swarm, then join it from another terminal (or machine) with the address the first prints::

    python scripts/examples/own_loop.py --name demo --rounds 10
    python scripts/examples/own_loop.py --name demo --rounds 10 --peers /ip4/127.0.0.1/tcp/PORT/p2p/ID

``--hashes FILE`` writes each round's report as JSON (the tests compare them across nodes);
``--save FILE`` / ``--resume FILE`` checkpoint with torch.save.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from node.api import RoundReport, join_swarm  # noqa: E402

DIM = 32


class ResidualMLP(nn.Module):
    """x (B, DIM) → y (B, 1) through a few pre-norm residual blocks."""

    def __init__(self, dim: int = DIM, hidden: int = 64, num_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(num_blocks)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)  # (B, DIM)
        return self.head(x)  # (B, 1)


def toy_batch(
    step: int, shard: tuple[int, int], batch_size: int, data_seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of shard ``(index, count)``: a pure function of its arguments, so a resumed run
    reads what an uninterrupted one would. Targets: a fixed random two-layer teacher."""
    teacher = torch.Generator().manual_seed(data_seed)
    w1, w2 = torch.randn(DIM, 16, generator=teacher), torch.randn(16, 1, generator=teacher)
    generator = torch.Generator().manual_seed(
        ((data_seed * 1009 + shard[0]) * 1013 + shard[1]) * 10**9 + step
    )
    x = torch.randn(batch_size, DIM, generator=generator)  # (B, DIM)
    return x, torch.tanh(x @ w1) @ w2  # (B, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="own-loop", help="Run name (the swarm's).")
    parser.add_argument("--peers", default="", help="Comma-separated multiaddrs of running nodes.")
    parser.add_argument("--data-id", default="toy-teacher-v1", help="The data's identity (checked on join).")
    parser.add_argument("--rounds", type=int, default=5, help="Outer rounds to train.")
    parser.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per round.")
    parser.add_argument("--batch-size", type=int, default=32, help="Samples per inner step.")
    parser.add_argument("--lr", type=float, default=3e-3, help="Inner AdamW learning rate.")
    parser.add_argument("--codec", default="int8", help="Pseudo-gradient wire codec.")
    parser.add_argument("--min-peers", type=int, default=1, help="Fewest nodes a round may have.")
    parser.add_argument("--start-peers", type=int, default=1, help="Nodes to wait for before training.")
    parser.add_argument("--join-window", type=float, default=5.0, help="Seconds a round's leader waits.")
    parser.add_argument("--listen", default="0.0.0.0:0", help="gRPC HOST:PORT.")
    parser.add_argument("--run-dir", default="", help="Where node.json goes (default runs/<name>).")
    parser.add_argument("--hashes", type=Path, help="Write each round's report here (JSON).")
    parser.add_argument("--save", type=Path, help="Save a checkpoint here at the end.")
    parser.add_argument("--resume", type=Path, help="Resume from a checkpoint saved with --save.")
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # every node starts from the same init (round 0's lineage)
    model = ResidualMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    checkpoint = torch.load(args.resume, weights_only=True) if args.resume else None
    if checkpoint is not None:
        opt.load_state_dict(checkpoint["inner_optimizer"])
    swarm = join_swarm(
        model,
        run_name=args.name,
        data_id=args.data_id,
        peers=args.peers,
        inner_steps=args.inner_steps,
        codec=args.codec,
        min_peers=args.min_peers,
        start_peers=args.start_peers,
        join_window=args.join_window,
        listen=args.listen,
        run_dir=args.run_dir,
        state=None if checkpoint is None else checkpoint["swarm"],
    )
    reports: list[RoundReport] = []
    try:
        while swarm.num_rounds < args.rounds:
            x, y = toy_batch(swarm.num_steps, swarm.shard, args.batch_size, data_seed=0)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            report = swarm.step(samples=args.batch_size)
            if report is not None:
                reports.append(report)
                print(f"round {report.round} {report.kind} peers={report.num_peers} loss={loss.item():.4f} "
                      f"param_hash={report.param_hash[:12]}", flush=True)  # fmt: skip
                if args.hashes:
                    args.hashes.write_text(json.dumps([asdict(r) for r in reports], indent=1))
        if args.save:
            torch.save({"swarm": swarm.state_dict(), "inner_optimizer": opt.state_dict()}, args.save)
        swarm.finish()  # serve nodes still behind us, then leave
    finally:
        swarm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
