"""WrappingBackend: a backend over one ``inner`` backend that forwards all but what it changes.

A wrapper (``checksum``, the fault injectors) changes what a save or a load
does and nothing else: lookups, releases, publications, the address peers
reach, health, stats and closing are the inner backend's. Writing those
forwards once keeps every wrapper honest when the Backend interface grows
(a forward a wrapper forgot would silently drop, say, a lease release).

The inner backend runs through a :class:`~kvmux.runner.Runner`
(``self.inner_runner``): its transfers keep their own threads and
lanes and count in its own stats, as they would behind a connector of their
own, and the wrapper waits for them within its deadline. Arguments are not
checked again: the front of the wrapper checked them once.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from typing import Any

from kvmux.backend import Address, Backend, Health
from kvmux.blocks import BlockCopier
from kvmux.config import BackendConfig
from kvmux.errors import TransferTimeout
from kvmux.handle import Handle, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.runner import Runner


class WrappingBackend(Backend):
    """Forwards everything to ``inner``; subclasses override ``save``/``load``.

    May wrap an inner backend that is registered already (its memory is then
    the wrapper's: ``copier``), or register it (``register``). Closing the
    wrapper closes the inner backend. ``stats()`` is the inner backend's,
    beneath the wrapper's own counters: what callers of the wrapper saw."""

    def __init__(self, inner: Backend, config: BackendConfig | None = None) -> None:
        """``config``: the wrapper's own, if it has one (default: the inner one's)."""
        super().__init__(config if config is not None else inner.config)
        self.inner = inner
        self.capabilities = inner.capabilities

    @property
    def inner_runner(self) -> Runner:
        """Runs the inner backend's transfers (a runner holds nothing but its backend)."""
        return Runner(self.inner)

    @property
    def copier(self) -> BlockCopier:
        """The wrapper's registered memory, else the inner backend's (a wrapper of a
        registered backend adopts its memory)."""
        if self._copier is not None:
            return self._copier
        return self.inner.copier

    def register(self, blocks: BlockCopier) -> None:
        self.inner_runner.register(blocks.layout, blocks.caches)

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        return self.inner_runner.lookup(keys, source)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> Sequence[Outcome]:
        deadline = time.monotonic() + self.config.timeout_s
        return self.outcomes(self.inner_runner.save(keys, block_ids, deadline), deadline)

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> Sequence[Outcome]:
        return self.outcomes(self.inner_runner.load(keys, block_ids, source, deadline), deadline)

    def returned(self, block_ids: list[int]) -> Future[None] | None:
        return self.inner.returned(block_ids)

    def lane(self, source: Address | None) -> Hashable:
        return self.inner.lane(source)

    def release(self, keys: list[BlockKey]) -> None:
        self.inner.release(keys)

    def publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        self.inner.publish(keys, lease, lease_s)

    def renew(self, leases: list[str], source: Address | None) -> None:
        self.inner.renew(leases, source)

    def unpublish(self, leases: list[str], source: Address | None) -> None:
        self.inner.unpublish(leases, source)

    def address(self) -> dict[str, Any] | None:
        return self.inner.address()

    def health(self) -> Health:
        return self.inner.health()

    def stats(self) -> dict[str, float]:
        return self.inner_runner.stats()

    def close(self) -> None:
        self.inner_runner.close()

    def outcomes(self, handle: Handle, deadline: float) -> tuple[Outcome, ...]:
        """The inner transfer's outcomes (a lending save's as soon as they are known:
        the blocks' return is ``returned``'s); one that has not ended a second past
        ``deadline`` (the inner backend overran it) fails its keys."""
        wait_s = max(0.0, deadline - time.monotonic()) + 1.0
        try:
            return handle.saved(timeout=wait_s).outcomes
        except TransferTimeout:
            reason = f"inner backend did not finish within {self.config.timeout_s:g} s"
            return (failed(reason),) * len(handle.keys)
