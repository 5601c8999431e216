"""A blocking library call, waited for no longer than kvmux promised to wait.

Several stores' Python clients (Mooncake Store, LMCache's remote tier) block in
C++ or in their own retry loops with no timeout of their own: over a cut link
a read can sit for minutes, far past the deadline a kvmux load was given. A
thread cannot be cancelled, so :func:`bounded_call` runs the call in a daemon
thread of its own and stops *waiting* at the deadline.

Caveat (late writes): the abandoned thread is left to finish. Whatever it
returns is discarded, but a call that writes into caller memory (a read into
KV blocks) may still write there after the deadline. The caller must then
report those target blocks failed, so the engine recomputes them and no one
trusts their contents.

Caveat (late frees): what the abandoned call uses (a client, an engine and the
memory it hands out) must outlive it. :class:`Outstanding` counts such calls,
so their owner frees those things only once the calls have ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from kvmux.errors import TransferTimeout

T = TypeVar("T")


def bounded_call(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()``'s result (or its exception), waiting at most ``timeout_s`` seconds;
    past that, :class:`~kvmux.errors.TransferTimeout` naming ``what``, and ``fn``
    goes on in its thread unobserved (see the module's late-write caveat)."""
    done: Future[T] = Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # handed to the waiting caller
            done.set_exception(exc)

    threading.Thread(target=call, name=f"kvmux-bounded: {what}"[:60], daemon=True).start()
    try:
        return done.result(timeout=max(timeout_s, 0.0))
    except TimeoutError:
        if done.done() and done.exception() is not None:  # fn itself timed out
            raise
        raise TransferTimeout(f"{what} took over {timeout_s:.3g} s") from None


class Outstanding:
    """The calls of one owner that may still run after their caller stopped waiting
    (:func:`bounded_call` abandoned them). Thread-safe.

    Why: LMCache's engine, destroyed by its backend's ``close`` while an abandoned
    retrieve was still copying out of the memory objects it had handed out,
    crashed the process (SIGSEGV in the retrieve's copy, seen in CI)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0

    def track(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn``, counted from now (in the caller's thread, so an owner that checks
        after this call sees it) until it returns or raises, wherever it runs."""
        with self._cond:
            self._running += 1

        def tracked() -> T:
            try:
                return fn()
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

        return tracked

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every tracked call to end; True if none runs."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running == 0, timeout_s)

    @property
    def running(self) -> int:
        with self._cond:
            return self._running
