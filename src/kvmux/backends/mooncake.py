"""``mooncake``: the producer's pool is registered with a Mooncake Transfer Engine; a
consumer READs it straight into its own KV memory.

The served pool of ``tcp``/``shm``/``nixl`` (:mod:`kvmux.pool`) with
Mooncake's Transfer Engine (TE) as the data path. ``save`` copies blocks into
the pool (so the engine may reuse its blocks once the handle ends); the pool is
one tensor registered with this instance's engine. A consumer registers its KV
tensors with its own engine, asks the producer over kvmux's validated TCP
control channel to *locate* a batch of keys (which pins their slots under a
lease and answers with the pool's address and the engine's RPC port), then
issues **one** batch READ covering every block and layer, merged into
contiguous runs, straight into its KV memory, and sends ``unpin``. A consumer
that vanishes ends its pins with its connection, a stuck one with ``lease_s``.

Why a control channel at all, when TE has its own handshake: TE moves bytes
between addresses but knows nothing of keys, slots or their reuse. Pinning is
what guarantees that a slot is not overwritten while it is read, and the
layout check at kvmux's handshake is what refuses a peer whose blocks have
another shape (TE would copy them without complaint).

Never wrong bytes and never a hang: the consumer waits at most ``timeout_s``
(and never past the lease, counted from before it asked), then fails the keys;
see :mod:`kvmux.net.mooncake_engine` for why and for the one caveat (a frozen
peer's late writes). TE listens on ``0.0.0.0`` whatever ``te_host`` says.

A producer restarted on its control port is told apart by its incarnation
(:mod:`kvmux.pool.peer`), before TE is asked for anything. TE itself
keeps the dead engine's segment descriptor (its Python API has no call to
drop one); the new engine listens on a new random RPC port, a segment name of
its own, and every read's addresses come from the new producer's reply.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
from pydantic import Field

from kvmux.addressing import BlockAddressing
from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.errors import LayoutError
from kvmux.net.advertise import advertised_host
from kvmux.net.client import Link
from kvmux.net.messages import PinReply
from kvmux.net.mooncake_engine import MooncakeEngine
from kvmux.net.mooncake_messages import MooncakeLocateReply
from kvmux.pool.config import PinnedPoolConfig
from kvmux.pool.pinned import PinnedTransport, Rows, remote_runs
from kvmux.pool.served import ServedPoolBackend
from kvmux.pool.store import PoolStore


class MooncakeConfig(PinnedPoolConfig):
    backend: str = "mooncake"
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="TE transport: tcp anywhere, rdma where an RDMA device exists"
    )
    device_name: str = Field(
        "", description="RDMA devices for TE (e.g. 'mlx5_0'); empty: auto / none for tcp"
    )
    te_host: str | None = Field(
        None,
        description="hostname TE advertises to peers (its segment name); default: the "
        "control server's advertised address. TE listens on 0.0.0.0 anyway",
    )
    max_queued_per_peer: int = Field(
        8192,
        ge=1,
        description="MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, set before TE starts: TE's "
        "default makes batches of thousands of small blocks fail (process-wide); a READ "
        "of more ranges is split into TE calls of this many",
    )
    lease_s: float = Field(
        30.0, gt=0, description="longest a consumer's pin holds slots without being ended"
    )


class MooncakeTransport(PinnedTransport):
    """Pool registered with TE; the consumer READs it in one batch."""

    config: MooncakeConfig
    service = "mooncake"
    reply_type = MooncakeLocateReply

    def __init__(self, config: MooncakeConfig, store: PoolStore) -> None:
        super().__init__(config, store)
        self._pool_base = 0
        self._addressing: BlockAddressing | None = None
        te_host = config.te_host or advertised_host(config.host, config.advertise)
        self.engine = MooncakeEngine(
            te_host, config.protocol, config.device_name, config.max_queued_per_peer
        )

    # ------------------------------------------------------------------ memory

    def register(self, blocks: BlockCopier) -> None:
        layout, caches = blocks.layout, blocks.caches
        addressing = BlockAddressing.of(layout, caches)
        if addressing is None:
            raise LayoutError("mooncake needs contiguous KV tensors (it reads into them directly)")
        super().register(blocks)
        self.engine.register([caches[spec.name] for spec in layout.layers])
        self._addressing = addressing

    def make_pool(self, slots: int, block_nbytes: int) -> torch.Tensor:
        pool = torch.zeros((slots, block_nbytes), dtype=torch.uint8)
        self.engine.register([pool])
        self._pool_base = pool.data_ptr()
        return pool

    # ---------------------------------------------------------------- producer

    def locate_reply(self, lease: int, slots: int, block_nbytes: int, rows: bytes) -> PinReply:
        return MooncakeLocateReply(
            lease=lease,
            lease_s=self.config.lease_s,
            te_port=self.engine.port,
            base=self._pool_base,
            slots=slots,
            block_nbytes=block_nbytes,
            rows=rows,
            pieces=self.lent_pieces(self._addressing),
        )

    # ---------------------------------------------------------------- consumer

    def move(self, link: Link, reply: PinReply, blocks: Rows, rows: Rows, until: float) -> None:
        assert isinstance(reply, MooncakeLocateReply)
        assert self._addressing is not None
        # Coalesced ranges (:func:`remote_runs`): fewer TE requests.
        runs = remote_runs(self._addressing, reply, reply.base, blocks, rows)
        self.engine.read(
            f"{link.endpoint[0]}:{reply.te_port}",
            runs.local.tolist(),
            runs.remote.tolist(),
            runs.nbytes.tolist(),
            timeout_s=until - time.monotonic(),
            keep=self.copier.caches,
        )

    # ------------------------------------------------------------------ public

    def stats(self) -> dict[str, float]:
        with self.store.lock:
            return {"mooncake_pinned_slots": self.store.slots.pinned}

    def address(self) -> dict[str, Any]:
        return {"te_port": self.engine.port}

    def close(self) -> None:
        self.engine.close()


class MooncakeBackend(ServedPoolBackend):
    """The served pool registered with a Transfer Engine, read with batch READs."""

    config_model = MooncakeConfig
    config: MooncakeConfig
    transport_type = MooncakeTransport
    capabilities = Capabilities(p2p=True, zero_copy=True, capacity_bound=True)
