"""A client-mode node's way of hearing from the swarm: it collects what others hold for it.

A node in client mode (``--client-mode``) accepts no connections, so its peers keep the membership
messages meant for it (a Proposal, a Begin, a Cancel) in their ``Outbox`` instead of dialling it
(``protocol/membership/outbox.py``). :func:`collect_messages` keeps one long-poll ``Collect`` call
open to every live peer that is not a client itself (the only ones that may lead a round or answer
ours), each renewed as soon as it returns, and hands every message to the round driver exactly as
the membership servicer hands a delivered one. So a message reaches the client one round trip after
it was sent, over a connection the client opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta
from typing import Final

from protocol.membership.transport import MembershipClient
from protocol.swarm.driver import RoundDriver

logger = logging.getLogger(__name__)

COLLECT_WAIT: Final = timedelta(seconds=10)
"""How long each Collect call stays open while the peer holds nothing for us."""
RETRY_AFTER: Final = timedelta(seconds=1)
"""Pause after a failed Collect call before the next one to the same peer."""
MAX_COLLECTED_PEERS: Final = 64
"""At most this many peers are polled at once (the first by peer id: leaders are the smallest)."""


async def _collect_from(driver: RoundDriver, client: MembershipClient, peer_id: str) -> None:
    """Poll one peer for as long as it is in our view (the caller cancels us when it is not)."""
    while True:
        address = driver.address_of(peer_id)
        messages = None if address is None else await client.collect(address, wait=COLLECT_WAIT)
        if messages is None:
            await asyncio.sleep(RETRY_AFTER.total_seconds())
            continue
        for sender, message in messages:
            if sender != peer_id:
                # It speaks for someone else: take it as what it says it is only from that peer.
                logger.warning("peer %s handed us a message signed %s; dropped", peer_id, sender)
                continue
            try:
                driver.on_message(sender, message)
            except ValueError as error:  # as the servicer refuses a message the driver refuses
                logger.warning("collected %s from %s refused: %s", type(message).__name__, sender, error)


async def collect_messages(driver: RoundDriver, client: MembershipClient) -> None:
    """Run forever (until cancelled): keep a Collect poll open to every live non-client peer."""
    polls: dict[str, asyncio.Task[None]] = {}
    tick = driver.config.view_refresh.total_seconds()
    try:
        while True:
            servers = sorted(
                record.peer_id
                for record in driver.view
                if not record.client and record.peer_id != driver.peer_id
            )[:MAX_COLLECTED_PEERS]
            for peer_id in [p for p in polls if p not in servers]:
                polls.pop(peer_id).cancel()
            for peer_id in servers:
                poll = polls.get(peer_id)
                if poll is not None and poll.done() and not poll.cancelled() and poll.exception():
                    logger.error("collecting from %s failed", peer_id, exc_info=poll.exception())
                if poll is None or poll.done():
                    polls[peer_id] = asyncio.create_task(_collect_from(driver, client, peer_id))
            await asyncio.sleep(tick)
    finally:
        for task in polls.values():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*polls.values(), return_exceptions=True)
