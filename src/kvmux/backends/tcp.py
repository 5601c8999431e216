"""``tcp``: the producer serves its pool, the consumer pulls over a socket.

The cross-host default. One ``fetch`` request names a whole batch of keys;
the producer answers which it has, pins their slots and streams them with
gather writes straight from the pool (no copy of ours on the way out); the
consumer scatters them with one ``recvmsg`` per 1024 ranges straight into the
blocks' byte ranges of KV memory (:mod:`kvmux.net.kv_views`), or, for memory
that is not plain contiguous host memory, into a reused staging buffer that is copied
into the blocks in runs. With ``save_mode: borrow`` the producer gathers
straight from the blocks' ranges of its own KV memory instead of a pool. A
producer that dies or stalls midway leaves
the keys that arrived ``ok`` and fails the rest, within ``timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from itertools import compress

import numpy as np
import torch

from kvmux.addressing import row_ranges, row_runs
from kvmux.blocks import BlockCopier
from kvmux.errors import CapacityError, LayoutError, ProtocolError, TransferError
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.net import iovec
from kvmux.net.client import Link
from kvmux.net.iovec import IoVecs
from kvmux.net.kv_views import KVViews
from kvmux.net.memory import byte_view
from kvmux.net.messages import HEADER_SLACK, Blocks, FetchReply, FetchRequest, Message, expect
from kvmux.net.server import Handler, Session
from kvmux.pool.config import ServedPoolConfig
from kvmux.pool.peer import PullInterrupted
from kvmux.pool.served import ServedPoolBackend
from kvmux.pool.store import PoolStore
from kvmux.pool.transport import PullTransport, Refusal

_STAGING_BYTES = 4 * 2**20
"""Per loading thread, for KV memory that cannot be read into directly."""


class TcpConfig(ServedPoolConfig):
    backend: str = "tcp"


class TcpTransport(PullTransport):
    """Blocks as frames over the control connection itself."""

    service = "tcp"

    def __init__(self, config: ServedPoolConfig, store: PoolStore) -> None:
        super().__init__(config, store)
        self._pool: torch.Tensor | None = None
        self._pool_bytes: memoryview | None = None
        self._kv: KVViews | None = None
        self._staging = threading.local()

    def register(self, blocks: BlockCopier) -> None:
        layout = blocks.layout
        if layout.block_nbytes + HEADER_SLACK > self.config.max_frame_bytes:
            raise CapacityError(
                f"a block of {layout.block_nbytes} bytes does not fit in one frame of "
                f"max_frame_bytes={self.config.max_frame_bytes}"
            )
        super().register(blocks)
        self._kv = KVViews.of(layout, blocks.caches)
        if self._kv is None and self.store.lend:
            raise LayoutError(
                "tcp with save_mode=borrow sends from the KV memory itself: it needs every "
                "layer to be one contiguous host tensor (use save_mode=copy)"
            )

    def make_pool(self, slots: int, block_nbytes: int) -> torch.Tensor:
        # zeros, not empty: the pages are committed now (the bound is real memory)
        # and no save pays for page faults.
        pool = torch.zeros((slots, block_nbytes), dtype=torch.uint8)
        self._pool, self._pool_bytes = pool, byte_view(pool)
        return pool

    # ------------------------------------------------------------------ producer

    def handlers(self, refused: Refusal) -> dict[type[Message], Handler]:
        def serve_fetch(session: Session, req: FetchRequest) -> None:
            deadline = time.monotonic() + self.config.timeout_s
            if not refused(session):
                self._serve_fetch(session, req, deadline)

        return {FetchRequest: serve_fetch}

    def _serve_fetch(self, session: Session, req: FetchRequest, deadline: float) -> None:
        runs = req.digest_runs()
        store = self.store
        with store.lock:
            rows = store.find_rows(store.slots.stored_keys(runs))
            serving = store.is_open
            pool, pool_bytes = self._pool, self._pool_bytes
            hit = rows >= 0
            found = rows[hit].tolist()
            store.slots.pin(found)
        try:
            nbytes = self.copier.block_nbytes if serving else 0
            hits = hit.astype(np.uint8).tobytes()
            session.send(FetchReply(found=hits, block_nbytes=nbytes), deadline=deadline)
            if not serving:
                return
            per_frame = max(1, (session.frame_limit - HEADER_SLACK) // nbytes)
            for first in range(0, len(found), per_frame):
                chunk = found[first : first + per_frame]
                session.send(
                    Blocks(first=first, count=len(chunk), nbytes=len(chunk) * nbytes),
                    self._payload(pool, pool_bytes, chunk, nbytes),
                    deadline=deadline,
                )
        finally:
            with store.lock:
                store.slots.unpin(found)
            store.settle()

    def _payload(
        self,
        pool: torch.Tensor | None,
        pool_bytes: memoryview | None,
        slots: list[int],
        nbytes: int,
    ) -> IoVecs | list[memoryview]:
        """The bytes of ``slots``: rows of ``pool``, or with no pool (lending) the
        blocks' ranges of KV memory, as :meth:`KVViews.payload` chooses. Sent as
        they lie, however small: gathering 16 KiB blocks into one buffer first made
        a 4096-block fetch half as fast."""
        if pool is None:
            assert self._kv is not None
            return self._kv.payload(slots)
        if iovec.worth_a_table(len(slots)):
            return IoVecs(row_ranges(pool.data_ptr(), slots, nbytes), pool)
        assert pool_bytes is not None
        return [
            pool_bytes[first * nbytes : (first + count) * nbytes]
            for first, _, count in row_runs(slots, len(slots))
        ]

    # ------------------------------------------------------------------ consumer

    def pull(
        self, link: Link, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]:
        chan = link.channel
        chan.send(FetchRequest.of(keys), deadline=deadline)
        reply = expect(chan.recv(deadline), FetchReply)
        nbytes = self.copier.block_nbytes
        if len(reply.found) != len(keys) or (any(reply.found) and reply.block_nbytes != nbytes):
            raise ProtocolError(
                f"fetch reply for {len(reply.found)} blocks of {reply.block_nbytes} bytes, "
                f"asked for {len(keys)} of {nbytes}"
            )
        wanted = list(compress(block_ids, reply.found))
        arrived = 0
        try:
            for count in self._receive(link, wanted, deadline):
                arrived = count
        except TransferError as exc:
            reason = f"{type(exc).__name__}: {chan.peer} broke off mid-transfer: {exc}"
            raise PullInterrupted(str(exc), _outcomes(reply.found, arrived, reason)) from None
        return _outcomes(reply.found, arrived, "")

    def _receive(self, link: Link, blocks: list[int], deadline: float) -> Iterator[int]:
        """Read one fetch's blocks frames into ``blocks``, yielding how many have
        arrived whole so far; if the stream breaks, it yields the final count once
        more (those blocks are in place) before the error propagates.

        A frame is read straight into the blocks' ranges of KV memory in one
        scatter read, or, where memory does not allow that, through staging rows
        that are copied in afterwards.
        """
        chan = link.channel
        nbytes = self.copier.block_nbytes
        done = 0
        while done < len(blocks):
            frame = expect(chan.recv(deadline), Blocks)
            if (
                frame.first != done
                or frame.count > len(blocks) - done
                or frame.nbytes != frame.count * nbytes
            ):
                raise ProtocolError(
                    f"blocks frame {frame.first}+{frame.count} ({frame.nbytes} bytes) "
                    f"out of step at block {done} of {len(blocks)}"
                )
            end = done + frame.count
            while done < end:
                staging: torch.Tensor | None = None
                views: IoVecs | list[memoryview]
                if self._kv is not None:
                    group = blocks[done:end]
                    views = self._kv.payload(group)
                else:
                    staging, staging_bytes = self._staging_buffer(nbytes)
                    group = blocks[done : min(end, done + staging.shape[0])]
                    views = [staging_bytes[: len(group) * nbytes]]
                before = chan.bytes_delivered
                try:
                    chan.recv_into(views, deadline)
                except TransferError:
                    whole = (chan.bytes_delivered - before) // nbytes
                    if staging is not None:
                        self.copier.copy_in(group[:whole], staging)
                    yield done + whole
                    raise
                if staging is not None:
                    self.copier.copy_in(group, staging)
                done += len(group)
                yield done

    def _staging_buffer(self, block_nbytes: int) -> tuple[torch.Tensor, memoryview]:
        staging: torch.Tensor | None = getattr(self._staging, "tensor", None)
        if staging is None or staging.shape[1] != block_nbytes:
            rows = max(1, _STAGING_BYTES // block_nbytes)
            staging = torch.empty((rows, block_nbytes), dtype=torch.uint8)
            self._staging.tensor, self._staging.bytes = staging, byte_view(staging)
        view: memoryview = self._staging.bytes
        return staging, view

    def close(self) -> None:
        self._pool = self._pool_bytes = None


class TcpBackend(ServedPoolBackend):
    """The served pool over TCP. See the module docstring."""

    config_model = TcpConfig
    config: TcpConfig
    transport_type = TcpTransport


def _outcomes(found: bytes, arrived: int, reason: str) -> list[Outcome]:
    """OK for the first ``arrived`` found keys, failed for the found rest, else MISSING."""
    if arrived == len(found) and all(found):  # the usual fetch: no walk per key
        return [OK] * arrived
    outcomes: list[Outcome] = []
    seen = 0
    for hit in found:
        if not hit:
            outcomes.append(MISSING)
            continue
        outcomes.append(OK if seen < arrived else failed(reason))
        seen += 1
    return outcomes
