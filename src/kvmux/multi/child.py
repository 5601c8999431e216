"""One child of a MultiBackend, as its policy sees it: isolated, timed, counted.

Policies never call a child backend directly. Through :class:`Child`, a
child that raises, hangs past its own ``timeout_s`` or sits behind an open
circuit breaker simply yields ``failed`` outcomes (or a lookup of 0), so a
policy only ever reasons about per-key outcomes, and one sick child cannot
take the others down. Each child keeps its own counters for ``stats()``.

A child backend runs through a :class:`~kvmux.runner.Runner` of its own, as
it would behind a connector: its transfers keep their threads, lanes and
stats. The multi's front checked the request once; the parts a policy
passes on are not checked again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvmux.backend import Address, Backend, Health
from kvmux.capabilities import Capabilities
from kvmux.errors import TransferTimeout
from kvmux.handle import OK, Handle, Outcome, Status, TransferResult, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.multi.breaker import BreakerConfig, CircuitBreaker
from kvmux.runner import Runner

log = logging.getLogger(__name__)

Operation = Literal["save", "load"]

LateHook = Callable[[Handle], None]
"""Called with the handle of a transfer given up on for its deadline, still in flight."""

COUNTERS = (
    "hits",
    "misses",
    "saved",
    "failures",
    "bytes",
    "latency_s",
    "calls",
    "errors",
    "timeouts",
    "skipped",
    "fallbacks",
    "promotions",
    "demotions",
    "evictions",
)
"""Per-child counters, exported as ``child.<i>.<name>`` (always present, 0 until used).

