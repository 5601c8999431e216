"""PoolStore: a bounded pool of host memory with the slots and publications over it.

The pool is one preallocated ``[slots, block_nbytes]`` tensor, so capacity is
a hard bound by construction (never exceeded, not even transiently) and
saving a block is one copy into a free slot. Least recently used blocks are
evicted to make room; pinned slots (a peer reading, a publication) never are.
``cpu`` is this store alone; the served backends serve it to peers
(:mod:`kvmux.pool`), whose server reads ``slots`` under ``lock``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from kvmux.addressing import SMALL_BATCH
from kvmux.blocks import BlockCopier
from kvmux.errors import CapacityError
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.publications import Publications
from kvmux.slots import PinnedSlots, SlotArray

MakePool = Callable[[int, int], torch.Tensor]
"""``(slots, block_nbytes)`` -> the ``[slots, block_nbytes]`` uint8 pool tensor."""
BeforeOverwrite = Callable[[list[int]], None]
"""Told the pool rows a save is about to write, before any byte of them changes
(the ``shm`` transport bumps their versions)."""


def host_pool(slots: int, block_nbytes: int) -> torch.Tensor:
    """Plain host memory. Pages are committed on first write, so an idle pool costs
    no memory and creating one costs no time."""
    return torch.empty((slots, block_nbytes), dtype=torch.uint8)


class PoolStore:
    """Slots of one pool tensor, keyed by :class:`BlockKey`. Thread-safe; ``lock``
    guards ``pool``, ``slots`` and the publications for whoever reads them too."""

    def __init__(self, capacity_bytes: int, *, served: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self._served = served
        """Whether peers' requests look keys up here: then the slots keep an index by
        digest (``PinnedSlots.stored_keys``)."""
        self.lock = threading.Lock()
        self.pool: torch.Tensor | None = None
        """None until ``open`` and after ``close``: nothing to serve then."""
        self.slots = PinnedSlots(0)
        self._publications = Publications()
        self._copier: BlockCopier | None = None
        self._before_overwrite: BeforeOverwrite | None = None

    def open(
        self,
        blocks: BlockCopier,
        make_pool: MakePool = host_pool,
        before_overwrite: BeforeOverwrite | None = None,
    ) -> None:
        """Size the pool for ``blocks``' layout and make it with ``make_pool``;
        ``before_overwrite``, if given, hears of every row before a save writes it."""
        layout = blocks.layout
        slots = self.capacity_bytes // layout.block_nbytes
        if slots == 0:
            raise CapacityError(
                f"capacity_bytes={self.capacity_bytes} holds no block of "
                f"{layout.block_nbytes} bytes"
            )
        pool = make_pool(slots, layout.block_nbytes)
        with self.lock:
            self._copier = blocks
            self._before_overwrite = before_overwrite
            self.pool = pool
            self.slots = PinnedSlots(slots, by_digest=self._served)
            self._publications.clear()

    def lookup(self, keys: list[BlockKey]) -> int:
        with self.lock:
            return self.slots.prefix(keys)

    def find_rows(self, keys: list[BlockKey]) -> SlotArray:
        """The pool row of each key, -1 where missing (all missing with no pool):
        what a producer serves a peer's request from. Caller holds ``lock``."""
        if self.pool is None:
            return np.full(len(keys), -1, dtype=np.int64)
        if len(keys) < SMALL_BATCH:  # a one-block load: no numpy set-up per key
            return np.array(self.slots.find_few(keys), dtype=np.int64)
        return self.slots.find_many(keys)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        pool, copier = self.pool, self._copier
        assert pool is not None and copier is not None
        outcomes: list[Outcome] = [OK] * len(keys)
        with self.lock:
            now = time.monotonic()
            self.slots.reap(now)
            self._publications.reap(self.slots, now)
            # Keys stored already need no copy (same key, same content). They are
            # touched first, so no new key of the batch evicts them.
            new = self.slots.new_keys(keys)
            if 0 < len(new) < len(keys):
                new_keys = list(map(keys.__getitem__, new))
                blocks = list(map(block_ids.__getitem__, new))
                saved = self._place_and_copy(copier, pool, new_keys, blocks)
                self.slots.touch(keys)  # LRU order = batch order again
            else:
                saved = self._place_and_copy(copier, pool, keys, block_ids) if new else 0
        if saved < len(new):
            error = failed("every pool slot is pinned (peers reading, or published blocks)")
            for i in new[saved:]:
                outcomes[i] = error
        return outcomes

    def _place_and_copy(
        self, copier: BlockCopier, pool: torch.Tensor, keys: list[BlockKey], block_ids: list[int]
    ) -> int:
        """Give the new ``keys`` slots and copy their blocks in; how many leading keys
        got one (the rest found every slot pinned). Caller holds the lock.

        Pinned slots and the slots written by this batch are protected, so a batch
        larger than the pool evicts its own oldest blocks last, never mid-copy
        (the slots placed so far are copied before they become fair game), and
        never a slot a peer is reading. A copy that raises takes its slots back
        from its keys before the error goes on."""
        done = 0
        while done < len(keys):
            rows = self.slots.allocate_many(keys[done:], self.slots.protected())
            if not rows:
                break
            try:
                if self._before_overwrite is not None:
                    self._before_overwrite(rows)
                copier.copy_out(block_ids[done : done + len(rows)], pool, rows)
            except BaseException:
                # The rows hold part of a copy at best: their keys must not be found.
                for key in keys[done : done + len(rows)]:
                    self.slots.release(key)
                raise
            done += len(rows)
        return done

    def load(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        pool, copier = self.pool, self._copier
        assert pool is not None and copier is not None
        with self.lock:
            if len(keys) < SMALL_BATCH:  # a few keys: no numpy for the usual all-hit load
                few = self.slots.find_few(keys)
                if -1 not in few:
                    copier.copy_in(block_ids, pool, few)
                    return [OK] * len(keys)
                rows = np.array(few, dtype=np.int64)
            else:
                rows = self.slots.find_many(keys)
            hit = rows >= 0
            if hit.all():  # the usual load: no picking
                copier.copy_in(block_ids, pool, rows)
                return [OK] * len(keys)
            blocks = np.asarray(block_ids, dtype=np.int64)[hit]
            copier.copy_in(blocks, pool, rows[hit])
        return [OK if h else MISSING for h in hit.tolist()]

    def release(self, keys: list[BlockKey]) -> None:
        with self.lock:
            for key in keys:
                self.slots.release(key)

    # ------------------------------------------------------------ publications

    def publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        with self.lock:
            now = time.monotonic()
            self._publications.reap(self.slots, now)
            rows = self.slots.find_many(keys)
            self._publications.publish(self.slots, lease, rows[rows >= 0], lease_s, now)

    def renew(self, leases: list[str]) -> int:
        """Extend these of this pool's leases; how many it held."""
        with self.lock:
            now = time.monotonic()
            self._publications.reap(self.slots, now)
            return self._publications.renew(leases, now)

    def unpublish(self, leases: list[str]) -> int:
        """End these of this pool's leases; how many it held."""
        with self.lock:
            return self._publications.release(self.slots, leases)

    # ------------------------------------------------------------------ levels

    def stats(self) -> dict[str, float]:
        with self.lock:
            self._publications.reap(self.slots, time.monotonic())
            return {
                "blocks_stored": len(self.slots),
                "capacity_blocks": self.slots.slots,
                "evictions": self.slots.evictions,
                "pinned_blocks": self.slots.pinned,
                **self._publications.counts(),
            }

    def close(self) -> None:
        with self.lock:
            self.pool = None
            self.slots = PinnedSlots(0)
            self._publications.clear()
