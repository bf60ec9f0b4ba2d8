"""A synchronous facade for callers without an event loop (the node daemon's training loop).

`SyncAllReducePeer` owns a daemon thread running a uvloop event loop; the grpc.aio server and every
round live on that loop, and the caller's thread blocks in `allreduce()` until the round's result is
back (always within the round's deadline plus a small margin):

    with SyncAllReducePeer(host="0.0.0.0", port=0) as peer:
        group = GroupSpec.build(round_id=0, members=members, num_elements=vector.numel())
        result = peer.allreduce(vector, group=group, my_peer_id="a", weight=tokens,
                                codec=get_codec("int8"), error_feedback=feedback,
                                deadline=timedelta(seconds=60))

Between rounds the server keeps answering other members (a slow member may still pull our part), so
keep one SyncAllReducePeer for the node's lifetime and `close()` it on shutdown.
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType
from typing import TypeVar

import torch

from protocol.allreduce.allreduce import AllReduceResult
from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.faults import FaultPlan
from protocol.allreduce.group import GroupSpec
from protocol.allreduce.peer import AllReducePeer
from protocol.codecs import Codec
from protocol.error_feedback import ErrorFeedback
from protocol.loop import BackgroundLoop

T = TypeVar("T")

RESULT_MARGIN = timedelta(seconds=5)
"""How much longer than a round's deadline the caller waits before declaring the loop wedged."""


class SyncAllReducePeer:
    """Blocking wrapper around AllReducePeer; safe to call from one thread at a time."""

    def __init__(
        self,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        config: AllReduceConfig | None = None,
        fault_plan: FaultPlan | None = None,
        start_timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        self._loop = BackgroundLoop()
        try:
            self._peer = self._loop.run(
                AllReducePeer.start(host=host, port=port, config=config, fault_plan=fault_plan), start_timeout
            )
        except BaseException:
            self._loop.close()
            raise

    @property
    def port(self) -> int:
        """The port the server is bound to (useful after asking for port 0)."""
        return self._peer.port

    @property
    def address(self) -> str:
        """host:port other members should dial."""
        return self._peer.address

    def allreduce(
        self,
        vector: torch.Tensor,
        *,
        group: GroupSpec,
        my_peer_id: str,
        weight: float,
        codec: Codec,
        error_feedback: ErrorFeedback | None,
        deadline: timedelta,
        in_place: bool = False,
        send_rate: float | None = None,
    ) -> AllReduceResult:
        """Blocking `AllReducePeer.allreduce` (see there); returns within deadline + RESULT_MARGIN."""
        coroutine = self._peer.allreduce(
            vector,
            group=group,
            my_peer_id=my_peer_id,
            weight=weight,
            codec=codec,
            error_feedback=error_feedback,
            deadline=deadline,
            in_place=in_place,
            send_rate=send_rate,
        )
        return self._loop.run(coroutine, deadline + RESULT_MARGIN)

    def close(self, grace: timedelta | None = None) -> None:
        """Stop the server gracefully (in-flight RPCs get `grace`), then the loop thread."""
        try:
            self._loop.run(self._peer.stop(grace), (grace or timedelta(seconds=2)) + RESULT_MARGIN)
        finally:
            self._loop.close()

    def __enter__(self) -> SyncAllReducePeer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
