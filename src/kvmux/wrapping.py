"""WrappingConnector: the part of a connector over one ``inner`` connector that only forwards.

A wrapper (``checksum``, the fault injectors) changes what a save or a load
does and nothing else: lookups, releases, publications, the address peers
reach, health, stats and closing are the inner backend's. Writing those
forwards once keeps every wrapper honest when the Connector interface grows
(a forward a wrapper forgot would silently drop, say, a lease release).
"""

from __future__ import annotations

from typing import Any

from kvmux.connector import Address, Connector, Health
from kvmux.keys import BlockKey


class WrappingConnector(Connector):
    """Forwards everything but ``_save``/``_load`` (and ``_register``) to ``inner``.

    The forwards go through the inner connector's *public* methods, so the inner
    backend still checks its arguments and keeps its own stats. ``stats()`` is
    the inner backend's overlaid with the wrapper's own counters: what callers of
    the wrapper saw."""

    inner: Connector

    def _lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        return self.inner.lookup(keys, source)

    def _release(self, keys: list[BlockKey]) -> None:
        self.inner.release(keys)

    def _publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        self.inner.publish(keys, lease, lease_s)

    def _renew(self, leases: list[str], source: Address | None) -> None:
        self.inner.renew(leases, source)

    def _unpublish(self, leases: list[str], source: Address | None) -> None:
        self.inner.unpublish(leases, source)

    def address(self) -> dict[str, Any] | None:
        return self.inner.address()

    def health(self) -> Health:
        return super().health() if self._closed else self.inner.health()

    def stats(self) -> dict[str, float]:
        return {**self.inner.stats(), **super().stats()}

    def _close(self) -> None:
        self.inner.close()
