"""Handles: the asynchronous result of a save or load, with one outcome per key.

A handle never raises for a failed transfer: each key ends ``ok``, ``missing``
(the backend does not have it) or ``failed`` (with a reason), so a caller can
recompute exactly the blocks that did not arrive. Only asking for a result
that is not ready yet within the caller's own timeout raises.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from kvmux.errors import TransferTimeout
from kvmux.keys import BlockKey


class Status(enum.StrEnum):
    OK = "ok"
    MISSING = "missing"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Status
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


OK = Outcome(Status.OK)
MISSING = Outcome(Status.MISSING)


def failed(reason: str) -> Outcome:
    return Outcome(Status.FAILED, reason)


@dataclass(frozen=True)
class TransferResult:
    """What happened to each key of one save or load, in the order they were given."""

    keys: tuple[BlockKey, ...]
    outcomes: tuple[Outcome, ...]
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    def by_status(self, status: Status) -> list[BlockKey]:
        return [k for k, o in zip(self.keys, self.outcomes, strict=True) if o.status is status]

    @property
    def not_ok(self) -> list[tuple[BlockKey, Outcome]]:
        return [(k, o) for k, o in zip(self.keys, self.outcomes, strict=True) if not o.ok]


@dataclass
class Handle:
    """A save or load in flight. ``poll`` never blocks; ``wait`` blocks at most ``timeout``."""

    keys: tuple[BlockKey, ...]
    _future: Future[TransferResult] = field(repr=False)

    @classmethod
    def completed(
        cls,
        keys: Sequence[BlockKey],
        outcomes: Sequence[Outcome],
        nbytes: int = 0,
        seconds: float = 0.0,
    ) -> Handle:
        fut: Future[TransferResult] = Future()
        fut.set_result(TransferResult(tuple(keys), tuple(outcomes), nbytes, seconds))
        return cls(tuple(keys), fut)

    @classmethod
    def from_call(
        cls,
        keys: Sequence[BlockKey],
        submit: Callable[[Callable[[], TransferResult]], Future[TransferResult]],
        work: Callable[[], Sequence[Outcome]],
        block_nbytes: int,
    ) -> Handle:
        """Run ``work`` through ``submit`` (an executor's); any exception it raises
        becomes a ``failed`` outcome on every key instead of escaping. The bytes
        moved are the ``ok`` keys' blocks of ``block_nbytes``."""
        keys = tuple(keys)

        def run() -> TransferResult:
            start = time.perf_counter()
            try:
                outcomes = work()
            except Exception as exc:
                outcomes = [failed(f"{type(exc).__name__}: {exc}")] * len(keys)
            if len(outcomes) != len(keys):
                outcomes = [failed("backend returned a wrong number of outcomes")] * len(keys)
            nbytes = outcomes.count(OK) * block_nbytes
            return TransferResult(keys, tuple(outcomes), nbytes, time.perf_counter() - start)

        return cls(keys, submit(run))

    def poll(self) -> bool:
        """True once the transfer has finished (successfully or not)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished or ``timeout`` seconds pass; True if finished."""
        try:
            self._future.result(timeout)
        except FutureTimeout:
            return False
        except CancelledError:
            pass
        return True

    def result(self, timeout: float | None = None) -> TransferResult:
        """The per-key result; raises TransferTimeout if not finished within ``timeout``."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TransferTimeout(
                f"transfer of {len(self.keys)} blocks not finished after {timeout} s"
            ) from None
        except CancelledError:  # it never ran: cancel(), or its connector closed first
            reason = failed("cancelled before the transfer ran")
            return TransferResult(self.keys, (reason,) * len(self.keys))

    def cancel(self) -> bool:
        """Drop a transfer that has not started yet (queued behind others): True if it
        never will run; its keys then end failed. One that is already moving bytes
        goes on to its own end, deadline included (until then its blocks are not the
        caller's to reuse), and this returns False."""
        return self._future.cancel()

    def add_done_callback(self, fn: Callable[[TransferResult], None]) -> None:
        self._future.add_done_callback(lambda _: fn(self.result()))
