"""ConnectorWrapper: a Connector that forwards every call to another one.

Fault injectors subclass it and override the one step they spoil. Because
the wrapper goes through the inner connector's *public* methods, the inner
backend still checks its arguments, keeps its stats and runs its real code;
only the result the caller sees is altered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from kvmux.connector import Address, Connector
from kvmux.errors import TransferTimeout
from kvmux.handle import Handle, Outcome, TransferResult, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.wrapping import WrappingConnector

Forward = Callable[[list[BlockKey], list[int]], Handle]


class ConnectorWrapper(WrappingConnector):
    """Delegates to ``inner``; may wrap an instance that is already registered.

    ``stats()`` is the inner backend's overlaid with what callers of the wrapper
    saw (its own save/load counters and ``injected_*`` counts)."""

    max_workers = 8

    def __init__(self, inner: Connector) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.capabilities = inner.capabilities
        if inner.layout is not None:  # wrapping a registered connector: adopt its memory
            self.layout, self._copier = inner.layout, inner.copier
        self._stop = threading.Event()
        """Set by close(): wakes injected sleeps so closing never waits them out."""

    @property
    def wait_s(self) -> float:
        """How long the wrapper waits for the inner connector before failing its keys."""
        return self.config.timeout_s + 1.0

    # -------------------------------------------------------------- delegation

    def _register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        self.inner.register(layout, caches)

    def _save(self, keys: list[BlockKey], block_ids: list[int]) -> Handle:
        return self.inner.save(keys, block_ids)

    def _load(self, keys: list[BlockKey], block_ids: list[int], source: Address | None) -> Handle:
        return self.inner.load(keys, block_ids, source)

    def _close(self) -> None:
        self._stop.set()
        super()._close()

    # ----------------------------------------------------------------- helpers

    def _await(self, handle: Handle) -> TransferResult:
        """The inner result; an inner hang becomes a per-key failure, as the contract says."""
        try:
            return handle.result(timeout=self.wait_s)
        except TransferTimeout:
            reason = f"inner connector did not finish within {self.wait_s:.1f} s"
            return TransferResult(handle.keys, tuple(failed(reason) for _ in handle.keys))

    def _split(
        self,
        keys: Sequence[BlockKey],
        block_ids: Sequence[int],
        injected: Sequence[Outcome | None],
        forward: Forward,
    ) -> Handle:
        """Report ``injected[i]`` for key ``i`` where it is set; forward the others
        (in one batch, order kept) and merge the inner outcomes back in place."""
        passed = [i for i, o in enumerate(injected) if o is None]
        handle = forward([keys[i] for i in passed], [block_ids[i] for i in passed])

        def work() -> tuple[list[Outcome], int]:
            inner = self._await(handle)
            got = dict(zip(passed, inner.outcomes, strict=True))
            outcomes = [o if o is not None else got[i] for i, o in enumerate(injected)]
            return outcomes, inner.nbytes

        return self._run(keys, work)