``hits``/``misses``: keys a load from this child delivered / did not find
(a ``tiered`` multi's own reads, to demote a block, included);
``saved``: keys it stored; ``failures``: keys it failed (either way);
``errors``/``timeouts``: calls that raised / overran the child's deadline;
``skipped``: calls not made because its breaker was open; ``fallbacks``:
keys it delivered after an earlier child failed them; ``promotions``,
``demotions``, ``evictions``: keys moved into, moved into from above, and
evicted from this tier (``tiered``)."""


def plainly_ok(outcomes: Sequence[Outcome], n: int) -> bool:
    """True if there are ``n`` outcomes and each is ``OK``, decided at C speed for
    the usual :data:`~kvmux.handle.OK` singletons: a tuple comparison, which stops
    at the first other outcome. False means "not that, or not plainly": callers
    then look at each outcome, so this only ever spares them that walk."""
    return tuple(outcomes) == (OK,) * n


@dataclass
class Attempt:
    """A save or load started on one child; ``finish`` waits for it within the deadlines."""

    child: Child
    op: Operation
    keys: tuple[BlockKey, ...]
    handle: Handle | None = None
    result: TransferResult | None = None
    started: float = field(default_factory=time.monotonic)

    def finish(self, deadline: float, on_late: LateHook | None = None) -> TransferResult:
        """The child's result, or every key failed if it does not answer within its own
        ``timeout_s`` or by ``deadline`` (monotonic). ``on_late`` is given the handle of
        a transfer that timed out: until it completes, it may still touch its blocks."""
        if self.result is not None:
            return self.result
        assert self.handle is not None
        own_deadline = self.started + self.child.timeout_s
        wait = min(own_deadline, deadline) - time.monotonic()
        try:
            result = self.handle.result(timeout=max(wait, 0.0))
        except TransferTimeout:
            self.child.timed_out(self.op, self.handle, on_late)
            reason = (
                f"no answer within its timeout_s={self.child.timeout_s:g}"
                if own_deadline <= deadline
                else "no answer before the multi's own deadline"
            )
            return self.child.all_failed(self.keys, reason)
        self.child.record(self.op, result)
        return self.child.labelled(result)


class Child:
    """A child backend behind isolation, a circuit breaker and counters. Thread-safe."""

    def __init__(self, index: int, backend: Backend, breaker: BreakerConfig) -> None:
        self.index = index
        self.backend = backend
        self.label = f"child {index} ({backend.config.backend})"
        self.breaker = CircuitBreaker(breaker, self._healthy)
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)

    @property
    def runner(self) -> Runner:
        """Runs the child's transfers: its lanes, deadlines and stats (a runner holds
        nothing but its backend, so one whose backend is swapped, as a test's fault
        injector does, runs the new one)."""
        return Runner(self.backend)

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    @property
    def timeout_s(self) -> float:
        return self.backend.config.timeout_s

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0.0) + n

    # ------------------------------------------------------------------ calls

    def lookup(self, keys: Sequence[BlockKey], source: Address | None) -> int:
        """Leading keys this child holds; 0 when it is skipped or raises.

        Runs in the caller's thread, unbounded by the multi: a lookup is too
        frequent for a thread hop, so a child is trusted to honour its own
        ``timeout_s`` here, and its breaker stops asking one that does not."""
        if not keys or not self._admit():
            return 0
        try:
            found = self.runner.lookup(list(keys), self._source(source))
        except Exception as exc:  # isolation: one child's bug is that child's miss
            self.count("errors")
            self.breaker.record(False)
            log.debug("%s: lookup raised %s: %s", self.label, type(exc).__name__, exc)
            return 0
        self.breaker.record(True)
        return found

    def register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        self.runner.register(layout, caches)

    def start_save(self, keys: Sequence[BlockKey], ids: Sequence[int]) -> Attempt:
        """Start saving; ``keys`` and ``ids`` must be valid for the child as they are
        not checked again: a part of a request the multi checked, or staging slots,
        never keys or ids repeated."""
        runner, raised = self.runner, self._raised
        return self._start(
            "save", keys, lambda: runner.save(list(keys), list(ids), on_error=raised)
        )

    def start_load(
        self, keys: Sequence[BlockKey], ids: Sequence[int], source: Address | None
    ) -> Attempt:
        """Start loading; the same promise about ``keys`` and ``ids`` as ``start_save``."""
        own, runner, raised = self._source(source), self.runner, self._raised
        return self._start(
            "load", keys, lambda: runner.load(list(keys), list(ids), own, on_error=raised)
        )

    def save(self, keys: Sequence[BlockKey], ids: Sequence[int], deadline: float) -> TransferResult:
        return self.start_save(keys, ids).finish(deadline)

    def load(
        self,
        keys: Sequence[BlockKey],
        ids: Sequence[int],
        source: Address | None,
        deadline: float,
        on_late: LateHook | None = None,
    ) -> TransferResult:
        return self.start_load(keys, ids, source).finish(deadline, on_late)

    def release(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            self._quietly("release", lambda: self.backend.release(list(keys)))

    def publish(self, keys: Sequence[BlockKey], lease: str, lease_s: float) -> None:
        self._quietly("publish", lambda: self.backend.publish(list(keys), lease, lease_s))

    def renew(self, leases: Sequence[str], source: Address | None) -> None:
        self._quietly("renew", lambda: self.backend.renew(list(leases), self._source(source)))

    def unpublish(self, leases: Sequence[str], source: Address | None) -> None:
        self._quietly(
            "unpublish", lambda: self.backend.unpublish(list(leases), self._source(source))
        )

    def _quietly(self, what: str, call: Callable[[], None]) -> None:
        """Bookkeeping calls: a child that raises is counted, never propagated."""
        try:
            call()
        except Exception as exc:
            self.count("errors")
            log.debug("%s: %s raised %s: %s", self.label, what, type(exc).__name__, exc)

    def close(self) -> None:
        try:
            self.runner.close()
        except Exception as exc:
            log.warning("%s: close raised %s: %s", self.label, type(exc).__name__, exc)

    # ------------------------------------------------------------- bookkeeping

    def _start(
        self, op: Operation, keys: Sequence[BlockKey], call: Callable[[], Handle]
    ) -> Attempt:
        keys = tuple(keys)
        if not keys:
            return Attempt(self, op, keys, result=TransferResult((), ()))
        if not self._admit():
            return Attempt(self, op, keys, result=self.all_failed(keys, "skipped: breaker open"))
        try:
            handle = call()
        except Exception as exc:
            self.count("errors")
            self.breaker.record(False)
            reason = f"{type(exc).__name__}: {exc}"
            return Attempt(self, op, keys, result=self.all_failed(keys, reason))
        return Attempt(self, op, keys, handle=handle)

    def _raised(self, exc: Exception) -> None:
        """A transfer of the child raised: counted (its keys fail, as a result)."""
        self.count("errors")
        log.debug("%s: a transfer raised %s: %s", self.label, type(exc).__name__, exc)

    def _admit(self) -> bool:
        if self.breaker.allow():
            return True
        self.count("skipped")
        return False

    def record(self, op: Operation, result: TransferResult) -> None:
        """Fold a finished transfer into the counters and the breaker."""
        if plainly_ok(result.outcomes, len(result.outcomes)):
            statuses = Counter({Status.OK: len(result.outcomes)})
        else:
            statuses = Counter(o.status for o in result.outcomes)
        with self._lock:
            counts = self._counts
            if op == "load":
                counts["hits"] += statuses[Status.OK]
                counts["misses"] += statuses[Status.MISSING]
            else:
                counts["saved"] += statuses[Status.OK]
            counts["failures"] += statuses[Status.FAILED]
            counts["bytes"] += result.nbytes
            counts["latency_s"] += result.seconds
            counts["calls"] += 1
        # A child that answers (even "missing") is alive; one that fails every key is not.
        self.breaker.record(statuses[Status.OK] > 0 or statuses[Status.FAILED] == 0)

    def timed_out(self, op: Operation, handle: Handle, on_late: LateHook | None) -> None:
        self.count("timeouts")
        self.breaker.record(False)
        if op == "save":
            # Its source blocks may be reused by now: whatever it stores late is suspect.
            handle.add_done_callback(lambda late: self.release(late.by_status(Status.OK)))
        if on_late is not None:
            on_late(handle)

    def all_failed(self, keys: Sequence[BlockKey], reason: str) -> TransferResult:
        outcome = failed(f"{self.label}: {reason}")
        return TransferResult(tuple(keys), (outcome,) * len(keys))

    def labelled(self, result: TransferResult) -> TransferResult:
        """``result`` with each failure's reason saying which child failed."""
        if plainly_ok(result.outcomes, len(result.outcomes)) or all(
            o.status is not Status.FAILED for o in result.outcomes
        ):
            return result
        outcomes: tuple[Outcome, ...] = tuple(
            failed(f"{self.label}: {o.reason}") if o.status is Status.FAILED else o
            for o in result.outcomes
        )
        return TransferResult(result.keys, outcomes, result.nbytes, result.seconds)

    def _source(self, source: Address | None) -> Address | None:
        """This child's part of a multi's address (see ``MultiBackend.address``)."""
        if source is None:
            return None
        parts = source.get("children")
        if isinstance(parts, list) and self.index < len(parts):
            own: Address | None = parts[self.index]
            return own
        return source

    def health(self) -> Health:
        if self.backend.closed:
            return Health(False, "closed")
        return self.backend.health()

    def _healthy(self) -> bool:
        return self.health().healthy

    def stats(self) -> dict[str, float]:
        prefix = f"child.{self.index}."
        with self._lock:
            out = {prefix + name: value for name, value in self._counts.items()}
        out[prefix + "breaker_state"] = float(self.breaker.state)
        out[prefix + "breaker_opens"] = float(self.breaker.opens)
        try:
            own = self.runner.stats()
        except Exception:  # stats are best effort; a broken child still reports ours
            own = {}
        out.update({f"{prefix}backend.{name}": value for name, value in own.items()})
        return out
