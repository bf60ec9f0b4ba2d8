"""This peer's encoded contributions to the parts it sends to other owners.

Chunks are encoded on demand, on a worker thread, just before they are written, so encoding chunk
c + 1 overlaps sending chunk c. With error feedback each chunk is encoded exactly once (the residual
update must happen once) and cached, so a resend to a backup owner sends the very same bytes; without
it a resend simply encodes again (the codecs are deterministic), and nothing is cached.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import torch

from protocol.allreduce.group import GroupSpec
from protocol.allreduce.reducer import chunk_sizes
from protocol.allreduce.sparse import is_sparse
from protocol.codecs import Codec
from protocol.error_feedback import ErrorFeedback


class ContributionSource:
    """Encoded chunks of `vector` for every part, keyed by (part, chunk)."""

    def __init__(
        self,
        *,
        vector: torch.Tensor,
        group: GroupSpec,
        my_index: int,
        codec: Codec,
        error_feedback: ErrorFeedback | None,
        chunk_num_elements: int,
        executor: Executor,
    ) -> None:
        self._vector = vector  # (E,) the caller's fp32 vector; never written
        self._group = group
        self._my_index = my_index
        self._codec = codec
        self._error_feedback = error_feedback
        self._chunk_num_elements = chunk_num_elements
        self._executor = executor
        self._cache: dict[tuple[int, int], asyncio.Future[bytes]] = {}

    def chunk_sizes(self, part_index: int) -> list[int]:
        return chunk_sizes(self._group.part_num_elements(part_index), self._chunk_num_elements)

    def num_payload_bytes(self, part_index: int) -> int:
        return sum(self._codec.encoded_num_bytes(size) for size in self.chunk_sizes(part_index))

    def _encode(self, part_index: int, chunk_index: int) -> bytes:
        offset = self._group.part_bounds[part_index] + chunk_index * self._chunk_num_elements
        size = self.chunk_sizes(part_index)[chunk_index]
        values = self._vector[offset : offset + size]
        # The owner's own part keeps the residual of the average it broadcasts (see ErrorFeedback),
        # so its own contribution, only sent when a backup took the part over, is encoded plainly.
        # A sparse round broadcasts no re-encoded average: there our own part is a contribution too.
        owner_keeps_residual = part_index == self._my_index and not is_sparse(self._codec)
        if self._error_feedback is None or owner_keeps_residual:
            return self._codec.encode(values).numpy().tobytes()
        return self._error_feedback.encode(self._codec, values, offset).numpy().tobytes()

    async def payload(self, part_index: int, chunk_index: int) -> bytes:
        """The encoded chunk; encodes it on the worker thread unless it is cached."""
        loop = asyncio.get_running_loop()
        if self._error_feedback is None:
            return await loop.run_in_executor(self._executor, self._encode, part_index, chunk_index)
        key = (part_index, chunk_index)
        if key not in self._cache:
            self._cache[key] = asyncio.ensure_future(
                loop.run_in_executor(self._executor, self._encode, part_index, chunk_index)
            )
        return await asyncio.shield(self._cache[key])

    def holds(self, part_index: int) -> bool:
        """Whether every chunk of our contribution to the part is cached (encoded, with error feedback),
        so it can be resent without reading the vector again."""
        return all(
            (future := self._cache.get((part_index, chunk_index))) is not None
            and future.done()
            and not future.cancelled()
            and future.exception() is None
            for chunk_index in range(len(self.chunk_sizes(part_index)))
        )

    def release(self) -> None:
        """Drop cached chunks once no resend can be needed."""
        for future in self._cache.values():
            if not future.done():
                future.cancel()
        self._cache.clear()
        self._vector = torch.empty(0)
