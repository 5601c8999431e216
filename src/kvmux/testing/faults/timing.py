"""Faults in *when*: slow links, and backends that die (raise, fail, or hang)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

from kvmux.backend import Address, Backend, Health
from kvmux.errors import ClosedError, TransferError, TransferTimeout
from kvmux.handle import Outcome, failed
from kvmux.keys import BlockKey
from kvmux.testing.faults.choice import unit
from kvmux.testing.faults.wrapper import FaultWrapper


class Delay(FaultWrapper):
    """Each save and load starts ``seconds`` (plus up to ``jitter_s``) late; lookups
    take ``lookup_s`` longer. The call itself returns at once, as a real async
    transfer does; only the handle completes late.

    Jitter is fixed per batch by ``seed`` and the batch's first key. At most
    ``workers`` delayed transfers wait at a time; more queue behind them.
    """

    def __init__(
        self,
        inner: Backend,
        seconds: float,
        *,
        jitter_s: float = 0.0,
        lookup_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(inner)
        if min(seconds, jitter_s, lookup_s) < 0:
            raise ValueError("delays must be >= 0")
        self.seconds, self.jitter_s, self.lookup_s, self.seed = seconds, jitter_s, lookup_s, seed

    def pause(self, keys: list[BlockKey]) -> float:
        """The delay a batch starting with ``keys[0]`` gets."""
        first = keys[0].digest if keys else b""
        return self.seconds + self.jitter_s * unit(self.seed, b"jitter", first)

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        if self.lookup_s and self._stop.wait(self.lookup_s):
            raise ClosedError("connector closed during an injected lookup delay")
        return super().lookup(keys, source)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> Sequence[Outcome]:
        return self._later(keys, lambda: super(Delay, self).save(keys, block_ids))

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> Sequence[Outcome]:
        return self._later(keys, lambda: super(Delay, self).load(keys, block_ids, source, deadline))

    def _later(
        self, keys: list[BlockKey], start: Callable[[], Sequence[Outcome]]
    ) -> Sequence[Outcome]:
        if self._stop.wait(self.pause(keys)):
            raise ClosedError("connector closed during an injected delay")
        self.counters.add("injected_delays")
        return start()


DeathMode = Literal["raise", "fail", "hang"]


class Die(FaultWrapper):
    """A backend that works for ``after_calls`` calls (lookups, saves, loads), then dies.

    ``mode`` says how a dead backend behaves:

    * ``"raise"`` - every call raises :class:`~kvmux.errors.TransferError` at once
      (a crashed client library; tests that callers isolate exceptions);
    * ``"fail"`` - ``lookup`` finds nothing and every transfer ends with all keys
      ``failed`` (a backend that catches its own errors);
    * ``"hang"`` - nothing answers until ``deadline_s`` (default: the config's
      ``timeout_s``) has passed; then lookups raise
      :class:`~kvmux.errors.TransferTimeout` and transfers fail every key. This
      is a hung transport inside a backend that honours its deadline.

    ``kill()`` and ``revive()`` switch it by hand (circuit-breaker tests).
    """

    def __init__(
        self,
        inner: Backend,
        *,
        mode: DeathMode = "fail",
        after_calls: int = 0,
        deadline_s: float | None = None,
    ) -> None:
        super().__init__(inner)
        if mode not in ("raise", "fail", "hang"):
            raise ValueError(f"mode must be 'raise', 'fail' or 'hang', got {mode!r}")
        self.mode = mode
        self.deadline_s = self.config.timeout_s if deadline_s is None else deadline_s
        self._budget: float = after_calls
        self._lock = threading.Lock()

    @property
    def dead(self) -> bool:
        with self._lock:
            return self._budget <= 0

    def kill(self) -> None:
        with self._lock:
            self._budget = 0

    def revive(self) -> None:
        with self._lock:
            self._budget = math.inf

    def _call_dies(self) -> bool:
        """Count one call; True if the backend is dead for it."""
        with self._lock:
            if self._budget > 0:
                self._budget -= 1
                return False
        self.counters.add("injected_deaths")
        return True

    def _reason(self) -> str:
        if self.mode == "hang":
            return f"injected fault: backend hung; gave up after {self.deadline_s:g} s"
        return "injected fault: backend died"

    def health(self) -> Health:
        if self.dead:
            return Health(False, self._reason())
        return super().health()

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        if not self._call_dies():
            return super().lookup(keys, source)
        if self.mode == "raise":
            raise TransferError(self._reason())
        if self.mode == "hang":
            self._stop.wait(self.deadline_s)
            raise TransferTimeout(self._reason())
        return 0

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> Sequence[Outcome]:
        if not self._call_dies():
            return super().save(keys, block_ids)
        return self._dead_transfer(keys, time.monotonic() + self.deadline_s)

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> Sequence[Outcome]:
        if not self._call_dies():
            return super().load(keys, block_ids, source, deadline)
        return self._dead_transfer(keys, time.monotonic() + self.deadline_s)

    def _dead_transfer(self, keys: list[BlockKey], until: float) -> list[Outcome]:
        """A dead backend's transfer: raises, fails at once, or (hung) fails at ``until``."""
        if self.mode == "raise":
            raise TransferError(self._reason())
        if self.mode == "hang":
            self._stop.wait(max(0.0, until - time.monotonic()))
        return [failed(self._reason())] * len(keys)
