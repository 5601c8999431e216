"""``cpu``: a bounded pool of host memory, the offload tier.

The pool is one preallocated ``[slots, block_nbytes]`` tensor, so capacity is
a hard bound by construction (never exceeded, not even transiently) and
saving a block is one copy into a free slot. Least recently used blocks are
evicted to make room. ``tcp`` and ``shm`` are this pool plus a server that
lets peers pull from it (:mod:`kvmux.net.served_pool`).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
from pydantic import Field

from kvmux.backend import Address, Backend
from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import CapacityError
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.publications import Publications
from kvmux.slots import PinnedSlots


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
        self._lock = threading.Lock()
        self._pool: torch.Tensor | None = None
        self._slots = PinnedSlots(0)
        self._publications = Publications()

    def _make_pool(self, slots: int, block_nbytes: int) -> torch.Tensor:
        """The ``[slots, block_nbytes]`` uint8 pool. Pages are committed on first
        write, so an idle pool costs no memory and creating one costs no time."""
        return torch.empty((slots, block_nbytes), dtype=torch.uint8)

    def register(self, blocks: BlockCopier) -> None:
        layout = blocks.layout
        slots = self.config.capacity_bytes // layout.block_nbytes
        if slots == 0:
            raise CapacityError(
                f"capacity_bytes={self.config.capacity_bytes} holds no block of "
                f"{layout.block_nbytes} bytes"
            )
        pool = self._make_pool(slots, layout.block_nbytes)
        with self._lock:
            self._pool = pool
            self._slots = PinnedSlots(slots)
            self._publications.clear()

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        with self._lock:
            return self._slots.prefix(keys)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        pool = self._pool
        assert pool is not None
        outcomes: list[Outcome] = [OK] * len(keys)
        with self._lock:
            now = time.monotonic()
            self._slots.reap(now)
            self._publications.reap(self._slots, now)
            # Keys stored already need no copy (same key, same content). They are
            # touched first, so no new key of the batch evicts them.
            new = np.flatnonzero(self._slots.keep_many(keys) < 0)
            if 0 < len(new) < len(keys):
                picked = new.tolist()
                new_keys = list(map(keys.__getitem__, picked))
                blocks = list(map(block_ids.__getitem__, picked))
                saved = self._place_and_copy(pool, new_keys, blocks)
                self._slots.touch(keys)  # LRU order = batch order again
            else:
                saved = self._place_and_copy(pool, keys, block_ids) if len(new) else 0
        unplaced = new[saved:].tolist()
        if unplaced:
            error = failed("every pool slot is pinned (peers reading, or published blocks)")
            for i in unplaced:
                outcomes[i] = error
        return outcomes

    def _place_and_copy(
        self, pool: torch.Tensor, keys: list[BlockKey], block_ids: list[int]
    ) -> int:
        """Give the new ``keys`` slots and copy their blocks in; how many leading keys
        got one (the rest found every slot pinned). Caller holds the lock.

        Pinned slots and the slots written by this batch are protected, so a batch
        larger than the pool evicts its own oldest blocks last, never mid-copy
        (the slots placed so far are copied before they become fair game), and
        never a slot a peer is reading."""
        done = 0
        while done < len(keys):
            rows = self._slots.allocate_many(keys[done:], self._slots.protected())
            if not rows:
                break
            self.copier.copy_out(block_ids[done : done + len(rows)], pool, rows)
            done += len(rows)
        return done

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> list[Outcome]:
        return self._load_local(keys, block_ids)

    def _load_local(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        pool = self._pool
        assert pool is not None
        with self._lock:
            rows = self._slots.find_many(keys)
            hit = rows >= 0
            blocks = np.asarray(block_ids, dtype=np.int64)[hit]
            self.copier.copy_in(blocks, pool, rows[hit])
        if len(blocks) == len(keys):
            return [OK] * len(keys)
        return [OK if h else MISSING for h in hit.tolist()]

    def release(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._slots.release(key)

    # ------------------------------------------------------------ publications

    def publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        with self._lock:
            now = time.monotonic()
            self._publications.reap(self._slots, now)
            rows = self._slots.find_many(keys)
            self._publications.publish(self._slots, lease, rows[rows >= 0], lease_s, now)

    def renew(self, leases: list[str], source: Address | None) -> None:
        if source is None:
            self._renew_here(leases)

    def unpublish(self, leases: list[str], source: Address | None) -> None:
        if source is None:
            self._release_here(leases)

    def _renew_here(self, leases: list[str]) -> int:
        """Extend these of this pool's leases; how many it held."""
        with self._lock:
            now = time.monotonic()
            self._publications.reap(self._slots, now)
            return self._publications.renew(leases, now)

    def _release_here(self, leases: list[str]) -> int:
        """End these of this pool's leases; how many it held."""
        with self._lock:
            return self._publications.release(self._slots, leases)

    # ------------------------------------------------------------------ public

    def stats(self) -> dict[str, float]:
        with self._lock:
            self._publications.reap(self._slots, time.monotonic())
            return {
                "blocks_stored": len(self._slots),
                "capacity_blocks": self._slots.slots,
                "evictions": self._slots.evictions,
                "pinned_blocks": self._slots.pinned,
                **self._publications.counts(),
            }

    def close(self) -> None:
        with self._lock:
            self._pool = None
            self._slots = PinnedSlots(0)
            self._publications.clear()
