"""``shm``: the producer's pool lives in shared memory; a consumer on the same host
copies straight out of it.

The P/D default on one host. Bytes never cross a socket: the control channel
(TCP on loopback, the same framing as ``tcp``) asks the producer to *locate*
a batch of keys, which pins their slots under a lease and answers with the
segment name and rows; the consumer maps the segment once (cached per peer),
copies the rows into its blocks with one strided copy per run, and unpins.

Never wrong bytes: a slot is only overwritten once its pin is gone, and a
pin lasts until unpin or ``lease_s``. The consumer counts the lease from
*before* it sent the request, so if its copy finished inside that window the
slots were still pinned throughout; otherwise the keys fail. Only a peer on
this host is accepted: its ``host_id`` must be this one's (the kernel and the
``/dev/shm`` it mounts), else every key fails at once saying so; and the
mapped segment must carry the random token the producer announced.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch
from pydantic import Field

from kvmux.errors import TransferError
from kvmux.net.client import Link
from kvmux.net.messages import PinReply
from kvmux.net.segment import MappedSegment, OwnedSegment, host_id
from kvmux.net.shm_messages import LocateReply
from kvmux.pool.config import PinnedPoolConfig
from kvmux.pool.peer import PeerAddress
from kvmux.pool.pinned import PinnedTransport, Rows
from kvmux.pool.served import ServedPoolBackend
from kvmux.pool.store import PoolStore

_MAPPED_PEERS = 8
"""Producers whose segments stay mapped at once; a mapping pins the producer's memory."""


class ShmConfig(PinnedPoolConfig):
    backend: str = "shm"
    lease_s: float = Field(
        30.0, gt=0, description="longest a consumer's pin holds slots without being renewed"
    )


class ShmTransport(PinnedTransport):
    """Pool in a shared segment; a consumer on this host maps it and copies."""

    config: ShmConfig
    service = "shm"
    reply_type = LocateReply

    def __init__(self, config: ShmConfig, store: PoolStore) -> None:
        super().__init__(config, store)
        self._segment: OwnedSegment | None = None
        self._host_id = host_id()
        self._mapped: OrderedDict[tuple[str, int], MappedSegment] = OrderedDict()
        self._mapped_lock = threading.Lock()

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

    def locate_reply(self, lease: int, slots: int, block_nbytes: int, rows: bytes) -> PinReply:
        segment = self._segment
        return LocateReply(
            lease=lease,
            lease_s=self.config.lease_s,
            segment=segment.name if segment is not None else None,
            token=segment.token if segment is not None else None,
            offset=segment.offset if segment is not None else 0,
            slots=slots,
            block_nbytes=block_nbytes,
            rows=rows,
        )

    # ------------------------------------------------------------------ consumer

    def check_peer(self, peer: PeerAddress) -> None:
        if peer.host_id != self._host_id:
            raise TransferError(
                f"the shm peer at {peer.host}:{peer.port} runs on another host or sees "
                f"another /dev/shm (host id {peer.host_id}, here {self._host_id}); shm only "
                "works within one host: use tcp, or a multi with a tcp child to fall back"
            )

    def move(self, link: Link, reply: PinReply, blocks: Rows, rows: Rows, until: float) -> None:
        assert isinstance(reply, LocateReply)
        source = self._mapping(link, reply)
        self.copier.copy_in(blocks.tolist(), source.pool, rows.tolist())

    def _mapping(self, link: Link, reply: LocateReply) -> MappedSegment:
        """The peer's segment, mapped once and reused while the peer keeps it."""
        assert reply.segment is not None and reply.token is not None  # the model checks
        with self._mapped_lock:
            mapped = self._mapped.get(link.endpoint)
            if mapped is not None and mapped.name == reply.segment:
                self._mapped.move_to_end(link.endpoint)
                return mapped
        mapped = MappedSegment(
            reply.segment, reply.token, reply.offset, reply.slots, reply.block_nbytes
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
