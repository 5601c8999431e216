"""Publications: a producer keeps a request's blocks for the consumer they were published to.

A P/D prefill saves the prompt's KV into its pool and returns params that a
proxy hands to a decode instance, which may pull seconds later (its queue is
long). The pool is an LRU cache: without a hold, newer saves could evict those
blocks under a consumer that is still coming, and it would recompute them. A
publication pins them under a *lease* named by a random id that travels in
the params. It ends when the consumer releases it (it loaded, failed, was
aborted, or was rejected before reaching its engine), or when ``lease_s``
passes without a renewal: a consumer that is alive but slow renews by
heartbeat, so blocks are never freed under a waiting consumer and never
stranded after it dies. Once a hold ends the blocks stay in the pool as
ordinary LRU entries (another request may still reuse them).

Expiry is checked lazily, whenever the table is used (a save needing room, a
renewal, ``stats()``): a hold that ran out while nothing needed its slots
cost nothing meanwhile.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from kvmux.errors import InvalidRequestError
from kvmux.slots import PinnedSlots, SlotArray

_LEASE_ID = re.compile(r"^[0-9a-f]{32}$")


def new_lease_id() -> str:
    """A fresh publication id: 128 random bits as hex, unguessable by other peers."""
    return secrets.token_hex(16)


def check_lease_ids(leases: list[str]) -> None:
    """Raise InvalidRequestError unless every id looks like :func:`new_lease_id`'s."""
    bad = [lease for lease in leases if not isinstance(lease, str) or not _LEASE_ID.match(lease)]
    if bad:
        raise InvalidRequestError(
            f"lease ids must be 32 lowercase hex digits (new_lease_id()), got {bad[0]!r}"
        )


@dataclass
class _Hold:
    pin: int
    """The slot lease that pins the rows (it never expires by itself)."""
    lease_s: float
    expires: float


COUNTERS = ("leases_published", "leases_released", "leases_extended", "leases_expired")
"""What :meth:`Publications.counts` reports, besides ``published_leases`` (held now)."""


class Publications:
    """Named, renewable holds on pool slots. Not thread-safe: its owner's lock guards
    it together with the :class:`PinnedSlots` passed to each call."""

    def __init__(self) -> None:
        self._held: dict[str, _Hold] = {}
        self._counts = dict.fromkeys(COUNTERS, 0)

    def __len__(self) -> int:
        return len(self._held)

    def publish(
        self, slots: PinnedSlots, lease: str, rows: SlotArray, lease_s: float, now: float
    ) -> None:
        """Hold ``rows`` under ``lease`` until released or ``lease_s`` without renewal.
        Publishing a ``lease`` again replaces its rows (a request published twice)."""
        self._end(slots, lease)
        pin = slots.hold(rows)
        self._held[lease] = _Hold(pin, lease_s, now + lease_s)
        self._counts["leases_published"] += 1

    def renew(self, leases: list[str], now: float) -> int:
        """Extend each held lease by its ``lease_s`` from ``now``; how many were held."""
        known = 0
        for lease in leases:
            hold = self._held.get(lease)
            if hold is not None and hold.expires > now:
                hold.expires = now + hold.lease_s
                known += 1
        self._counts["leases_extended"] += known
        return known

    def release(self, slots: PinnedSlots, leases: list[str]) -> int:
        """End each held lease now (its consumer is done); how many were held."""
        known = sum(self._end(slots, lease) for lease in leases)
        self._counts["leases_released"] += known
        return known

    def reap(self, slots: PinnedSlots, now: float) -> None:
        """End every lease whose time ran out by ``now``."""
        if not self._held:
            return
        for lease in [name for name, hold in self._held.items() if hold.expires <= now]:
            self._end(slots, lease)
            self._counts["leases_expired"] += 1

    def clear(self) -> None:
        """Forget every hold (their slot table is being replaced); counters stay."""
        self._held.clear()

    def counts(self) -> dict[str, float]:
        return {"published_leases": float(len(self._held)), **self._counts}

    def _end(self, slots: PinnedSlots, lease: str) -> bool:
        hold = self._held.pop(lease, None)
        if hold is None:
            return False
        slots.end_lease(hold.pin)
        return True
