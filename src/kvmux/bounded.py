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
