"""State sync: a joining (or lagging) node fetches the current global state from up-to-date peers.

Start here: `Snapshot` (what is served: round, state id, named flat tensors, metadata, hashes),
`StateProvider` + `add_state_sync_to_server` (serve snapshots on a grpc.aio server),
`fetch_state` (get one, verified, from several sources in parallel), `SyncStateSync` (blocking
facade for the training loop). The wire contract is protos/dtnode/v1/statesync.proto.
"""

from protocol.statesync.config import FetchOptions, StateSyncConfig
from protocol.statesync.errors import StateSyncError
from protocol.statesync.faults import ServeFaultPlan
from protocol.statesync.fetch import FetchReport, fetch_state, fetch_state_with_report
from protocol.statesync.loop import SyncStateSync
from protocol.statesync.provider import SERVICE_NAME, StateProvider, add_state_sync_to_server
from protocol.statesync.server import StateSyncServer
from protocol.statesync.snapshot import Snapshot, TensorEntry

__all__ = [
    "SERVICE_NAME",
    "FetchOptions",
    "FetchReport",
    "ServeFaultPlan",
    "Snapshot",
    "StateProvider",
    "StateSyncConfig",
    "StateSyncError",
    "StateSyncServer",
    "SyncStateSync",
    "TensorEntry",
    "add_state_sync_to_server",
    "fetch_state",
    "fetch_state_with_report",
]
