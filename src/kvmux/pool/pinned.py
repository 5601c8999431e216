"""PinnedTransport: pull by locating, pinning, then moving (``shm``, ``nixl``, ``mooncake``).

The consumer asks the producer to *locate* the keys; the producer pins the
slots that hold them under a lease and answers where they are (a shared
segment, a NIXL agent, a Transfer Engine port). The consumer moves the bytes
itself, straight from the pool into its own blocks, then ends the lease. Only
the reply's transport-specific fields and the move differ per backend; the
pinning, the checks on the reply and the lease rules are here, once.
"""

from __future__ import annotations

import contextlib
import time
from abc import abstractmethod
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from kvmux.addressing import BlockAddressing, Runs
from kvmux.errors import TransferError
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.net.client import Link
from kvmux.net.messages import LocateRequest, Message, PinReply, Unpin, expect, pack_rows
from kvmux.net.server import Handler, Session
from kvmux.pool.config import PinnedPoolConfig
from kvmux.pool.transport import PullTransport, Refusal

Rows = npt.NDArray[np.int64]
"""Block ids or pool rows of one move, in step with each other."""


class PinnedTransport(PullTransport):
    """A transport whose consumer moves the bytes itself; subclasses say where the
    pool is (``locate_reply``) and how bytes move (``move``)."""

    config: PinnedPoolConfig
    reply_type: ClassVar[type[PinReply]]
    """The backend's locate reply message."""

    # ------------------------------------------------------------------ producer

    def handlers(self, refused: Refusal) -> dict[type[Message], Handler]:
        def serve_locate(session: Session, req: LocateRequest) -> None:
            if not refused(session):
                self._serve_locate(session, req)

        return {LocateRequest: serve_locate, Unpin: self.serve_unpin}

    def _serve_locate(self, session: Session, req: LocateRequest) -> None:
        runs = req.digest_runs()
        store = self.store
        with store.lock:
            rows = store.find_rows(store.slots.stored_keys(runs))
            found = rows[rows >= 0]
            lease = self.pin(found, session) if found.size else 0
            slots = store.slots.slots
            serving = store.is_open
        block_nbytes = self.copier.block_nbytes if serving else 0
        session.send(self.locate_reply(lease, slots, block_nbytes, pack_rows(rows)))

    def pin(self, rows: Rows, session: Session) -> int:
        """Pin ``rows`` for ``session``; the lease id the consumer ends. Caller holds
        the store's lock."""
        lease = self.store.slots.lease(rows, time.monotonic() + self.config.lease_s)
        session.leases.add(lease)
        return lease

    @abstractmethod
    def locate_reply(self, lease: int, slots: int, block_nbytes: int, rows: bytes) -> PinReply:
        """The reply: the common fields (``rows`` packed by ``pack_rows``) plus where
        this transport finds the pool."""

    def serve_unpin(self, session: Session, msg: Unpin) -> None:
        if msg.lease in session.leases:  # only the client that holds a lease may end it
            session.leases.discard(msg.lease)
            with self.store.lock:
                self.store.slots.end_lease(msg.lease)
            self.store.settle()

    def session_closed(self, session: Session) -> None:
        with self.store.lock:
            for lease in session.leases:
                self.store.slots.end_lease(lease)
        self.store.settle()

    def lent_pieces(self, addressing: BlockAddressing | None) -> list[int] | None:
        """For a locate reply: where the lent blocks' pieces start (``PinReply.pieces``),
        None when serving a pool."""
        if not self.store.lend:
            return None
        assert addressing is not None
        return addressing.piece_starts()

    # ------------------------------------------------------------------ consumer

    def pull(
        self, link: Link, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]:
        asked = time.monotonic()
        link.channel.send(LocateRequest.of(keys), deadline=deadline)
        reply = expect(link.channel.recv(deadline), self.reply_type)
        hit, rows = found_rows(reply, len(keys))
        if not rows.size:
            return [MISSING] * len(keys)
        blocks = np.asarray(block_ids, dtype=np.int64)[hit]
        try:
            self.check_block_size(reply)
            self.move(link, reply, blocks, rows, min(deadline, asked + reply.lease_s))
        finally:
            # One-way, no reply awaited. A courtesy: a producer that is gone (or drops
            # this connection) ends the lease itself; the bytes stand or fall with the
            # lease check below.
            with contextlib.suppress(TransferError):
                link.channel.send(Unpin(lease=reply.lease), deadline=deadline)
        if time.monotonic() - asked >= reply.lease_s:
            late = failed(
                f"the move outlasted the producer's {reply.lease_s} s lease; bytes unsure"
            )
            return outcomes_of(hit, late)
        return outcomes_of(hit, OK)

    def check_block_size(self, reply: PinReply) -> None:
        """TransferError unless the peer's blocks are the size of ours."""
        if reply.block_nbytes != self.copier.block_nbytes:
            raise TransferError(
                f"peer's blocks are {reply.block_nbytes} bytes, ours {self.copier.block_nbytes}"
            )

    @abstractmethod
    def move(self, link: Link, reply: PinReply, blocks: Rows, rows: Rows, until: float) -> None:
        """Bring pool rows ``rows`` of the peer into local ``blocks`` by ``until``, or raise."""


def remote_runs(
    addressing: BlockAddressing, reply: PinReply, base: int, blocks: Rows, rows: Rows
) -> Runs:
    """The coalesced ranges of one move of the peer's ``rows`` into local ``blocks``:
    from its pool at address ``base``, or from the blocks it lends (``reply.pieces``)."""
    if reply.pieces is None:
        return addressing.runs(blocks, rows, base)
    try:
        return addressing.block_runs(blocks, rows, reply.pieces)
    except ValueError as exc:
        raise TransferError(str(exc)) from None


def found_rows(reply: PinReply, asked: int) -> tuple[npt.NDArray[np.bool_], Rows]:
    """Which of the ``asked`` keys the producer holds, and their pool rows (validated
    on receipt: each inside the pool); TransferError if the reply answers another
    number of keys."""
    all_rows = reply.row_array()
    if len(all_rows) != asked:
        raise TransferError(f"the producer answered for {len(all_rows)} keys, asked {asked}")
    hit = all_rows >= 0
    return hit, all_rows[hit].astype(np.int64)


def outcomes_of(hit: npt.NDArray[np.bool_], found: Outcome) -> list[Outcome]:
    """``found`` for each requested key the producer had, MISSING for the others."""
    if hit.all():
        return [found] * len(hit)
    return [found if h else MISSING for h in hit.tolist()]
