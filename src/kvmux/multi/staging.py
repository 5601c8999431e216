"""Staging: private KV memory through which a write-back tiered multi moves blocks.

A connector hands out a block's bytes only by writing them into registered
KV memory, so moving a block from one tier to another (demotion) needs
memory both tiers are registered with. The engine's blocks cannot serve:
a save must not write into them, and the multi knows of no free one. So a
write-back tiered multi registers its tiers with this staging area instead:
``slots`` blocks in the engine's layout (same layers, dtypes and device,
hence the same layout fingerprint: a ``disk`` tier finds its old blocks),
stored as one ``[slots, block_nbytes]`` byte tensor that the engine's
:class:`~kvmux.blocks.BlockCopier` fills and drains in one copy per transfer.
That copy is the price of write-back; write-through needs no staging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from kvmux.blocks import BlockCopier
from kvmux.errors import LayoutError, TransferTimeout
from kvmux.handle import Handle
from kvmux.layout import KVLayout, torch_dtype


class Staging:
    """``slots`` staging blocks with a free list. Thread-safe."""

    def __init__(self, layout: KVLayout, caches: Mapping[str, torch.Tensor], slots: int) -> None:
        self.engine = BlockCopier(layout, caches)
        shape = (slots, layout.block_nbytes)
        self.rows = torch.empty(shape, dtype=torch.uint8, device=layout.device)
        self.caches = _row_views(layout, self.rows)
        self.layout = KVLayout(
            layers=tuple(
                spec.model_copy(update={"shape": tuple(self.caches[spec.name].shape)})
                for spec in layout.layers
            ),
            block_size=layout.block_size,
            device=layout.device,
        )
        self._free = list(range(slots - 1, -1, -1))
        self._cond = threading.Condition()

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)

    @contextmanager
    def lease(self, n: int, deadline: float) -> Iterator[Lease]:
        """``n`` slots until the block exits (later, if a transfer into them overran)."""
        lease = Lease(self, self._acquire(n, deadline))
        try:
            yield lease
        finally:
            lease.close()

    def fill(self, slots: list[int], blocks: list[int]) -> None:
        """Copy engine blocks into staging slots (before a save)."""
        self.engine.copy_out(blocks, self.rows, slots)

    def drain(self, slots: list[int], blocks: list[int]) -> None:
        """Copy staging slots into engine blocks (after a load)."""
        self.engine.copy_in(blocks, self.rows, slots)

    def _acquire(self, n: int, deadline: float) -> list[int]:
        with self._cond:
            ready = self._cond.wait_for(
                lambda: len(self._free) >= n, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise TransferTimeout(
                    f"no {n} free staging blocks before the deadline "
                    f"(transfers that overran their timeout still hold some)"
                )
            return [self._free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()


class Lease:
    """Staging slots held by one transfer. A child transfer given up on for its
    deadline may still write its slots, so they return to the free list only
    once every such straggler has completed."""

    def __init__(self, staging: Staging, ids: list[int]) -> None:
        self.staging = staging
        self.ids = ids
        self._lock = threading.Lock()
        self._stragglers = 0
        self._closed = False

    def hold_until(self, handle: Handle) -> None:
        """Keep the slots until ``handle`` completes (a :data:`LateHook`)."""
        with self._lock:
            self._stragglers += 1
        handle.add_done_callback(lambda _: self._landed())

    def _landed(self) -> None:
        with self._lock:
            self._stragglers -= 1
            done = self._closed and self._stragglers == 0
        if done:
            self.staging.release(self.ids)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            done = self._stragglers == 0
        if done:
            self.staging.release(self.ids)


def _row_views(layout: KVLayout, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer tensors in the layout's shapes (with ``len(rows)`` blocks) whose
    blocks are the rows' byte ranges, in the row format BlockCopier uses."""
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for spec in layout.layers:
        dtype = torch_dtype(spec.dtype)
        itemsize = spec.itemsize
        if offset % itemsize or layout.block_nbytes % itemsize:
            raise LayoutError(
                f"layer {spec.name!r} starts at byte {offset} of a {layout.block_nbytes}-byte "
                f"block, not a multiple of its {itemsize}-byte {spec.dtype}: staging needs "
                "layers aligned to their item size (use write='through')"
            )
        flat = rows[:, offset : offset + spec.block_nbytes].view(dtype)
        block = flat.view(len(rows), *spec.block_shape)
        views[spec.name] = block.movedim(0, spec.block_dim)
        offset += spec.block_nbytes
    return views
