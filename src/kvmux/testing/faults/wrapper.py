"""FaultWrapper: the base of the fault injectors, a backend over the backend under test.

Each injector overrides the one step it spoils. The wrapped backend runs its
real code through its own runner (see :class:`~kvmux.wrapping.WrappingBackend`),
so it keeps its threads and its stats; only the result the caller sees is
altered. Put a :class:`~kvmux.connector.Connector` in front to use one:
``Connector(DropKeys(conn.backend, rate=0.5))``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvmux.backend import Backend
from kvmux.handle import Handle, Outcome
from kvmux.keys import BlockKey
from kvmux.wrapping import WrappingBackend

Forward = Callable[[list[BlockKey], list[int]], Handle]


class FaultWrapper(WrappingBackend):
    """Delegates to ``inner``; may wrap a backend that is already registered.

    ``stats()`` is the inner backend's overlaid with what callers of the wrapper
    saw (its own save/load counters and ``injected_*`` counts)."""

    workers = 8

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._stop = threading.Event()
        """Set by close(): wakes injected sleeps so closing never waits them out."""

    def close(self) -> None:
        self._stop.set()
        super().close()

    def split(
        self,
        keys: Sequence[BlockKey],
        block_ids: Sequence[int],
        injected: Sequence[Outcome | None],
        forward: Forward,
        deadline: float,
    ) -> list[Outcome]:
        """Report ``injected[i]`` for key ``i`` where it is set; forward the others
        (in one batch, order kept) and merge the inner outcomes back in place."""
        passed = [i for i, o in enumerate(injected) if o is None]
        if not passed:
            return [o for o in injected if o is not None]
        handle = forward([keys[i] for i in passed], [block_ids[i] for i in passed])
        got = dict(zip(passed, self.outcomes(handle, deadline), strict=True))
        return [o if o is not None else got[i] for i, o in enumerate(injected)]
