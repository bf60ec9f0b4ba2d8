"""Fuzz every RPC of a live dtnode node, then check that the node still completes a normal round.

    python scripts/tools/fuzz_rpcs.py --messages 10000          # the full campaign
    python scripts/tools/fuzz_rpcs.py --messages 200 --rpcs Deliver,GetManifest

Setup: a target node (a real ``SwarmNode``: DHT peer, one gRPC server with the all-reduce, state
sync, membership and health services, the round driver) runs in its own process; a partner node
runs in this one. The two first complete round 1 together, so the target holds a real, lingering
all-reduce round, a published snapshot and a slice of round 1's mean held for the partner (as a
tiered round's stage C holds one): fuzzed messages that name them get past the first checks and
into the round's state, not only into the parsers.

Phase 1, generation: per RPC, hypothesis draws ``--messages`` requests from strategies built on the
request's protobuf descriptor. Every field either keeps the value of a valid *template* request (the
partner's real header for round 1, the snapshot's real state id ...) or gets a hostile value: edge
integers (0, 2^32 - 1, 2^64 - 1), NaN / inf floats, unknown enum values, long strings, huge
repeated fields, wrong codecs, unknown rounds. The serialized bytes are then kept (valid wire,
wrong semantics) or mutated: truncated, bit-flipped, replaced by garbage, extended, swapped for
another message type, emptied, or padded past the server's message limit. A streaming RPC gets a
sequence of 0-4 such messages (header, then chunks).

Phase 2, sending: the requests go out as raw bytes through generic gRPC calls (identity
serializers), ``--concurrency`` at a time, each with a deadline. Every call must end with a status
before its deadline (a call still open at the deadline is a *hang*) and never with UNKNOWN or
INTERNAL (an exception escaped a servicer: a *crash*); after each RPC's campaign the node must still
answer its health check. Tracebacks in the target's log are counted as well. A pushing client that
skips the contract's handshake (1 call in 5) and is refused while still writing sees INTERNAL from
its own gRPC core, not the server's status (grpc/grpc#36066): counted apart, as BROKEN_WRITE.

Phase 3, the normal round: both nodes publish the next lineage and run round 2; each must average
with the other, and the result must equal, bit for bit, the token-weighted mean computed here the
way the protocol promises for codec "none" (per part, sum(w_i x_i) in fp32 in member order, divided
by the fp32 sum of weights).

The target process is ``scripts/tools/fuzz_target.py``, the strategies ``scripts/tools/fuzz_messages.py``.

Prints a JSON summary (per RPC: messages, status histogram, crashes, hangs, max latency) and a
one-line verdict; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocol.gen.dtnode.v1 import allreduce_pb2 as allreduce_pb
from protocol.swarm.node import RoundResult, SwarmNode
from protocol.swarm.result import GroupAveraged, result_name
from protocol.swarm.streams import to_allreduce_group
from scripts.common import add_output_flags, print_json, write_json
from scripts.tools.fuzz_messages import (
    Case,
    Context,
    Oversized,
    Rpc,
    build_rpcs,
    case_strategy,
    draw_examples,
)
from scripts.tools.fuzz_target import (
    FAILING_CODES,
    MAX_MESSAGE_BYTES,
    NUM_ELEMENTS,
    NUM_TOKENS,
    SNAPSHOT_TENSOR,
    Target,
    lineage_hash,
    round_vector,
    run_round,
    swarm_config,
    tensor_sha256,
)

# --- sending -------------------------------------------------------------------------------------------


@dataclass
class RpcReport:
    """What one RPC's campaign came to."""

    messages: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    crashes: int = 0
    hangs: int = 0
    max_latency_s: float = 0.0
    healthy_after: bool = False
    examples: list[str] = field(default_factory=list)  # a few failing cases, hex, for the record

    def as_json(self) -> dict[str, Any]:
        return {
            "messages": self.messages, "statuses": dict(sorted(self.statuses.items())), "crashes": self.crashes,
            "hangs": self.hangs, "max_latency_s": round(self.max_latency_s, 3), "healthy_after": self.healthy_after,
            "failing_examples": self.examples,
        }  # fmt: skip


