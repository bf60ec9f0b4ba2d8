"""Swarm all-reduce: butterfly reduce-scatter + all-gather over gRPC, with failover and bit-identical results.

Start here: `SyncAllReducePeer` (blocking facade for the training loop) or `AllReducePeer` (async),
`GroupSpec` (who takes part, who owns which part), `AllReduceResult`. Codecs and error feedback live in
`protocol.codecs` and `protocol.error_feedback`; with a sparse codec an owner re-encodes nothing and
every member sums the contributors' own payloads (`sparse.py`).
"""

from protocol.allreduce.allreduce import AllReduceResult
from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.faults import FaultPlan
from protocol.allreduce.group import GroupSpec, Member, split_by_weight
from protocol.allreduce.loop import SyncAllReducePeer
from protocol.allreduce.peer import AllReducePeer
from protocol.loop import BackgroundLoop

__all__ = [
    "AllReduceConfig",
    "AllReducePeer",
    "AllReduceResult",
    "BackgroundLoop",
    "FaultPlan",
    "GroupSpec",
    "Member",
    "SyncAllReducePeer",
    "split_by_weight",
]
