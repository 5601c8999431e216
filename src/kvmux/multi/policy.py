"""Policies: what a MultiBackend does with its children.

The MultiBackend owns the children (building them, isolation, breakers,
stats, checks at register); a policy only decides where keys go and come
from. Policies are plugins: a class registered in the ``kvmux.policies``
entry-point group, chosen by the ``policy`` field of a multi config, with
its own options model for the config fields it adds. A policy's ``save``
and ``load`` run in the multi's worker threads and may block; they return
one outcome per key and never raise for a child's sake (:class:`Child`
already turned every child failure into outcomes).

The helpers at the bottom are the building blocks the built-in policies
share: the composed lookup, loading each key from the first child that
delivers it, and saving to several children at once.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from kvmux.backend import Address
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import CapacityError, LayoutError
from kvmux.handle import MISSING, OK, Outcome, Status, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.multi.child import Child, LateHook, plainly_ok

Problem = tuple[tuple[str | int, ...], str]
"""A config problem: where in the multi's config (``("children", 1)``) and what is wrong."""


class PolicyOptions(BaseModel):
    """A policy's own config fields, written at the top level of the multi's config."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class ChildSpec:
    """What a policy may check about a child: at config time (capabilities the
    backend class declares) and again once built (what the instance declares)."""

    index: int
    config: BackendConfig
    declared: Callable[[], Capabilities]
    """Where the capabilities come from; asked only if a policy looks at them
    (at config time that means finding the backend class, not free)."""

    @classmethod
    def built(cls, child: Child) -> ChildSpec:
        """The spec of a built child: what the instance declares."""
        capabilities = child.capabilities
        return cls(child.index, child.backend.config, lambda: capabilities)

    @cached_property
    def capabilities(self) -> Capabilities:
        return self.declared()


class Policy(ABC):
    """Routes a MultiBackend's lookups, saves and loads over its children."""

    options_model: ClassVar[type[PolicyOptions]] = PolicyOptions

    def __init__(self, options: PolicyOptions, children: Sequence[Child]) -> None:
        self.options = options
        self.children = list(children)

    @classmethod
    def check(cls, options: PolicyOptions, children: Sequence[ChildSpec]) -> list[Problem]:
        """Compositions this policy cannot work with; checked when the config is
        validated and again when the multi is built."""
        return []

    def capabilities(self) -> Capabilities:
        """What the composition promises; by default a save reaches every child."""
        caps = [child.capabilities for child in self.children]
        return derive_capabilities(caps, persistent=any(c.persistent for c in caps))

    def register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        """Give the children their memory: by default the engine's own KV tensors."""
        for child in self.children:
            register_child(child, layout, caches)

    @abstractmethod
    def lookup(self, keys: list[BlockKey], source: Address | None) -> int: ...

    @abstractmethod
    def save(
        self, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]: ...

    @abstractmethod
    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]: ...

    def release(self, keys: list[BlockKey]) -> None:
        for child in self.children:
            child.release(keys)

    def stats(self) -> dict[str, float]:
        return {}


# ---------------------------------------------------------------------- helpers


def derive_capabilities(caps: Sequence[Capabilities], *, persistent: bool) -> Capabilities:
    """A composition's capabilities: only what every child can do (memory kinds,
    block size, zero copy), and a load consumes only if every child's does."""
    limits = [c.max_block_nbytes for c in caps if c.max_block_nbytes is not None]
    kinds = caps[0].memory_kinds
    for c in caps[1:]:
        kinds &= c.memory_kinds
    return Capabilities(
        p2p=any(c.p2p for c in caps),
        persistent=persistent,
        capacity_bound=all(c.capacity_bound for c in caps),
        consumes_on_load=all(c.consumes_on_load for c in caps),
        zero_copy=all(c.zero_copy for c in caps),
        memory_kinds=kinds,
        max_block_nbytes=min(limits) if limits else None,
    )


