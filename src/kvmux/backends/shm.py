"""``shm``: the producer's pool lives in shared memory; a consumer on the same host
copies straight out of it.

The P/D default on one host. Bytes never cross a socket: the control channel
(the same framing as ``tcp``, over the producer's abstract Unix socket, or TCP
where that does not answer: :mod:`kvmux.net.local`) asks the producer where a
batch of keys is; the consumer maps the segment once (cached per peer) and
copies the rows into its blocks with one strided copy per run.

Never wrong bytes, without a lease on the usual path. The producer answers a
*peek* with each found row's *version*, a counter in the segment that it bumps
before it overwrites the row (:class:`~kvmux.net.segment.OwnedSegment`). The
consumer copies, then reads the versions again: a row whose version moved was
being rewritten, and only those keys go again through a *locate*, which pins
their slots under a lease (``lease_s``, counted from before the request) and
is ended by an unpin. A one-block load thus costs one request and its reply,
not also an unpin message and the producer's bookkeeping of a lease. The
check relies on x86's store order (the producer's version store is seen
before its data stores; the consumer's loads are not reordered): elsewhere
every load locates and pins. The producer still answers every load, so a
stopped or dead one delivers nothing.

Only a peer on this host is accepted: its ``host_id`` must be this one's (the
kernel and the ``/dev/shm`` it mounts), else every key fails at once saying
so; and the mapped segment must carry the random token the producer announced.
"""

from __future__ import annotations

import platform
import threading
from collections import OrderedDict
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from kvmux.addressing import Ids
from kvmux.errors import TransferError
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.net.client import Link
from kvmux.net.messages import Message, PeekRequest, PinReply, expect, pack_rows
from kvmux.net.segment import MappedSegment, OwnedSegment, host_id
from kvmux.net.server import Handler, Session
from kvmux.net.shm_messages import LocateReply
from kvmux.pool.config import PinnedPoolConfig
from kvmux.pool.peer import PeerAddress
from kvmux.pool.pinned import PinnedTransport, Rows, found_rows, outcomes_of
from kvmux.pool.served import ServedPoolBackend
from kvmux.pool.store import PoolStore
from kvmux.pool.transport import Refusal

_MAPPED_PEERS = 8
"""Producers whose segments stay mapped at once; a mapping pins the producer's memory."""
UNPINNED_READS = platform.machine().lower() in {"x86_64", "amd64"}
"""Whether loads peek and check versions (see the module docstring) rather than
locate and pin: only where the processor keeps stores in order."""


class ShmConfig(PinnedPoolConfig):
    backend: str = "shm"
    lease_s: float = Field(
        30.0, gt=0, description="longest a consumer's pin holds slots without being renewed"
    )
    save_mode: Literal["copy"] = Field(
        "copy",
        description="copy only: a consumer maps the shared pool segment, and the engine's "
        "own KV memory is in no segment a peer can map",
    )


