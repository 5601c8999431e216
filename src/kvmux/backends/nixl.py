"""``nixl``: the producer's pool is registered with NIXL; a consumer READs it straight
into its own KV memory.

The served pool of ``tcp``/``shm`` (:mod:`kvmux.pool`) with NIXL as the data
path. ``save`` copies blocks into the pool (so the engine may reuse its
blocks once the handle ends); the pool is one tensor registered with this
instance's NIXL agent. With ``save_mode: borrow`` there is no pool: consumers
READ the producer's registered KV tensors themselves, as vLLM's NixlConnector
does, and a save's handle ends once its blocks are given back.

A consumer registers its KV tensors with its own agent (DRAM, or VRAM for CUDA
tensors), asks the producer over kvmux's validated TCP control channel to
*locate* a batch of keys (which pins their slots under a lease and answers
with the pool's address, the rows and the agent's metadata), then issues
**one** NIXL READ covering every block and layer straight into its KV memory:
zero copies of its own. Once the READ is done (or has failed) the consumer
ends the lease with a one-way ``unpin`` message on the same connection; a
vanished consumer ends it with its connection, a stuck one with ``lease_s``.

The READ carries no NIXL notification. A READ with one is not done until the
*producer's* agent has been progressed to take the notification in (UCX
completes the request only once the active message is delivered), so every
load waited for the producer's pump, ~1 ms a batch; a READ without one is done
as soon as the bytes are in (UCX's ``cma`` reads the producer's memory with no
help from it), which is what raw NIXL measures. The ``unpin`` costs one send
and no round trip.

Never wrong bytes and never a hang: the consumer waits at most ``timeout_s``
(and never past the lease, counted from before it asked), then cancels the
READ and fails the keys; a layout mismatch is refused at the handshake, as for
``tcp``. Progress is made on demand (:mod:`kvmux.net.nixl_agent`), so an idle
instance burns no core.
"""

from __future__ import annotations

import base64
import binascii
import math
import threading
import time
from typing import Any

import numpy as np
import torch
from pydantic import Field

from kvmux.addressing import BlockAddressing
from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.errors import LayoutError, TransferError
from kvmux.net.client import Link
from kvmux.net.messages import PinReply, Unpin
from kvmux.net.nixl_agent import Descs, NixlAgent, mem_type
from kvmux.net.nixl_messages import NixlLocateReply
from kvmux.net.server import Session
from kvmux.pool.config import PinnedPoolConfig
from kvmux.pool.pinned import PinnedTransport, Rows, remote_runs
from kvmux.pool.served import ServedPoolBackend
from kvmux.pool.store import PoolStore


class NixlConfig(PinnedPoolConfig):
    backend: str = "nixl"
    backends: list[str] = Field(
        default_factory=lambda: ["UCX"], min_length=1, description="NIXL plugins to create"
    )
    ucx_options: dict[str, str] = Field(
        default_factory=dict,
        description="init parameters of the UCX backend (e.g. ucx_error_handling_mode); "
        "UCX_* environment variables (UCX_TLS...) apply too",
    )
    lease_s: float = Field(
        30.0, gt=0, description="longest a consumer's pin holds slots without being ended"
    )
    pump_interval_s: float = Field(
        0.001,
        gt=0,
        le=0.1,
        description="how often the agent is progressed while peers hold pins "
        "(NIXL's own progress thread spins a core; it stays off)",
    )


