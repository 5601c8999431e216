"""PoolStore: a bounded pool of host memory with the slots and publications over it.

The pool is one preallocated ``[slots, block_nbytes]`` tensor, so capacity is
a hard bound by construction (never exceeded, not even transiently) and
saving a block is one copy into a free slot. Least recently used blocks are
evicted to make room; pinned slots (a peer reading, a publication) never are.
``cpu`` is this store alone; the served backends serve it to peers
(:mod:`kvmux.pool`), whose server reads ``slots`` under ``lock``.

A *lending* store (``lend=True``, a served pool's ``save_mode: borrow``) has
no pool: its slots are the engine's blocks, a save only names them, and each
save's handle waits for its blocks to come back (:mod:`kvmux.pool.lending`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from kvmux.addressing import SMALL_BATCH, Ids, as_ids
from kvmux.blocks import BlockCopier
from kvmux.errors import CapacityError
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.pool.lending import Reaper, Returns, complete
from kvmux.publications import Publications
from kvmux.slots import LentSlots, PinnedSlots, SlotArray

MakePool = Callable[[int, int], torch.Tensor]
"""``(slots, block_nbytes)`` -> the ``[slots, block_nbytes]`` uint8 pool tensor."""
BeforeOverwrite = Callable[[Ids], None]
"""Told the pool rows a save is about to write, before any byte of them changes
(the ``shm`` transport bumps their versions)."""


def host_pool(slots: int, block_nbytes: int) -> torch.Tensor:
    """Plain host memory. Pages are committed on first write, so an idle pool costs
    no memory and creating one costs no time."""
    return torch.empty((slots, block_nbytes), dtype=torch.uint8)


class PoolStore:
    """Slots of one pool tensor, keyed by :class:`BlockKey`. Thread-safe; ``lock``
    guards ``pool``, ``slots`` and the publications for whoever reads them too."""

    def __init__(self, capacity_bytes: int, *, served: bool = False, lend: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self._served = served or lend
        """Whether peers' requests look keys up here: then the slots keep an index by
        digest (``PinnedSlots.stored_keys``)."""
        self.lend = lend
        """Saves lend the engine's blocks instead of copying them (no pool)."""
        self.lock = threading.Lock()
        self.pool: torch.Tensor | None = None
        """None until ``open`` and after ``close`` (and always when lending)."""
        self.is_open = False
        """Between ``open`` and ``close``: there is something to serve."""
        self.slots: PinnedSlots = PinnedSlots(0)
        self._publications = Publications()
        self._copier: BlockCopier | None = None
        self._before_overwrite: BeforeOverwrite | None = None
        self._returns = Returns()
        self._reaper: Reaper | None = None

    def open(
        self,
        blocks: BlockCopier,
        make_pool: MakePool = host_pool,
        before_overwrite: BeforeOverwrite | None = None,
    ) -> None:
        """Size the pool for ``blocks``' layout and make it with ``make_pool``;
        ``before_overwrite``, if given, hears of every row before a save writes it."""
        layout = blocks.layout
        if self.lend:
            with self.lock:
                self._copier = blocks
                self.slots = LentSlots(layout.num_blocks)
                self._publications.clear()
                self.is_open = True
            self._reaper = Reaper(self._reap_lent, "kvmux-lent-reaper")
            return
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
            self.is_open = True

    def lookup(self, keys: list[BlockKey]) -> int:
        with self.lock:
            return self.slots.prefix(keys)

    def find_rows(self, keys: list[BlockKey]) -> SlotArray:
        """The pool row of each key, -1 where missing (all missing with no pool):
        what a producer serves a peer's request from. Caller holds ``lock``."""
        if not self.is_open:
            return np.full(len(keys), -1, dtype=np.int64)
        if len(keys) < SMALL_BATCH:  # a one-block load: no numpy set-up per key
            return np.array(self.slots.find_few(keys), dtype=np.int64)
        return self.slots.find_many(keys)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        if self.lend:
            return self._lend(keys, block_ids)
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
            at = as_ids(rows)  # one array for the versions' bump and the copy
            try:
                if self._before_overwrite is not None:
                    self._before_overwrite(at)
                copier.copy_out(block_ids[done : done + len(rows)], pool, at)
            except BaseException:
                # The rows hold part of a copy at best: their keys must not be found.
                self.slots.release_many(keys[done : done + len(rows)])
                raise
            done += len(rows)
        return done

    def _lend(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        """Name the engine's blocks under the new ``keys``: no copy. A key stored
        already keeps the block it names (same key, same content)."""
        slots = self.slots
        assert isinstance(slots, LentSlots)
        outcomes: list[Outcome] = [OK] * len(keys)
        with self.lock:
            new = slots.new_keys(keys)
            if len(new) == len(keys):
                refused = slots.place(keys, block_ids)
            else:
                picked = [keys[i] for i in new], [block_ids[i] for i in new]
                refused = [new[i] for i in slots.place(*picked)]
            due = self._returns.collect(slots)
        complete(due)
        if refused:
            error = failed("the block is still being read by a peer under the key it held before")
            for i in refused:
                outcomes[i] = error
        return outcomes

    def returned(self, block_ids: list[int]) -> Future[None] | None:
        """Lending: a future done once each of ``block_ids`` still lent is back with
        the engine (None if none is); never lending: None."""
        if not self.lend:
            return None
        with self.lock:
            slots = self.slots
            if not isinstance(slots, LentSlots):  # closed: nothing is lent
                return None
            return self._returns.wait(slots, block_ids)

    def settle(self) -> None:
        """Complete the saves whose lent blocks are all back. Whoever changes
        ``slots`` under ``lock`` in a way that may end a pin or drop a key calls it
        after releasing the lock (a no-op unless lending)."""
        if not self.lend:
            return
        with self.lock:
            slots = self.slots
            due = self._returns.collect(slots) if isinstance(slots, LentSlots) else []
        complete(due)

    def _reap_lent(self) -> None:
        """End expired publications and pins of lent blocks (the reaper's tick)."""
        with self.lock:
            now = time.monotonic()
            self.slots.reap(now)
            self._publications.reap(self.slots, now)
        self.settle()

    def load(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        if self.lend:
            return self._load_lent(keys, block_ids)
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

    def _load_lent(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        """A local load from lent blocks: block to block, through one packed copy."""
        copier = self._copier
        assert copier is not None
        with self.lock:
            rows = self.find_rows(keys)
            hit = rows >= 0
            if hit.any():
                staged = copier.gather(rows[hit])
                copier.copy_in(np.asarray(block_ids, dtype=np.int64)[hit], staged)
        return [OK if h else MISSING for h in hit.tolist()]

    def release(self, keys: list[BlockKey]) -> None:
        with self.lock:
            self.slots.release_many(keys)
        self.settle()

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
            known = self._publications.release(self.slots, leases)
        self.settle()
        return known

    # ------------------------------------------------------------------ levels

    def stats(self) -> dict[str, float]:
        with self.lock:
            self._publications.reap(self.slots, time.monotonic())
            lent = {"lent_blocks": self._lent_blocks()} if self.lend else {}
            return {
                **lent,
                "blocks_stored": len(self.slots),
                "capacity_blocks": self.slots.slots,
                "evictions": self.slots.evictions,
                "pinned_blocks": self.slots.pinned,
                **self._publications.counts(),
            }

    def _lent_blocks(self) -> int:
        """Blocks lent now (named by a key or still read). Caller holds the lock."""
        slots = self.slots
        return slots.lent() if isinstance(slots, LentSlots) else 0

    def close(self) -> None:
        """Forget every block; lent ones go back to the engine (nothing serves them)."""
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
        with self.lock:
            self.pool = None
            self.is_open = False
            self.slots = PinnedSlots(0)
            self._publications.clear()
            due = self._returns.all()
        complete(due)