async def call_once(channel: grpc.aio.Channel, rpc: Rpc, case: Case, deadline: timedelta) -> str:
    """Send one fuzzed call; its final status code's name.

    A pushing client that follows the contract writes the header, waits for the first answer that
    is not a heartbeat, and sends its chunks only after SendChunks. A client that writes everything at
    once (``handshake=False``) and is refused meanwhile sees its write fail with INTERNAL "Internal
    error from Core" instead of the server's status (grpc/grpc#36066; the contract tells senders to
    wait for that reason): that outcome is counted as BROKEN_WRITE, not as a crash.
    """
    messages = [m.materialize() if isinstance(m, Oversized) else m for m in case.messages]
    timeout = deadline.total_seconds()
    if not rpc.streaming_request:
        try:
            if rpc.streaming_response:
                stream = channel.unary_stream(rpc.path)(messages[0], timeout=timeout)
                while await stream.read() is not grpc.aio.EOF:
                    pass
                return (await stream.code()).name
            await channel.unary_unary(rpc.path)(messages[0], timeout=timeout)
            return grpc.StatusCode.OK.name
        except grpc.aio.AioRpcError as error:
            return error.code().name
    assert rpc.reply is not None
    call = channel.stream_stream(rpc.path, response_deserializer=rpc.reply.FromString)(timeout=timeout)
    writing = False
    try:
        rest = messages
        if case.handshake and messages:
            writing = True
            await call.write(messages[0])
            writing = False
            rest = messages[1:]
            while (reply := await call.read()) is not grpc.aio.EOF and reply.WhichOneof(
                "body"
            ) == "still_working":
                pass
            if reply is grpc.aio.EOF:
                return (await call.code()).name
            if reply.WhichOneof("body") != "send_chunks":
                rest = []  # the part is decided: no chunks to send
        writing = True
        for message in rest:
            await call.write(message)
        await call.done_writing()
        writing = False
        while await call.read() is not grpc.aio.EOF:
            pass
        return (await call.code()).name
    except grpc.aio.AioRpcError as error:
        broken = writing and not case.handshake and error.code() == grpc.StatusCode.INTERNAL
        return "BROKEN_WRITE" if broken else error.code().name
    except asyncio.InvalidStateError:  # wrote after the server ended the call: its status stands
        return (await call.code()).name


async def fuzz_rpc(
    address: str, rpc: Rpc, cases: list[Case], *, concurrency: int, deadline: timedelta
) -> RpcReport:
    """Send every case (``concurrency`` at once); then ask the node's health service."""
    report = RpcReport()
    semaphore = asyncio.Semaphore(concurrency)
    options = [
        ("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", 2 * MAX_MESSAGE_BYTES),
    ]
    async with grpc.aio.insecure_channel(address, options=options) as channel:

        async def one(case: Case) -> None:
            async with semaphore:
                started = time.monotonic()
                try:  # a safety net on top of the call's own deadline: this script never hangs
                    async with asyncio.timeout(deadline.total_seconds() + 5):
                        code = await call_once(channel, rpc, case, deadline)
                except TimeoutError:
                    code = "NO_STATUS"
                seconds = time.monotonic() - started
            report.messages += 1
            report.statuses[code] += 1
            report.max_latency_s = max(report.max_latency_s, seconds)
            hung = code == "NO_STATUS" or (
                code == "DEADLINE_EXCEEDED" and seconds >= 0.95 * deadline.total_seconds()
            )
            report.hangs += hung
            report.crashes += code in FAILING_CODES
            if (hung or code in FAILING_CODES) and len(report.examples) < 5:
                report.examples.append(f"{code}: " + " | ".join(
                    (m.prefix.hex()[:200] + "+pad") if isinstance(m, Oversized) else m.hex()[:200] for m in case.messages))  # fmt: skip

        await asyncio.gather(*(one(case) for case in cases))
        report.healthy_after = await healthy(channel)
    return report


async def healthy(channel: grpc.aio.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=3.0)
    except grpc.aio.AioRpcError:
        return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


# --- the campaign --------------------------------------------------------------------------------------


