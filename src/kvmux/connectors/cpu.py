"""``cpu``: a bounded pool of host memory, the offload tier.

The pool is one preallocated ``[slots, block_nbytes]`` tensor, so capacity is
a hard bound by construction (never exceeded, not even transiently) and
saving a block is one copy into a free slot. Least recently used blocks are
evicted to make room.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

import torch
from pydantic import Field

from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.connector import Address, Connector
from kvmux.errors import CapacityError
from kvmux.handle import MISSING, OK, Handle, Outcome
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout


class CpuPoolConfig(BackendConfig):
    backend: str = "cpu"
    capacity_bytes: int = Field(
        256 * 2**20, gt=0, description="hard bound on the pool's memory, in bytes"
    )


class SlotPool:
    """Key → slot index with LRU order over a fixed number of slots.

    Not thread-safe: its owner holds a lock around each batch.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._where: OrderedDict[BlockKey, int] = OrderedDict()
        self._free: list[int] = []  # released slots
        self._unused = 0  # slots >= this were never handed out: O(1) set-up at any size
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._where

    def get(self, key: BlockKey) -> int | None:
        """The key's slot, marking it most recently used; None if absent."""
        slot = self._where.get(key)
        if slot is not None:
            self._where.move_to_end(key)
        return slot

    def allocate(self, key: BlockKey, protected: set[int]) -> int | None:
        """A slot for a new ``key``, evicting the least recently used block not in
        ``protected`` if none is free; None if every slot is protected."""
        if self._free:
            slot = self._free.pop()
        elif self._unused < self.slots:
            slot = self._unused
            self._unused += 1
        else:
            victim = next((k for k, s in self._where.items() if s not in protected), None)
            if victim is None:
                return None
            slot = self._where.pop(victim)
            self.evictions += 1
        self._where[key] = slot
        return slot

    def remove(self, key: BlockKey) -> None:
        slot = self._where.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def keys(self) -> list[BlockKey]:
        return list(self._where)


class CpuPoolConnector(Connector):
    """Host-memory offload pool. Saves and loads complete in the caller's thread:
    they are single memcpys, cheaper than handing them to a worker."""

    config_model = CpuPoolConfig
    capabilities = Capabilities(capacity_bound=True)
    config: CpuPoolConfig

    def __init__(self, config: CpuPoolConfig) -> None:
        super().__init__(config)
        self._lock = threading.Lock()
        self._pool: torch.Tensor | None = None
        self._slots = SlotPool(0)

    def _register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        slots = self.config.capacity_bytes // layout.block_nbytes
        if slots == 0:
            raise CapacityError(
                f"capacity_bytes={self.config.capacity_bytes} holds no block of "
                f"{layout.block_nbytes} bytes"
            )
        with self._lock:
            # Pages are committed on first write, so an idle pool costs no memory
            # and creating one costs no time; the bound holds either way.
            self._pool = torch.empty((slots, layout.block_nbytes), dtype=torch.uint8)
            self._slots = SlotPool(slots)

    def _lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._slots:
                    return i
        return len(keys)

    def _save(self, keys: list[BlockKey], block_ids: list[int]) -> Handle:
        return self._run_now(keys, lambda: self._save_batch(keys, block_ids))

    def _save_batch(self, keys: list[BlockKey], block_ids: list[int]) -> tuple[list[Outcome], int]:
        pool = self._pool
        assert pool is not None
        outcomes: list[Outcome] = [OK] * len(keys)
        todo_blocks: list[int] = []
        todo_rows: list[int] = []
        with self._lock:
            # Blocks saved by this batch are protected so a batch larger than
            # the pool evicts its own oldest blocks last, never mid-copy.
            written: set[int] = set()
            for key, block in zip(keys, block_ids, strict=True):
                if self._slots.get(key) is not None:
                    continue  # same key, same content: already stored
                slot = self._slots.allocate(key, written)
                if slot is None:  # the batch alone is bigger than the pool
                    self._copy(todo_blocks, todo_rows)
                    todo_blocks, todo_rows, written = [], [], set()
                    slot = self._slots.allocate(key, written)
                    assert slot is not None
                written.add(slot)
                todo_blocks.append(block)
                todo_rows.append(slot)
            self._copy(todo_blocks, todo_rows)
        return outcomes, len(keys) * self.copier.block_nbytes

    def _copy(self, blocks: list[int], rows: list[int]) -> None:
        assert self._pool is not None
        self.copier.copy_out(blocks, self._pool, rows)

    def _load(self, keys: list[BlockKey], block_ids: list[int], source: Address | None) -> Handle:
        def work() -> tuple[list[Outcome], int]:
            assert self._pool is not None
            outcomes: list[Outcome] = []
            blocks: list[int] = []
            rows: list[int] = []
            with self._lock:
                for key, block in zip(keys, block_ids, strict=True):
                    slot = self._slots.get(key)
                    if slot is None:
                        outcomes.append(MISSING)
                        continue
                    outcomes.append(OK)
                    blocks.append(block)
                    rows.append(slot)
                self.copier.copy_in(blocks, self._pool, rows)
            return outcomes, len(blocks) * self.copier.block_nbytes

        return self._run_now(keys, work)

    def _release(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._slots.remove(key)

    def stats(self) -> dict[str, float]:
        out = super().stats()
        with self._lock:
            out.update(
                blocks_stored=len(self._slots),
                capacity_blocks=self._slots.slots,
                evictions=self._slots.evictions,
            )
        return out

    def _close(self) -> None:
        with self._lock:
            self._pool = None
            self._slots = SlotPool(0)
