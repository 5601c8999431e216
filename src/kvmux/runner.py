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

import torch

from kvmux.backend import Address, Backend
from kvmux.blocks import BlockCopier
from kvmux.errors import ClosedError, InvalidRequestError
from kvmux.handle import Handle, Outcome, failed, run_transfer
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout

ErrorHook = Callable[[Exception], None]
"""Told of the exception a backend's transfer raised (a composite counts it)."""

_closing = threading.Lock()
"""Makes marking a backend closed atomic (closing is rare: one lock for all)."""


class Runner:
    """Runs ``backend``'s transfers (arguments already checked) as handles."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> BlockCopier:
        """Check ``layout`` against the backend (``check_layout``), then register the
        KV memory with it; the copier it now uses."""
        self.backend.check_layout(layout)
        copier = BlockCopier(layout, caches)
        self.backend.attach(copier)
        return copier

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        """The backend's count of leading stored keys, clamped to ``[0, len(keys)]``
        and counted; ``keys`` never empty. ClosedError once the backend is closed."""
        backend = self.backend
        check_open(backend)
        found = max(0, min(len(keys), backend.lookup(keys, source)))
        counters = backend.counters
        counters.add("lookup_calls")
        counters.add("lookup_hits", found)
        return found

    def save(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        deadline: float | None = None,
        on_error: ErrorHook | None = None,
    ) -> Handle:
        """Start the backend's save. A save still queued at ``deadline`` (default:
        ``timeout_s`` from now) fails instead of starting late. ``on_error`` is told
        of an exception the backend raised (its keys fail with it all the same)."""
        backend = self.backend

        def work() -> Sequence[Outcome]:
            return backend.save(keys, block_ids)

        return self._start("save", keys, block_ids, None, work, self._deadline(deadline), on_error)

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float | None = None,
        on_error: ErrorHook | None = None,
    ) -> Handle:
        """Start the backend's load, on ``backend.lane(source)``, against ``deadline``
        (default: ``timeout_s`` from now): taken at the call, so a load queued
        behind a hung peer's fails when its own time is up, not later.
        ``on_error`` as for :meth:`save`."""
        backend = self.backend
        lane = backend.lane(source)
        until = self._deadline(deadline)

        def work() -> Sequence[Outcome]:
            return backend.load(keys, block_ids, source, until)

        return self._start("load", keys, block_ids, lane, work, until, on_error)

    def stats(self) -> dict[str, float]:
        """The backend's own readings, overlaid with its counters (its transfers'
        among them): for a wrapper, what callers of the wrapper saw wins."""
        backend = self.backend
        return {**backend.stats(), **backend.counters.snapshot()}

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
        block_ids: list[int],
        lane: Hashable,
        work: Callable[[], Sequence[Outcome]],
        deadline: float,
        on_error: ErrorHook | None,
    ) -> Handle:
        """The transfer as a handle. Raises, before any work, what no per-key outcome
        could say: the backend is closed or unregistered, or the lists do not pair
        up (cheap checks; a composite's parts are not checked further)."""
        backend = self.backend
        check_open(backend)
        if len(keys) != len(block_ids):
            raise InvalidRequestError(
                f"{len(keys)} keys but {len(block_ids)} block ids: they must pair up"
            )
        if on_error is not None:
            work = _reporting(work, on_error)
        block_nbytes = backend.copier.block_nbytes
        counters = backend.counters
        if lane is None and backend.inline:
            result = run_transfer(tuple(keys), work, block_nbytes)
            counters.record(op, result)  # done already: no callback to hang
            if op == "save" and backend.capabilities.borrows_blocks:
                returned = backend.returned(block_ids)
                if returned is not None:
                    return Handle.lent(result, returned)
            return Handle.finished(result)
        width = backend.workers if lane is None else backend.lane_width
        guarded = _unless_expired(len(keys), work, deadline, backend.config.timeout_s)
        lanes = backend.lanes
        handle = Handle.from_call(
            keys,
            lambda fn: lanes.submit(lane, fn, width),
            guarded,
            block_nbytes,
            run_here=lambda future: lanes.run_here(lane, future),
        )
        handle.add_done_callback(lambda r: counters.record(op, r))
        if op == "save" and backend.capabilities.borrows_blocks:
            return Handle.lending(handle, lambda: backend.returned(block_ids))
        return handle


def check_open(backend: Backend) -> None:
    """ClosedError if ``backend`` is closed: no call reaches it after."""
    if backend.closed:
        raise ClosedError(f"{type(backend).__name__} is closed")


def _reporting(
    work: Callable[[], Sequence[Outcome]], on_error: ErrorHook
) -> Callable[[], Sequence[Outcome]]:
    """``work``, telling ``on_error`` of what it raises before the handle fails its keys."""

    def reported() -> Sequence[Outcome]:
        try:
            return work()
        except Exception as exc:
            on_error(exc)
            raise

    return reported


MIN_START_S = 0.01
"""A queued transfer with less time left than this fails as having waited too
long instead of starting: no peer round trip ends in less, and starting it
only turns "it waited in the queue" into a misleading "the peer timed out".
(Transfers queued behind one that ended at its deadline start a fraction of a
millisecond before their own, which are as many microseconds later as they
were submitted.)"""


def _unless_expired(
    count: int, work: Callable[[], Sequence[Outcome]], deadline: float, timeout_s: float
) -> Callable[[], Sequence[Outcome]]:
    """``work``, unless it starts with less than :data:`MIN_START_S` left before
    ``deadline``: then every key fails at once. The deadline belongs to the
    request, not to the thread that gets round to it."""

    def guarded() -> Sequence[Outcome]:
        if time.monotonic() >= deadline - MIN_START_S:
            reason = f"deadline of {timeout_s} s passed while queued behind other transfers"
            return [failed(reason)] * count
        return work()

    return guarded