def check_round(
    target: Target, partner: SwarmNode, round: int, timeout: timedelta
) -> tuple[dict[str, Any], RoundResult]:
    """Run round ``round`` on both nodes at once; return (the target's reply, the partner's result)."""
    target.send({"op": "round", "round": round})
    with ThreadPoolExecutor(max_workers=1) as pool:
        mine = pool.submit(run_round, partner, "partner", round)
        theirs = target.reply(timeout)
        return theirs, mine.result(timeout.total_seconds())


def exact_mean(result: GroupAveraged, peer_ids: dict[str, str], round: int) -> torch.Tensor:
    """Per part: sum(w_i x_i) in fp32 in member order, divided by the fp32 sum of the weights."""
    group = to_allreduce_group(result.group)
    who = {peer_id: name for name, peer_id in peer_ids.items()}
    reference = torch.empty(NUM_ELEMENTS)
    for part, contributors in enumerate(result.allreduce.contributors):
        piece = group.part_slice(part)
        total = torch.zeros(group.part_num_elements(part))
        weight_sum = torch.zeros(())
        for peer_id in [m.peer_id for m in group.members if m.peer_id in contributors]:
            weight = float(NUM_TOKENS[who[peer_id]])
            total = total + round_vector(who[peer_id], round)[piece] * weight
            weight_sum = weight_sum + weight
        reference[piece] = total / weight_sum
    return reference


def verify_round(
    target: Target, partner: SwarmNode, round: int, peer_ids: dict[str, str]
) -> tuple[dict[str, Any], RoundResult]:
    """A normal round: both averaged with each other, identical bytes, equal to the exact mean."""
    theirs, mine = check_round(target, partner, round, timedelta(seconds=60))
    verdict: dict[str, Any] = {"target": theirs, "partner_kind": result_name(mine), "ok": False}
    if isinstance(mine, GroupAveraged) and theirs.get("kind") == "averaged":
        averaged = mine.allreduce.averaged
        both = all(sorted(c) == sorted(peer_ids.values()) for c in mine.allreduce.contributors)
        verdict.update(
            both_contributed=both,
            identical=theirs.get("sha256") == tensor_sha256(averaged),
            exact_mean=torch.equal(averaged, exact_mean(mine, peer_ids, round)),
        )
        verdict["ok"] = (
            both and verdict["identical"] and verdict["exact_mean"] and not mine.allreduce.fell_back
        )
    return verdict, mine


def publish_both(target: Target, partner: SwarmNode, round: int) -> None:
    target.send({"op": "publish", "round": round})
    target.reply(timedelta(seconds=10))
    partner.publish(round=round, param_hash=lineage_hash(round), tokens_per_s=1000.0, snapshot=None)


def wait_for_lineage(partner: SwarmNode, peer_ids: dict[str, str], round: int) -> None:
    """Until the partner's DHT view shows both nodes at lineage ``round`` (at most 20 s)."""
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        view = partner.view()
        if all((r := view.get(p)) is not None and r.round == round for p in peer_ids.values()):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the nodes never both showed lineage {round} in the DHT")