def register_child(child: Child, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
    """Register one child, its refusal naming which child refused and why."""
    try:
        child.register(layout, caches)
    except (LayoutError, CapacityError) as exc:
        raise type(exc)(f"{child.label}: {exc}") from exc


def composed_lookup(children: Sequence[Child], keys: list[BlockKey], source: Address | None) -> int:
    """The longest prefix of ``keys`` the children hold between them: keys 0-9 may be
    in one child and 10-19 in another. Each round asks the children for the rest."""
    done = 0
    while done < len(keys):
        rest = keys[done:]
        best = 0
        for child in children:
            best = max(best, child.lookup(rest, source))
            if best == len(rest):
                break
        if best == 0:
            break
        done += best
    return done


@dataclass
class Delivery:
    """Outcome of loading keys from several children in turn."""

    outcomes: list[Outcome]
    delivered_by: list[int | None]
    """Per key, the index of the child that delivered it (None if none did)."""


def load_in_turn(
    children: Sequence[Child],
    keys: Sequence[BlockKey],
    ids: Sequence[int],
    source: Address | None,
    deadline: float,
    on_late: LateHook | None = None,
) -> Delivery:
    """Each key from the first child, in order, that delivers it.

    A key a child does not have, or fails (error, timeout, checksum
    mismatch), is asked of the next child, which overwrites whatever the
    failed attempt left in its block. A key no child delivers ends
    ``missing`` if every child said so, else ``failed`` with every reason.
    ``on_late`` is passed to :meth:`Child.load` (staging memory uses it).
    """
    n = len(keys)
    outcomes: list[Outcome] = [MISSING] * n
    delivered: list[int | None] = [None] * n
    reasons: dict[int, list[str]] = {}  # only keys some child failed (a miss is no reason)
    pending = list(range(n))
    for child in children:
        if not pending:
            break
        if time.monotonic() >= deadline:
            for j in pending:
                why = f"{child.label}: not tried, the multi's deadline passed"
                reasons.setdefault(j, []).append(why)
            break
        whole = len(pending) == n  # pending is then range(n): the request as given
        result = child.load(
            keys if whole else [keys[j] for j in pending],
            ids if whole else [ids[j] for j in pending],
            source,
            deadline,
            on_late,
        )
        if plainly_ok(result.outcomes, len(pending)):  # the usual: it delivered them all
            if whole:
                outcomes, delivered = [OK] * n, [child.index] * n
            else:
                for j in pending:
                    outcomes[j], delivered[j] = OK, child.index
            _count_fallbacks(child, sum(j in reasons for j in pending) if reasons else 0)
            pending = []
            break
        still: list[int] = []
        fallbacks = 0
        for j, outcome in zip(pending, result.outcomes, strict=True):
            status = outcome.status
            if status is Status.OK:
                outcomes[j], delivered[j] = OK, child.index
                fallbacks += j in reasons
                continue
            if status is Status.FAILED:
                reasons.setdefault(j, []).append(outcome.reason or f"{child.label}: failed")
            still.append(j)
        _count_fallbacks(child, fallbacks)
        pending = still
    for j in pending:
        if j in reasons:
            outcomes[j] = failed("; ".join(reasons[j]))
    return Delivery(outcomes, delivered)


def _count_fallbacks(child: Child, n: int) -> None:
    if n:
        child.count("fallbacks", n)


def save_to_all(
    children: Sequence[Child], keys: Sequence[BlockKey], ids: Sequence[int], deadline: float
) -> list[Outcome]:
    """Save to every child at once; a key is ok once any child stored it."""
    attempts = [child.start_save(keys, ids) for child in children]
    results = [attempt.finish(deadline) for attempt in attempts]
    if any(plainly_ok(result.outcomes, len(keys)) for result in results):
        return [OK] * len(keys)  # the usual case: one child (at least) stored all
    outcomes: list[Outcome] = []
    for j in range(len(keys)):
        mine = [result.outcomes[j] for result in results]
        if any(o.ok for o in mine):
            outcomes.append(OK)
        else:
            outcomes.append(failed("; ".join(o.reason or "failed" for o in mine)))
    return outcomes
