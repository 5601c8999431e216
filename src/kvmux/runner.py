"""Runner: runs one backend's transfers as handles.

A :class:`~kvmux.backend.Backend`'s ``save`` and ``load`` are synchronous
calls returning per-key outcomes. The runner turns each into a
:class:`~kvmux.handle.Handle`: in the caller's thread for an ``inline``
backend's local transfers, else queued on the backend's lane for it
(:mod:`kvmux.lanes`); exceptions become per-key failures; the bytes moved
(``ok`` keys times the block size), the time taken and the per-status counts
go into the backend's ``counters``.

The :class:`~kvmux.connector.Connector` front runs its backend through one;
a composite that fans out to children of its own (``multi``) runs each child
through one, so every child keeps its threads, its deadlines and its stats,
and none of them re-checks what the front checked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future

import torch

from kvmux.backend import Address, Backend
from kvmux.blocks import BlockCopier
from kvmux.errors import LayoutError
from kvmux.handle import Handle, Outcome, TransferResult, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout

_closing = threading.Lock()
"""Makes marking a backend closed atomic (closing is rare: one lock for all)."""


class Runner:
    """Runs ``backend``'s transfers (arguments already checked) as handles."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> BlockCopier:
        """Check ``layout`` against the backend's capabilities, then register the
        KV memory with it; the copier it now uses."""
        backend = self.backend
        caps = backend.capabilities
        if layout.device not in caps.memory_kinds:
            raise LayoutError(
                f"{type(backend).__name__} cannot use {layout.device} memory "
                f"(supports {sorted(caps.memory_kinds)})"
            )
        if caps.max_block_nbytes is not None and layout.block_nbytes > caps.max_block_nbytes:
            raise LayoutError(
                f"block of {layout.block_nbytes} bytes exceeds {caps.max_block_nbytes}"
            )
        copier = BlockCopier(layout, caches)
        backend.attach(copier)
        return copier

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        """The backend's count of leading stored keys, clamped to ``[0, len(keys)]``
        and counted; ``keys`` never empty."""
        found = max(0, min(len(keys), self.backend.lookup(keys, source)))
        counters = self.backend.counters
        counters.add("lookup_calls")
        counters.add("lookup_hits", found)
        return found

    def save(
        self, keys: list[BlockKey], block_ids: list[int], deadline: float | None = None
    ) -> Handle:
        """Start the backend's save. A save still queued at ``deadline`` (default:
        ``timeout_s`` from now) fails instead of starting late."""
        backend = self.backend
        return self._start(
            "save", keys, None, lambda: backend.save(keys, block_ids), self._deadline(deadline)
        )

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float | None = None,
    ) -> Handle:
        """Start the backend's load, on ``backend.lane(source)``, against ``deadline``
        (default: ``timeout_s`` from now): taken at the call, so a load queued
        behind a hung peer's fails when its own time is up, not later."""
        backend = self.backend
        lane = backend.lane(source)
        until = self._deadline(deadline)
        return self._start(
            "load", keys, lane, lambda: backend.load(keys, block_ids, source, until), until
        )

    def stats(self) -> dict[str, float]:
        """The backend's counters (its transfers' among them) and its own readings."""
        backend = self.backend
        return {**backend.counters.snapshot(), **backend.stats()}

    def close(self) -> None:
        """Close the backend, then end its lanes (queued transfers end cancelled).
        Idempotent, and once per backend however many runners hold it (a wrapper's
        and the connector the wrapped backend came from)."""
        backend = self.backend
        with _closing:
            if backend.closed:
                return
            backend.closed = True
        try:
            backend.close()
        finally:
            backend.lanes.shutdown(wait=True)

    def _deadline(self, deadline: float | None) -> float:
        if deadline is None:
            return time.monotonic() + self.backend.config.timeout_s
        return deadline

    def _start(
        self,
        op: str,
        keys: list[BlockKey],
        lane: Hashable,
        work: Callable[[], Sequence[Outcome]],
        deadline: float,
    ) -> Handle:
        backend = self.backend
        block_nbytes = backend.copier.block_nbytes
        if lane is None and backend.inline:
            handle = Handle.from_call(keys, _now, work, block_nbytes)
        else:
            width = backend.workers if lane is None else backend.lane_width
            guarded = _unless_expired(len(keys), work, deadline, backend.config.timeout_s)
            lanes = backend.lanes
            handle = Handle.from_call(
                keys, lambda fn: lanes.submit(lane, fn, width), guarded, block_nbytes
            )
        counters = backend.counters
        handle.add_done_callback(lambda r: counters.record(op, r))
        return handle


def _now(fn: Callable[[], TransferResult]) -> Future[TransferResult]:
    """Run ``fn`` in the caller's thread: a finished future."""
    future: Future[TransferResult] = Future()
    future.set_result(fn())
    return future


def _unless_expired(
    count: int, work: Callable[[], Sequence[Outcome]], deadline: float, timeout_s: float
) -> Callable[[], Sequence[Outcome]]:
    """``work``, unless it starts at or past ``deadline``: then every key fails at
    once. The deadline belongs to the request, not to the thread that gets
    round to it."""

    def guarded() -> Sequence[Outcome]:
        if time.monotonic() >= deadline:
            reason = f"deadline of {timeout_s} s passed while queued behind other transfers"
            return [failed(reason)] * count
        return work()

    return guarded
