"""A discovery peer in its own process, for the crash test: the test SIGKILLs its process group.

Joins via ``--peers``, publishes one record under ``--run-name``, prints ``{"peer_id": …}`` once the
first store is accepted, then heartbeats until killed (or, if nobody kills it, leaves and exits
after ``--lifetime`` seconds so that a failed test leaves no process behind).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

from protocol.discovery.dht_node import DhtConfig, DhtNode
from protocol.discovery.registry import SwarmRegistry
from tests.protocol.discovery.support import PROTOCOL_VERSION, make_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", nargs="+", required=True, help="multiaddrs of running peers to join")
    parser.add_argument("--run-name", required=True, help="the run whose registry to publish in")
    parser.add_argument("--period", type=float, required=True, help="heartbeat period, seconds")
    parser.add_argument("--ttl", type=float, required=True, help="record TTL, seconds")
    parser.add_argument("--call-timeout", type=float, required=True, help="deadline of a DHT call, seconds")
    parser.add_argument(
        "--lifetime", type=float, default=60.0, help="exit on its own after this many seconds"
    )
    args = parser.parse_args()

    with DhtNode(DhtConfig(initial_peers=tuple(args.peers))) as node:
        registry = SwarmRegistry(
            node,
            run_name=args.run_name,
            protocol_version=PROTOCOL_VERSION,
            period=timedelta(seconds=args.period),
            ttl=timedelta(seconds=args.ttl),
            call_timeout=timedelta(seconds=args.call_timeout),
        )
        with registry:
            if not registry.publish(make_record(node.peer_id, port=6000)).result(timeout=10):
                raise SystemExit("the first store was not accepted")
            print(json.dumps({"peer_id": node.peer_id}), flush=True)
            time.sleep(args.lifetime)


if __name__ == "__main__":
    main()
