"""``cpu``: a bounded pool of host memory, the offload tier.

The pool itself (:class:`~kvmux.pool.store.PoolStore`) is a preallocated
``[slots, block_nbytes]`` tensor, so capacity is a hard bound by construction
and saving a block is one copy into a free slot; least recently used blocks
are evicted to make room. ``tcp``, ``shm``, ``nixl`` and ``mooncake`` serve
the same store to peers (:mod:`kvmux.pool`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from kvmux.backend import Address, Backend
from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.handle import Outcome
from kvmux.keys import BlockKey
from kvmux.pool.store import PoolStore


class CpuPoolConfig(BackendConfig):
    backend: str = "cpu"
    capacity_bytes: int = Field(
        256 * 2**20, gt=0, description="hard bound on the pool's memory, in bytes"
    )


class CpuPoolBackend(Backend):
    """Host-memory offload pool. Saves and loads complete in the caller's thread
    (``inline``): they are memory copies, cheaper than handing them to a worker."""

    config_model = CpuPoolConfig
    capabilities = Capabilities(capacity_bound=True)
    inline = True
    config: CpuPoolConfig

    def __init__(self, config: CpuPoolConfig) -> None:
        super().__init__(config)
        self.store = PoolStore(config.capacity_bytes)

    def register(self, blocks: BlockCopier) -> None:
        self.store.open(blocks)

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        return self.store.lookup(keys)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> Sequence[Outcome]:
        return self.store.save(keys, block_ids)

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> Sequence[Outcome]:
        return self.store.load(keys, block_ids)

    def release(self, keys: list[BlockKey]) -> None:
        self.store.release(keys)

    def publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        self.store.publish(keys, lease, lease_s)

    def renew(self, leases: list[str], source: Address | None) -> None:
        if source is None:
            self.store.renew(leases)

    def unpublish(self, leases: list[str], source: Address | None) -> None:
        if source is None:
            self.store.unpublish(leases)

    def stats(self) -> dict[str, float]:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()
