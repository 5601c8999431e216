"""A circuit breaker per child: stop calling a backend that keeps failing.

Without one, a dead remote store costs every transfer its full timeout
before the multi falls back to the next child. The breaker opens after
``failures`` consecutive failed calls; while open the child is skipped at
no cost. Once ``cooldown_s`` has passed, the next call asks the child's
``health()``: healthy lets calls through again (half-open) and the first
call's result closes or reopens the breaker; unhealthy restarts the cooldown.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field


class BreakerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    failures: int = Field(
        3, ge=1, description="consecutive failed calls that open a child's breaker"
    )
    cooldown_s: float = Field(
        5.0, gt=0, description="how long an open breaker skips its child before probing health()"
    )


class BreakerState(enum.IntEnum):
    """Also the value exported in stats (``child.<i>.breaker_state``)."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Thread-safe. ``allow()`` before a call, ``record(ok)`` after it."""

    def __init__(
        self,
        config: BreakerConfig,
        probe: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self.opens = 0
        """How many times the breaker has opened."""

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether the child may be called now; may probe its health (outside the lock,
        one caller at a time) when an open breaker's cooldown is over."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return True
            if self._probing or self._clock() - self._opened_at < self.config.cooldown_s:
                return False
            self._probing = True
        try:
            healthy = self._probe()
        except Exception:  # a health check that raises is a sick child
            healthy = False
        with self._lock:
            self._probing = False
            if healthy:
                self._state = BreakerState.HALF_OPEN
            else:
                self._opened_at = self._clock()
            return healthy

    def record(self, ok: bool) -> None:
        """Count one finished call: success closes, failures may open."""
        with self._lock:
            if ok:
                self._state = BreakerState.CLOSED
                self._consecutive = 0
                return
            self._consecutive += 1
            if self._state is BreakerState.OPEN:
                return  # a late result of a call made before the breaker opened
            if self._state is BreakerState.HALF_OPEN or self._consecutive >= self.config.failures:
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self.opens += 1