class ShmTransport(PinnedTransport):
    """Pool in a shared segment; a consumer on this host maps it and copies."""

    config: ShmConfig
    service = "shm"
    same_host = True
    reply_type = LocateReply

    def __init__(self, config: ShmConfig, store: PoolStore) -> None:
        super().__init__(config, store)
        self._segment: OwnedSegment | None = None
        self._host_id = host_id()
        self._mapped: OrderedDict[tuple[str, int], MappedSegment] = OrderedDict()
        self._mapped_lock = threading.Lock()
        self.before_overwrite = self._bump_versions

    def make_pool(self, slots: int, block_nbytes: int) -> torch.Tensor:
        self._segment = OwnedSegment(slots, block_nbytes)
        return self._segment.pool

    @property
    def segment_name(self) -> str | None:
        """The pool's segment (a file in ``/dev/shm``) once registered."""
        return self._segment.name if self._segment is not None else None

    def address(self) -> dict[str, Any]:
        return {"host_id": self._host_id}

    # ------------------------------------------------------------------ producer

    def _bump_versions(self, rows: Ids) -> None:
        assert self._segment is not None  # rows exist only once the pool is made
        self._segment.bump(rows)

    def handlers(self, refused: Refusal) -> dict[type[Message], Handler]:
        def serve_peek(session: Session, req: PeekRequest) -> None:
            if not refused(session):
                self._serve_peek(session, req)

        return {**super().handlers(refused), PeekRequest: serve_peek}

    def _serve_peek(self, session: Session, req: PeekRequest) -> None:
        runs = req.digest_runs()
        store = self.store
        with store.lock:  # rows and versions read together: no save is half done
            rows = store.find_rows(store.slots.stored_keys(runs))
            versions = np.zeros(len(rows), dtype="<u8")
            if self._segment is not None and store.pool is not None:
                hit = rows >= 0
                versions[hit] = self._segment.versions[rows[hit]]
            slots = store.slots.slots
        block_nbytes = self.copier.block_nbytes if store.pool is not None else 0
        session.send(self.locate_reply(0, slots, block_nbytes, pack_rows(rows), versions.tobytes()))

    def locate_reply(
        self, lease: int, slots: int, block_nbytes: int, rows: bytes, versions: bytes | None = None
    ) -> LocateReply:
        segment = self._segment
        return LocateReply(
            lease=lease,
            lease_s=self.config.lease_s,
            segment=segment.name if segment is not None else None,
            token=segment.token if segment is not None else None,
            offset=segment.offset if segment is not None else 0,
            versions_offset=segment.versions_offset if segment is not None else None,
            slots=slots,
            block_nbytes=block_nbytes,
            rows=rows,
            versions=versions,
        )

    # ------------------------------------------------------------------ consumer

    def check_peer(self, peer: PeerAddress) -> None:
        if peer.host_id != self._host_id:
            raise TransferError(
                f"the shm peer at {peer.host}:{peer.port} runs on another host or sees "
                f"another /dev/shm (host id {peer.host_id}, here {self._host_id}); shm only "
                "works within one host: use tcp, or a multi with a tcp child to fall back"
            )

    def pull(
        self, link: Link, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]:
        """Peek, copy, check the versions; locate and pin only the keys whose rows
        were rewritten meanwhile (see the module docstring)."""
        if not UNPINNED_READS:
            return super().pull(link, keys, block_ids, deadline)
        link.channel.send(PeekRequest.of(keys), deadline=deadline)
        reply = expect(link.channel.recv(deadline), LocateReply)
        hit, rows = found_rows(reply, len(keys))
        if reply.versions is None:
            raise TransferError("peek reply without the rows' versions")
        if not rows.size:
            return [MISSING] * len(keys)
        self.check_block_size(reply)
        source = self._mapping(link, reply)
        assert source.versions is not None  # the reply's versions_offset mapped them
        self.copier.copy_in(np.asarray(block_ids, dtype=np.int64)[hit], source.pool, rows)
        moved = source.versions[rows] != reply.version_array()[hit]
        outcomes = outcomes_of(hit, OK)
        if moved.any():
            self._again(link, keys, block_ids, np.flatnonzero(hit)[moved], outcomes, deadline)
        return outcomes

    def _again(
        self,
        link: Link,
        keys: list[BlockKey],
        block_ids: list[int],
        redo: Rows,
        outcomes: list[Outcome],
        deadline: float,
    ) -> None:
        """Locate and pin the keys at ``redo``, whose rows were rewritten while they
        were copied, and copy them again. One whose key is gone by now is failed,
        not missing: its blocks hold some of what was copied."""
        picked = redo.tolist()
        again = super().pull(
            link, [keys[i] for i in picked], [block_ids[i] for i in picked], deadline
        )
        gone = failed("overwritten by the producer while copied, then gone")
        for i, outcome in zip(picked, again, strict=True):
            outcomes[i] = gone if outcome is MISSING else outcome

    def move(self, link: Link, reply: PinReply, blocks: Rows, rows: Rows, until: float) -> None:
        assert isinstance(reply, LocateReply)
        source = self._mapping(link, reply)
        self.copier.copy_in(blocks, source.pool, rows)

    def _mapping(self, link: Link, reply: LocateReply) -> MappedSegment:
        """The peer's segment, mapped once and reused while the peer keeps it."""
        assert reply.segment is not None and reply.token is not None  # the model checks
        with self._mapped_lock:
            mapped = self._mapped.get(link.endpoint)
            if mapped is not None and mapped.name == reply.segment:
                self._mapped.move_to_end(link.endpoint)
                return mapped
        mapped = MappedSegment(
            reply.segment,
            reply.token,
            reply.offset,
            reply.slots,
            reply.block_nbytes,
            reply.versions_offset,
        )
        with self._mapped_lock:
            self._mapped[link.endpoint] = mapped
            while len(self._mapped) > _MAPPED_PEERS:
                self._mapped.popitem(last=False)
        return mapped

    def forget_peer(self, endpoint: tuple[str, int]) -> None:
        with self._mapped_lock:
            self._mapped.pop(endpoint, None)

    def close(self) -> None:
        with self._mapped_lock:
            self._mapped.clear()
        if self._segment is not None:
            self._segment.close()


class ShmBackend(ServedPoolBackend):
    """The served pool in shared memory, for consumers on this host."""

    config_model = ShmConfig
    config: ShmConfig
    transport_type = ShmTransport
