"""The Connector: the one interface the rest of kvmux (and every engine adapter) speaks.

A backend subclasses :class:`Connector` and implements three methods,
``_lookup``, ``_save`` and ``_load``; the public methods around them check
arguments the same way for every backend, keep the stats and turn surprises
into per-key failures. See ``examples/plugin`` for a complete small backend.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import (
    ClosedError,
    InvalidRequestError,
    LayoutError,
    NotRegisteredError,
)
from kvmux.handle import Handle, Outcome, TransferResult, failed
from kvmux.keys import BlockKey, check_unique
from kvmux.lanes import Lanes
from kvmux.layout import KVLayout
from kvmux.publications import check_lease_ids
from kvmux.stats import Stats

T = TypeVar("T")

Address = Mapping[str, Any]
"""Where a peer reaches a P2P connector: JSON-able, carried between engine instances."""


@dataclass(frozen=True)
class Health:
    healthy: bool
    detail: str = ""


class Connector(ABC):
    """Moves blocks of registered KV memory in and out under :class:`BlockKey` names.

    Contract (checked by ``kvmux.testing.suite``):

    * ``register`` once, before any transfer, with the engine's KV tensors.
    * ``lookup(keys)`` returns how many *leading* keys can be loaded; cheap,
      no side effects.
    * ``save(keys, block_ids)`` makes those blocks retrievable; when the
      handle finishes the caller may overwrite the blocks.
    * ``load(keys, block_ids, source)`` fills the blocks; each key ends ok,
      missing or failed, within ``config.timeout_s`` of the call, however many
      loads are in flight; never wrong bytes. A peer that hangs delays only
      the loads from it.
    * ``publish`` / ``renew`` / ``unpublish``: a bounded P2P producer holds
      published blocks until its consumer is done with them or the lease ends.
    * every method is safe to call from several threads.
    """

    config_model: ClassVar[type[BackendConfig]] = BackendConfig
    capabilities: Capabilities = Capabilities()
    """Class-level for most backends; bridges derive theirs per instance."""
    max_workers: ClassVar[int] = 2
    """Threads of the shared lane: background work ``_run`` is given no lane for."""
    lane_width: ClassVar[int] = 4
    """Threads of each other lane (one per peer): see :mod:`kvmux.lanes`."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.layout: KVLayout | None = None
        self._copier: BlockCopier | None = None
        self._stats = Stats()
        self._closed = False
        self._lanes: Lanes | None = None
        self._lanes_lock = threading.Lock()

    # ----------------------------------------------------------------- public API

    def register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        """Give the connector the KV memory it reads from and writes to."""
        self._check_open()
        if layout.device not in self.capabilities.memory_kinds:
            raise LayoutError(
                f"{type(self).__name__} cannot use {layout.device} memory "
                f"(supports {sorted(self.capabilities.memory_kinds)})"
            )
        max_block = self.capabilities.max_block_nbytes
        if max_block is not None and layout.block_nbytes > max_block:
            raise LayoutError(f"block of {layout.block_nbytes} bytes exceeds {max_block}")
        copier = BlockCopier(layout, caches)
        self._register(layout, caches)
        self.layout, self._copier = layout, copier

    def lookup(self, keys: Sequence[BlockKey], source: Address | None = None) -> int:
        """How many leading ``keys`` this connector (or the peer at ``source``) can deliver."""
        self._check_open()
        self._check_keys(keys)
        if not keys:
            return 0
        found = max(0, min(len(keys), self._lookup(list(keys), source)))
        self._stats.add("lookup_calls")
        self._stats.add("lookup_hits", found)
        return found

    def save(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> Handle:
        """Start making blocks ``block_ids`` retrievable under ``keys``."""
        self._check_transfer(keys, block_ids)
        handle = self._save(list(keys), list(block_ids))
        handle.add_done_callback(lambda r: self._stats.record("save", r))
        return handle

    def load(
        self, keys: Sequence[BlockKey], block_ids: Sequence[int], source: Address | None = None
    ) -> Handle:
        """Start filling blocks ``block_ids`` with the data saved under ``keys``."""
        self._check_transfer(keys, block_ids)
        handle = self._load(list(keys), list(block_ids), source)
        handle.add_done_callback(lambda r: self._stats.record("load", r))
        return handle

    def _transfer_prechecked(
        self,
        op: str,
        keys: Sequence[BlockKey],
        block_ids: Sequence[int],
        source: Address | None = None,
    ) -> Handle:
        """``save`` (``op="save"``) or ``load`` (``op="load"``) for a composite
        connector (``multi``, ``checksum``) passing on a request its own public
        method has already checked, against a layout with this connector's
        blocks: the per-key argument checks are not repeated, the caller vouches
        for them (``BlockKey`` keys, no key or block id twice, ids in range).
        The rest is the public method's: it raises where that would (closed,
        unregistered, unpaired lists, the backend raising; the caller turns this
        into per-key failures, as for the public methods) and the transfer counts
        in this connector's ``stats()``. A subclass that overrides the public
        method gets it called instead. Internal: not part of the public API."""
        if op not in ("save", "load"):
            raise ValueError(f"op must be 'save' or 'load', not {op!r}")
        if op == "save" and type(self).save is not Connector.save:
            return self.save(keys, block_ids)
        if op == "load" and type(self).load is not Connector.load:
            return self.load(keys, block_ids, source)
        self._check_open()
        if len(keys) != len(block_ids):
            raise InvalidRequestError(
                f"{len(keys)} keys but {len(block_ids)} block ids: they must pair up"
            )
        _ = self.copier  # NotRegisteredError before any work, like the public methods
        if op == "save":
            handle = self._save(list(keys), list(block_ids))
        else:
            handle = self._load(list(keys), list(block_ids), source)
        handle.add_done_callback(lambda r: self._stats.record(op, r))
        return handle

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Tell the connector these keys are no longer needed (frees pins and leases)."""
        self._check_open()
        self._release(list(keys))

    # A publication: the producer keeps a request's blocks for the consumer they
    # were published to (see kvmux.publications). Backends whose stored blocks stay
    # until released need none of it, hence the do-nothing defaults below.

    def publish(self, keys: Sequence[BlockKey], lease: str, lease_s: float) -> None:
        """Producer: keep the blocks stored under ``keys`` (saves that have ended)
        for a consumer: not evicted until ``unpublish(lease)`` or until ``lease_s``
        seconds pass without a ``renew``. ``lease`` is a
        :func:`~kvmux.publications.new_lease_id` the consumer is given; keys not
        stored are skipped; publishing a lease again replaces its keys."""
        self._check_open()
        self._check_keys(keys)
        check_lease_ids([lease])
        if not lease_s > 0:
            raise InvalidRequestError(f"lease_s must be positive, got {lease_s!r}")
        self._publish(list(keys), lease, float(lease_s))

    def renew(self, leases: Sequence[str], source: Address | None = None) -> None:
        """Consumer: still coming for these publications (it has their params, it has
        not loaded yet): each is extended by its ``lease_s``. With ``source`` (the
        producer's address) the producer is told in the background: this never
        waits on the peer nor raises for it. Without, this instance's own."""
        self._notice(leases, source, self._renew)

    def unpublish(self, leases: Sequence[str], source: Address | None = None) -> None:
        """Consumer: done with these publications (loaded, failed, aborted, or rejected
        before it reached the engine): the producer drops their holds now rather
        than at lease end. ``source`` as for :meth:`renew`."""
        self._notice(leases, source, self._unpublish)

    def _notice(
        self,
        leases: Sequence[str],
        source: Address | None,
        hook: Callable[[list[str], Address | None], None],
    ) -> None:
        self._check_open()
        leases = list(leases)
        check_lease_ids(leases)
        if leases:
            hook(leases, source)

    def address(self) -> dict[str, Any] | None:
        """Where peers reach this instance (P2P backends), else None."""
        return None

    def health(self) -> Health:
        if self._closed:
            return Health(False, "closed")
        return Health(True)

    def stats(self) -> dict[str, float]:
        """Numbers for operators: counters that only grow, and the levels declared
        in ``kvmux.stats.LEVELS`` (a stat that can fall must be declared there, or
        aggregators treat it as a counter and lose its drops)."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Stop background work and free resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        finally:
            if self._lanes is not None:
                self._lanes.shutdown(wait=True)

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ for subclasses

    @abstractmethod
    def _lookup(self, keys: list[BlockKey], source: Address | None) -> int: ...

    @abstractmethod
    def _save(self, keys: list[BlockKey], block_ids: list[int]) -> Handle: ...

    @abstractmethod
    def _load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None
    ) -> Handle: ...

    def _register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        """Hook: transports that pin or register memory do it here."""

    def _release(self, keys: list[BlockKey]) -> None:
        """Hook: free whatever ``keys`` hold beyond a normal stored block."""

    def _publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        """Hook: hold ``keys`` under ``lease`` (see ``publish``); arguments checked."""

    def _renew(self, leases: list[str], source: Address | None) -> None:
        """Hook: extend ``leases`` here (``source`` None) or at the peer ``source``,
        without waiting on the peer; ids checked, never empty."""

    def _unpublish(self, leases: list[str], source: Address | None) -> None:
        """Hook: end ``leases`` here or at ``source``, as ``_renew``."""

    def _close(self) -> None:
        """Hook: stop servers, unmap memory."""

    @property
    def copier(self) -> BlockCopier:
        if self._copier is None:
            raise NotRegisteredError(
                f"{type(self).__name__}: call register() with the KV tensors first"
            )
        return self._copier

    def _submit(
        self, fn: Callable[[], T], lane: Hashable = None, width: int | None = None
    ) -> Future[T]:
        """Queue ``fn`` on ``lane`` (``None``: the shared one, ``max_workers`` wide;
        any other, e.g. a peer's endpoint, ``lane_width`` wide unless ``width`` says)."""
        with self._lanes_lock:
            if self._lanes is None:
                self._lanes = Lanes(f"kvmux-{self.config.backend}")
            lanes = self._lanes
        if width is None:
            width = self.max_workers if lane is None else self.lane_width
        return lanes.submit(lane, fn, width)

    def _run(
        self,
        keys: Sequence[BlockKey],
        work: Callable[[], tuple[Sequence[Outcome], int]],
        *,
        deadline: float | None = None,
        lane: Hashable = None,
    ) -> Handle:
        """Run ``work`` in the background on ``lane``; its exceptions become per-key
        failures. With a ``deadline`` (monotonic seconds, taken when the transfer
        was asked for), a job still queued when it passes fails every key the
        moment it starts instead of running late: the deadline belongs to the
        request, not to the thread that gets round to it."""
        if deadline is not None:
            work = _unless_expired(keys, work, deadline, self.config.timeout_s)
        return Handle.from_call(keys, lambda fn: self._submit(fn, lane), work)

    def _run_now(
        self, keys: Sequence[BlockKey], work: Callable[[], tuple[Sequence[Outcome], int]]
    ) -> Handle:
        """Like ``_run`` but in the caller's thread: for work cheaper than a thread hop."""

        def submit(fn: Callable[[], TransferResult]) -> Future[TransferResult]:
            fut: Future[TransferResult] = Future()
            fut.set_result(fn())
            return fut

        return Handle.from_call(keys, submit, work)

    # --------------------------------------------------------------- argument checks

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")

    @staticmethod
    def _check_keys(keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if not isinstance(key, BlockKey):
                raise InvalidRequestError(f"keys must be BlockKey, got {type(key).__name__}")

    def _check_transfer(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        self._check_open()
        if len(keys) != len(block_ids):
            raise InvalidRequestError(
                f"{len(keys)} keys but {len(block_ids)} block ids: they must pair up"
            )
        self._check_keys(keys)
        try:
            check_unique(keys)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        num_blocks = self.copier.num_blocks
        bad = _out_of_range(block_ids, num_blocks)
        if bad:
            raise InvalidRequestError(f"block ids out of range [0, {num_blocks}): {bad[:5]}")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidRequestError("a block id appears twice in one call")


def _unless_expired(
    keys: Sequence[BlockKey],
    work: Callable[[], tuple[Sequence[Outcome], int]],
    deadline: float,
    timeout_s: float,
) -> Callable[[], tuple[Sequence[Outcome], int]]:
    def guarded() -> tuple[Sequence[Outcome], int]:
        if time.monotonic() >= deadline:
            reason = f"deadline of {timeout_s} s passed while queued behind other transfers"
            return [failed(reason)] * len(keys), 0
        return work()

    return guarded


def _out_of_range(block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """The block ids outside ``[0, num_blocks)``. ``min``/``max`` clear the usual
    in-range batch at C speed (thousands of ids per call); only a batch they
    cannot clear (or cannot compare) is walked id by id."""
    try:
        if len(block_ids) == 0 or (min(block_ids) >= 0 and max(block_ids) < num_blocks):
            return []
    except TypeError:
        pass
    return [b for b in block_ids if not 0 <= int(b) < num_blocks]