class NixlTransport(PinnedTransport):
    """Pool registered with NIXL; the consumer READs it into its own KV memory."""

    config: NixlConfig
    service = "nixl"
    reply_type = NixlLocateReply

    def __init__(self, config: NixlConfig, store: PoolStore) -> None:
        super().__init__(config, store)
        self._pool_base = 0
        self._addressing: BlockAddressing | None = None
        self._local_mem = "DRAM"
        self._leases: dict[int, tuple[float, Session]] = {}
        """slot lease -> (expiry, session): the pins peers hold, each ended by its
        own session's ``unpin`` (or connection), or at its expiry."""
        self._peers: dict[tuple[str, int], str] = {}
        self._peers_lock = threading.Lock()
        self._metadata = ""
        """The agent's metadata, base64; taken once all memory is registered (NIXL
        puts the registrations in it)."""
        self.agent = NixlAgent(
            config.backends,
            {"UCX": config.ucx_options},
            pump_interval_s=config.pump_interval_s,
            on_tick=self._reap_leases,
        )

    # ------------------------------------------------------------------ memory

    def register(self, blocks: BlockCopier) -> None:
        layout, caches = blocks.layout, blocks.caches
        addressing = BlockAddressing.of(layout, caches)
        if addressing is None:
            raise LayoutError("nixl needs contiguous KV tensors (it reads into them directly)")
        super().register(blocks)
        tensors = [caches[spec.name] for spec in layout.layers]
        self.agent.register(tensors)
        self._local_mem = mem_type(tensors[0].device)
        self._addressing = addressing
        if self.store.lend:  # no pool to register: peers read these tensors
            self._take_metadata()

    def make_pool(self, slots: int, block_nbytes: int) -> torch.Tensor:
        pool = torch.zeros((slots, block_nbytes), dtype=torch.uint8)
        self.agent.register([pool])
        self._pool_base = pool.data_ptr()
        self._take_metadata()  # the KV tensors are registered already (``register`` first)
        return pool

    def _take_metadata(self) -> None:
        """Once all memory peers read is registered (NIXL puts the registrations in it)."""
        self._metadata = base64.b64encode(self.agent.metadata()).decode("ascii")

    def _descs(self, reply: NixlLocateReply, blocks: Rows, rows: Rows) -> tuple[Descs, Descs]:
        """Local and remote descriptor lists of one READ: every piece of every block,
        coalesced (:func:`remote_runs`)."""
        assert self._addressing is not None
        runs = remote_runs(self._addressing, reply, reply.base, blocks, rows)
        local = np.empty((len(runs), 3), dtype=np.uint64)  # (address, length, device)
        local[:, 0], local[:, 1], local[:, 2] = runs.local, runs.nbytes, runs.device
        remote = np.zeros_like(local)
        remote[:, 0], remote[:, 1] = runs.remote, runs.nbytes
        return local, remote

    # ---------------------------------------------------------------- producer

    def pin(self, rows: Rows, session: Session) -> int:
        """The base pin, expired by this transport's pump and keeping it progressing
        while held: a new peer's first READ waits for this agent's answer (UCX's
        wire-up), and over UCX's ``tcp`` (no one-sided reads) every READ does.

        The store's lease never expires by itself: the store's reaper would end it
        behind this transport's back, and only ``_end_lease`` also ends the agent's
        hold and forgets the session's pin."""
        expires = time.monotonic() + self.config.lease_s
        lease = self.store.slots.lease(rows, math.inf)
        self._leases[lease] = (expires, session)
        session.leases.add(lease)
        self.agent.hold()
        return lease

    def locate_reply(self, lease: int, slots: int, block_nbytes: int, rows: bytes) -> PinReply:
        return NixlLocateReply(
            lease=lease,
            lease_s=self.config.lease_s,
            agent=self.agent.name,
            metadata=self._metadata or None,
            base=self._pool_base,
            slots=slots,
            block_nbytes=block_nbytes,
            rows=rows,
            pieces=self.lent_pieces(self._addressing),
        )

    def _end_lease(self, lease: int, session: Session | None = None) -> None:
        """Unpin ``lease``'s slots (only for ``session`` if given). Caller holds the lock."""
        entry = self._leases.get(lease)
        if entry is None or (session is not None and entry[1] is not session):
            return
        del self._leases[lease]
        entry[1].leases.discard(lease)
        self.store.slots.end_lease(lease)
        self.agent.unhold()

    def serve_unpin(self, session: Session, msg: Unpin) -> None:
        with self.store.lock:
            self._end_lease(msg.lease, session)
        self.store.settle()

    def _reap_leases(self) -> None:
        now = time.monotonic()
        with self.store.lock:
            expired = [i for i, (expires, _) in self._leases.items() if expires <= now]
            for lease in expired:
                self._end_lease(lease)
        if expired:
            self.store.settle()

    def session_closed(self, session: Session) -> None:
        with self.store.lock:
            for lease in list(session.leases):
                self._end_lease(lease, session)
        self.store.settle()

    # ---------------------------------------------------------------- consumer

    def move(self, link: Link, reply: PinReply, blocks: Rows, rows: Rows, until: float) -> None:
        assert isinstance(reply, NixlLocateReply)
        remote = self._remote_agent(link.endpoint, reply)
        local, remote_descs = self._descs(reply, blocks, rows)
        self.agent.read(
            remote,
            local,
            self._local_mem,
            remote_descs,
            deadline=until,
        )

    def _remote_agent(self, endpoint: tuple[str, int], reply: NixlLocateReply) -> str:
        """The producer's agent, added once per endpoint (again if it restarted). Under
        the lock throughout, so concurrent first loads from a peer add it once."""
        with self._peers_lock:
            known = self._peers.get(endpoint)
            if known == reply.agent:
                return known
            if reply.agent in self._peers.values():  # the same peer by another address
                self._peers[endpoint] = reply.agent
                return reply.agent
            if reply.metadata is None:
                raise TransferError(f"peer agent {reply.agent} sent no metadata")
            try:
                metadata = base64.b64decode(reply.metadata, validate=True)
            except binascii.Error as exc:
                raise TransferError(f"peer agent metadata is not base64: {exc}") from None
            if known is not None:
                del self._peers[endpoint]
                if known not in self._peers.values():
                    self.agent.remove_remote(known)
            try:
                name = self.agent.add_remote(metadata)
            except Exception as exc:  # NIXL raises its own types for bad metadata
                raise TransferError(f"NIXL refused peer agent {reply.agent}: {exc}") from None
            if name != reply.agent:
                self.agent.remove_remote(name)
                raise TransferError(f"peer metadata names agent {name}, reply {reply.agent}")
            self._peers[endpoint] = name
            return name

    def forget_peer(self, endpoint: tuple[str, int]) -> None:
        with self._peers_lock:
            name = self._peers.pop(endpoint, None)
            if name is not None and name not in self._peers.values():
                self.agent.remove_remote(name)

    # ------------------------------------------------------------------ public

    def stats(self) -> dict[str, float]:
        with self.store.lock:
            return {"nixl_leases": len(self._leases)}

    def address(self) -> dict[str, Any]:
        return {"agent": self.agent.name}

    def close(self) -> None:
        with self._peers_lock:
            self._peers.clear()
        self.agent.close()


class NixlBackend(ServedPoolBackend):
    """The served pool registered with NIXL, read with zero-copy READs."""

    config_model = NixlConfig
    config: NixlConfig
    transport_type = NixlTransport
    capabilities = Capabilities(
        p2p=True, zero_copy=True, capacity_bound=True, memory_kinds=frozenset({"cpu", "cuda"})
    )