def run_campaign(
    *,
    num_messages: int,
    rpc_names: list[str] | None = None,
    concurrency: int = 32,
    deadline: timedelta = timedelta(seconds=5),
    random_seed: int = 0,
    work_dir: Path | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Start the target and a partner, run round 1, fuzz every RPC, run round 2; the JSON summary."""
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="fuzz-rpcs-"))
    target = Target(work_dir / "target.log")
    partner: SwarmNode | None = None
    summary: dict[str, Any] = {
        "messages_per_rpc": num_messages,
        "rpcs": {},
        "target_log": str(target.log_path),
    }
    try:
        partner = SwarmNode(swarm_config(tuple(target.ready["multiaddrs"])))
        peer_ids = {"target": target.ready["peer_id"], "partner": partner.peer_id}
        partner.publish(round=0, param_hash=lineage_hash(0), tokens_per_s=1000.0, snapshot=None)
        wait_for_lineage(partner, peer_ids, 0)
        before, first = verify_round(target, partner, 1, peer_ids)
        summary["round_before"] = before
        if not before["ok"] or not isinstance(first, GroupAveraged):
            raise RuntimeError(f"round 1 (before fuzzing) failed: {before}")
        group = to_allreduce_group(first.group)
        partner_index = group.index_of(partner.peer_id)
        round_ref = allreduce_pb.RoundRef(
            round_id=1, group_digest=group.digest, sender_index=partner_index, sender_peer_id=partner.peer_id
        )
        publish_both(target, partner, 1)
        context = Context(
            ints=(1, 2, partner_index, 1 - partner_index, *(group.part_num_elements(i) for i in range(2)), 64 * 1024 * 4),
            strings=(partner.peer_id, target.ready["peer_id"], lineage_hash(0), lineage_hash(1), SNAPSHOT_TENSOR, target.address),
            blobs=(group.digest, bytes(16), bytes(4 * 4096)),
        )  # fmt: skip
        part_sizes = (group.part_num_elements(0), group.part_num_elements(1))
        rpcs = [
            r for r in build_rpcs(context, round_ref, part_sizes) if rpc_names is None or r.name in rpc_names
        ]
        foreign = tuple(
            t.SerializeToString() for r in build_rpcs(context, round_ref, part_sizes) for t in r.templates
        )
        for index, rpc in enumerate(rpcs):
            started = time.monotonic()
            cases = draw_examples(case_strategy(rpc, context, foreign), num_messages, random_seed + index)
            generated = time.monotonic()
            report = asyncio.run(
                fuzz_rpc(target.address, rpc, cases, concurrency=concurrency, deadline=deadline)
            )
            summary["rpcs"][rpc.name] = {
                **report.as_json(), "seconds_generating": round(generated - started, 1),
                "seconds_sending": round(time.monotonic() - generated, 1), "alive_after": target.alive(),
            }  # fmt: skip
            log(f"{rpc.name}: {json.dumps(summary['rpcs'][rpc.name]['statuses'])}")
            if not target.alive():
                break
        if target.alive():
            wait_for_lineage(partner, peer_ids, 1)
            summary["round_after"], _ = verify_round(target, partner, 2, peer_ids)
    finally:
        summary["target_alive_at_end"] = target.alive()
        if partner is not None:
            partner.leave()
            partner.close()
        target.stop()
        summary["target_tracebacks"] = target.num_tracebacks()
    reports = summary["rpcs"].values()
    summary["ok"] = bool(
        summary["target_alive_at_end"]
        and summary["target_tracebacks"] == 0
        and summary.get("round_after", {}).get("ok", False)
        and all(
            r["crashes"] == 0 and r["hangs"] == 0 and r["healthy_after"] and r["alive_after"] for r in reports
        )
        and len(summary["rpcs"]) == len(rpc_names or build_rpc_names())
    )
    return summary


def build_rpc_names() -> list[str]:
    return [
        "PushContribution",
        "PushReplica",
        "PullAverage",
        "FinishRound",
        "PullSlice",
        "Deliver",
        "Collect",
        "GetManifest",
        "FetchRange",
        "GetStatus",
    ]


def one_line(summary: dict[str, Any]) -> str:
    reports = summary["rpcs"]
    total = sum(r["messages"] for r in reports.values())
    return (
        f"{'PASS' if summary['ok'] else 'FAIL'}: {total} messages over {len(reports)} RPCs, "
        f"{sum(r['crashes'] for r in reports.values())} crashes, {sum(r['hangs'] for r in reports.values())} hangs, "
        f"max latency {max((r['max_latency_s'] for r in reports.values()), default=0.0):.2f}s, "
        f"{summary['target_tracebacks']} tracebacks, round after fuzzing "
        f"{'exact' if summary.get('round_after', {}).get('ok') else 'FAILED'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000, help="Fuzzed calls per RPC.")
    parser.add_argument("--rpcs", default="", help="Comma-separated RPC names (default: all).")
    parser.add_argument("--concurrency", type=int, default=32, help="Calls in flight at once.")
    parser.add_argument("--deadline-seconds", type=float, default=5.0, help="Deadline of every fuzzed call.")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (per RPC: seed + index).")
    add_output_flags(parser)  # --json-out: the summary
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    summary = run_campaign(
        num_messages=args.messages,
        rpc_names=[name for name in args.rpcs.split(",") if name] or None,
        concurrency=args.concurrency,
        deadline=timedelta(seconds=args.deadline_seconds),
        random_seed=args.seed,
    )
    print_json(summary)
    write_json(args.json_out, summary)
    print(one_line(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
