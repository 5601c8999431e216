"""``tiered``: children as a storage hierarchy, fastest first (``[cpu, disk, remote]``).

* A save goes to the top tier. With ``write="back"`` a block evicted from a
  tier is *demoted* into the next one, and leaves the hierarchy only when
  evicted from the last; with ``write="through"`` every save goes to every
  tier and eviction simply drops a tier's copy.
* A load takes each block from the highest tier that delivers it (falling
  back down the tiers like ``fallback``); a block found below the top is
  *promoted*: saved into the tiers above it, so the next hit is fast.
* Each tier's capacity (``capacity_blocks`` / ``capacity_bytes``) is
  enforced by the multi with the tier's eviction policy (``lru``, ``arc``),
  independently of any bound the backend keeps itself: a full tier evicts
  (and demotes) *before* new blocks are written, so it never exceeds its
  capacity, not even transiently. Give a bounded backend some slack over
  the tier's capacity, or it may evict on its own (the block then just
  stops being found in that tier). The bookkeeping starts empty: blocks a
  persistent tier kept from an earlier run are found and served, but do
  not count against the tier's capacity.

Write-back moves blocks between tiers through a staging area (see
:mod:`kvmux.multi.staging`): one extra copy per transfer. Demotion and
promotion happen inside the save or load that causes them, so a transfer's
handle completes once every tier is consistent. Tiered transfers run one at
a time (they share the tier bookkeeping and the staging area).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvmux.backend import Address
from kvmux.capabilities import Capabilities
from kvmux.errors import CapacityError
from kvmux.handle import OK, Outcome, Status, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.multi.child import Child, LateHook
from kvmux.multi.eviction import EVICTION_POLICIES, EvictionPolicy
from kvmux.multi.policy import (
    ChildSpec,
    Policy,
    PolicyOptions,
    Problem,
    composed_lookup,
    derive_capabilities,
    load_in_turn,
    register_child,
)
from kvmux.multi.staging import Staging


class TierOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    capacity_blocks: int | None = Field(None, ge=1, description="most blocks the tier holds")
    capacity_bytes: int | None = Field(
        None, gt=0, description="most bytes of blocks the tier holds (whichever bound is lower)"
    )
    eviction: str = Field("lru", description=f"one of {sorted(EVICTION_POLICIES)}")

    @field_validator("eviction")
    @classmethod
    def _known_eviction(cls, name: str) -> str:
        if name not in EVICTION_POLICIES:
            known = ", ".join(sorted(EVICTION_POLICIES))
            raise ValueError(f"unknown eviction policy {name!r}; known: {known}")
        return name

    def capacity(self, block_nbytes: int) -> int | None:
        """The bound in blocks for ``block_nbytes``-byte blocks (None: unbounded)."""
        bounds = [b for b in (self.capacity_blocks,) if b is not None]
        if self.capacity_bytes is not None:
            if self.capacity_bytes < block_nbytes:
                raise CapacityError(
                    f"capacity_bytes={self.capacity_bytes} holds no block of {block_nbytes} bytes"
                )
            bounds.append(self.capacity_bytes // block_nbytes)
        return min(bounds) if bounds else None


class TieredOptions(PolicyOptions):
    tiers: list[TierOptions] = Field(
        default_factory=list,
        description="per child, top tier first; children without an entry are unbounded LRU",
    )
    write: Literal["back", "through"] = Field(
        "back",
        description="'back': save to the top tier, demote on eviction; "
        "'through': save to every tier",
    )
    promote: bool = Field(True, description="copy blocks found below the top into the tiers above")
    staging_blocks: int = Field(
        64, ge=1, description="write-back: blocks of staging memory for moving blocks between tiers"
    )


class TieredPolicy(Policy):
    options_model = TieredOptions
    options: TieredOptions

    def __init__(self, options: PolicyOptions, children: Sequence[Child]) -> None:
        super().__init__(options, children)
        self._lock = threading.RLock()
        self._tiers: list[EvictionPolicy] = []
        self._staging: Staging | None = None

    @classmethod
    def check(cls, options: PolicyOptions, children: Sequence[ChildSpec]) -> list[Problem]:
        assert isinstance(options, TieredOptions)
        problems: list[Problem] = []
        if len(options.tiers) > len(children):
            problems.append(
                (("tiers",), f"{len(options.tiers)} tiers configured for {len(children)} children")
            )
        for child in children:
            if child.capabilities.consumes_on_load:
                problems.append(
                    (
                        ("children", child.index),
                        f"{child.config.backend!r} gives a block away when it is loaded; "
                        "a tier must keep what it holds",
                    )
                )
        if options.write == "back" and options.staging_blocks < len(children):
            problems.append(
                (
                    ("staging_blocks",),
                    f"write-back needs one staging block per tier at least, "
                    f"got {options.staging_blocks} for {len(children)} tiers",
                )
            )
        return problems

    def capabilities(self) -> Capabilities:
        caps = [child.capabilities for child in self.children]
        back = self.options.write == "back"
        # Write-back: a block may live in any one tier, so every tier must persist.
        persistent = all(c.persistent for c in caps) if back else any(c.persistent for c in caps)
        derived = derive_capabilities(caps, persistent=persistent)
        bounded = all(
            c.capacity_bound
            or self._tier_options(i).capacity_blocks is not None
            or self._tier_options(i).capacity_bytes is not None
            for i, c in enumerate(caps)
        )
        return replace(derived, capacity_bound=bounded, zero_copy=derived.zero_copy and not back)

    def _tier_options(self, index: int) -> TierOptions:
        tiers = self.options.tiers
        return tiers[index] if index < len(tiers) else TierOptions()

    def register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        tiers: list[EvictionPolicy] = []
        for child in self.children:
            options = self._tier_options(child.index)
            try:
                capacity = options.capacity(layout.block_nbytes)
            except CapacityError as exc:
                raise CapacityError(f"tier {child.index}: {exc}") from None
            tiers.append(EVICTION_POLICIES[options.eviction](capacity))
        staging = None
        if self.options.write == "back":
            staging = Staging(layout, caches, self.options.staging_blocks)
            layout, caches = staging.layout, staging.caches
        for child in self.children:
            register_child(child, layout, caches)
        with self._lock:
            self._tiers, self._staging = tiers, staging

    @property
    def _chunk(self) -> int:
        """Keys per staged batch: a save or load, and each level of demotion below
        it, holds one batch of slots at a time, so this many always fit."""
        return max(1, self.options.staging_blocks // len(self.children))

    # ------------------------------------------------------------------- lookup

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        return composed_lookup(self.children, keys, source)

    # --------------------------------------------------------------------- save

    def save(self, keys: list[BlockKey], block_ids: list[int], deadline: float) -> list[Outcome]:
        with self._lock:
            staging = self._staging
            if staging is None:
                outcomes = self._store_through(range(len(self.children)), keys, block_ids, deadline)
            else:
                outcomes = []
                for part in _slices(len(keys), self._chunk):
                    try:
                        with staging.lease(len(keys[part]), deadline) as lease:
                            staging.fill(lease.ids, block_ids[part])
                            outcomes += self._place(0, keys[part], lease.ids, deadline)
                    except TimeoutError as exc:
                        outcomes += [failed(str(exc))] * len(keys[part])
        return outcomes

    def _place(
        self, t: int, keys: list[BlockKey], slots: list[int], deadline: float
    ) -> list[Outcome]:
        """Write-back: store ``keys`` (bytes in staging ``slots``) in tier ``t``, after
        demoting what they push out. Keys the tier cannot take (pushed out by their
        own batch, or failed) go one tier down. A key ends failed only if failures,
        not evictions, kept it out of every tier (a key evicted from the last tier
        was stored, as far as the caller is concerned, like in any bounded store)."""
        if not keys:
            return []
        tier, child = self._tiers[t], self.children[t]
        victims = [victim for key in keys for victim in tier.insert(key)]
        batch = set(keys)
        self._demote(t, [v for v in victims if v not in batch], deadline)
        overflow = {v for v in victims if v in batch}
        child.release(list(overflow))  # one may have been here already: no stale copy left
        here = [j for j, key in enumerate(keys) if key not in overflow]
        result = child.save([keys[j] for j in here], [slots[j] for j in here], deadline)
        outcomes: list[Outcome] = [OK] * len(keys)
        down = [j for j, key in enumerate(keys) if key in overflow]
        for j, outcome in zip(here, result.outcomes, strict=True):
            if not outcome.ok:
                tier.remove(keys[j])
                outcomes[j] = outcome
                down.append(j)
        child.count("evictions", len(overflow))
        if down and t + 1 < len(self.children):
            self.children[t + 1].count("demotions", len(overflow))
            below = self._place(t + 1, [keys[j] for j in down], [slots[j] for j in down], deadline)
            for j, lower in zip(down, below, strict=True):
                mine = outcomes[j]
                both_failed = not (mine.ok or lower.ok)
                outcomes[j] = failed(f"{mine.reason}; {lower.reason}") if both_failed else lower
        return outcomes

    def _demote(self, t: int, victims: list[BlockKey], deadline: float) -> None:
        """Move ``victims`` (already out of tier ``t``'s bookkeeping) from tier ``t`` to
        the tier below, through staging; from the last tier they are simply dropped."""
        if not victims:
            return
        child = self.children[t]
        child.count("evictions", len(victims))
        below = t + 1
        if below < len(self.children):
            staging = self._staging
            assert staging is not None
            moving = [v for v in victims if v not in self._tiers[below]]  # others are there
            for part in _batches(moving, self._chunk):
                try:
                    with staging.lease(len(part), deadline) as lease:
                        result = child.load(part, lease.ids, None, deadline, lease.hold_until)
                        read = [j for j, o in enumerate(result.outcomes) if o.ok]
                        self.children[below].count("demotions", len(read))
                        self._place(
                            below, [part[j] for j in read], [lease.ids[j] for j in read], deadline
                        )
                except TimeoutError:
                    pass  # no staging slots in time: the victims are dropped (later a miss)
        child.release(victims)

    def _store_through(
        self, tiers: Iterable[int], keys: list[BlockKey], ids: list[int], deadline: float
    ) -> list[Outcome]:
        """Write-through: store ``keys`` (bytes in blocks ``ids``) in each of ``tiers`` at
        once, dropping each tier's evicted copies first. A key ends failed if every
        tier that tried to store it failed (one its own batch pushed out is not tried)."""
        attempts = []
        for t in tiers:
            tier, child = self._tiers[t], self.children[t]
            victims = [victim for key in keys for victim in tier.insert(key)]
            overflow = set(victims) & set(keys)
            child.count("evictions", len(victims))
            child.release(victims)
            here = [j for j, key in enumerate(keys) if key not in overflow]
            attempt = child.start_save([keys[j] for j in here], [ids[j] for j in here])
            attempts.append((t, here, attempt))
        stored = [False] * len(keys)
        reasons: list[list[str]] = [[] for _ in keys]
        for t, here, attempt in attempts:
            result = attempt.finish(deadline)
            for j, outcome in zip(here, result.outcomes, strict=True):
                if outcome.ok:
                    stored[j] = True
                else:
                    self._tiers[t].remove(keys[j])
                    reasons[j].append(outcome.reason or "failed")
        return [
            OK if ok or not why else failed("; ".join(why))
            for ok, why in zip(stored, reasons, strict=True)
        ]

    # --------------------------------------------------------------------- load

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]:
        with self._lock:
            staging = self._staging
            if staging is None:
                return self._load_into(keys, block_ids, source, deadline)
            outcomes: list[Outcome] = []
            for part in _slices(len(keys), self._chunk):
                try:
                    with staging.lease(len(keys[part]), deadline) as lease:
                        got = self._load_into(
                            keys[part], lease.ids, source, deadline, lease.hold_until
                        )
                        ok = [j for j, o in enumerate(got) if o.status is Status.OK]
                        staging.drain([lease.ids[j] for j in ok], [block_ids[part][j] for j in ok])
                except TimeoutError as exc:
                    got = [failed(str(exc))] * len(keys[part])
                outcomes += got
            return outcomes

    def _load_into(
        self,
        keys: list[BlockKey],
        ids: list[int],
        source: Address | None,
        deadline: float,
        on_late: LateHook | None = None,
    ) -> list[Outcome]:
        """Load ``keys`` into the children's blocks ``ids`` tier by tier, then promote
        what came from below the top (its bytes are in ``ids`` now)."""
        delivery = load_in_turn(self.children, keys, ids, source, deadline, on_late)
        found_in: dict[int, list[int]] = defaultdict(list)
        for j, t in enumerate(delivery.delivered_by):
            if t is None:
                continue
            for above in range(t):
                self._tiers[above].remove(keys[j])  # it did not deliver: stale bookkeeping
            self._tiers[t].touch(keys[j])
            if t > 0 and self.options.promote:
                found_in[t].append(j)
        for t, found in sorted(found_in.items()):
            self._promote(t, [keys[j] for j in found], [ids[j] for j in found], deadline)
        return delivery.outcomes

    def _promote(self, t: int, keys: list[BlockKey], ids: list[int], deadline: float) -> None:
        """Copy blocks tier ``t`` delivered into the top tier (write-back, which
        demotes as usual) or into every tier above ``t`` (write-through)."""
        above = range(1) if self._staging is not None else range(t)
        for target in above:
            self.children[target].count("promotions", len(keys))
        if self._staging is not None:
            self._place(0, keys, ids, deadline)
        else:
            self._store_through(above, keys, ids, deadline)

    # -------------------------------------------------------------------- misc

    def release(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for tier in self._tiers:
                for key in keys:
                    tier.remove(key)
        super().release(keys)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        with self._lock:
            for t, tier in enumerate(self._tiers):
                out[f"tier.{t}.blocks"] = float(len(tier))
                if tier.capacity is not None:
                    out[f"tier.{t}.capacity_blocks"] = float(tier.capacity)
            if self._staging is not None:
                out["staging_blocks_free"] = float(self._staging.free)
        return out


def _batches(items: list[BlockKey], size: int) -> Iterator[list[BlockKey]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _slices(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, start + size)
