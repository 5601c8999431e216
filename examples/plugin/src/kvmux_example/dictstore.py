"""``dictstore``: blocks in a Python dict. The smallest complete kvmux backend.

Written as a third party would write one: subclass ``Backend``, declare a
config model and capabilities, implement ``lookup``, ``save`` and ``load``.
Arguments arrive checked; the ``Connector`` in front runs the calls as
handles, keeps stats and turns exceptions into per-key failures.
"""

from __future__ import annotations

import threading

import torch

from kvmux.backend import Address, Backend
from kvmux.config import BackendConfig
from kvmux.handle import MISSING, OK, Outcome
from kvmux.keys import BlockKey


class DictStoreConfig(BackendConfig):
    backend: str = "dictstore"


class DictStoreBackend(Backend):
    """In-process store: not persistent, not bounded, not P2P (the default capabilities)."""

    config_model = DictStoreConfig
    inline = True  # saves and loads are memory copies: no thread hop

    def __init__(self, config: DictStoreConfig) -> None:
        super().__init__(config)
        self._blocks: dict[BlockKey, torch.Tensor] = {}
        self._lock = threading.Lock()

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        with self._lock:
            return next((i for i, key in enumerate(keys) if key not in self._blocks), len(keys))

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        rows = self.copier.gather(block_ids)  # a copy: the engine may reuse the blocks
        with self._lock:
            self._blocks.update(zip(keys, rows.unbind(0), strict=True))
        return [OK] * len(keys)

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]:
        with self._lock:
            found = [self._blocks.get(key) for key in keys]
        hits = [
            (block, row) for block, row in zip(block_ids, found, strict=True) if row is not None
        ]
        if hits:
            self.copier.copy_in([b for b, _ in hits], torch.stack([r for _, r in hits]))
        return [OK if row is not None else MISSING for row in found]

    def release(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._blocks.pop(key, None)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"blocks_stored": len(self._blocks)}
