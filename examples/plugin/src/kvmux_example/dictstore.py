"""``dictstore``: blocks in a Python dict. The smallest complete kvmux Connector.

Written as a third party would write one: subclass ``Connector``, declare a
config model and capabilities, implement ``_lookup``, ``_save`` and
``_load``. The base class checks arguments, keeps stats and turns exceptions
inside ``_run`` work into per-key failures.
"""

from __future__ import annotations

import threading

import torch

from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.connector import Address, Connector
from kvmux.handle import MISSING, OK, Handle, Outcome
from kvmux.keys import BlockKey


class DictStoreConfig(BackendConfig):
    backend: str = "dictstore"


class DictStoreConnector(Connector):
    """In-process store: not persistent, not bounded, not P2P (the defaults)."""

    config_model = DictStoreConfig
    capabilities = Capabilities()

    def __init__(self, config: DictStoreConfig) -> None:
        super().__init__(config)
        self._blocks: dict[BlockKey, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        with self._lock:
            return next((i for i, key in enumerate(keys) if key not in self._blocks), len(keys))

    def _save(self, keys: list[BlockKey], block_ids: list[int]) -> Handle:
        def work() -> tuple[list[Outcome], int]:
            rows = self.copier.gather(block_ids)  # a copy: the engine may reuse the blocks
            with self._lock:
                self._blocks.update(zip(keys, rows.unbind(0), strict=True))
            return [OK] * len(keys), rows.numel()

        return self._run(keys, work)

    def _load(self, keys: list[BlockKey], block_ids: list[int], source: Address | None) -> Handle:
        def work() -> tuple[list[Outcome], int]:
            with self._lock:
                found = [self._blocks.get(key) for key in keys]
            hits = [
                (block, row) for block, row in zip(block_ids, found, strict=True) if row is not None
            ]
            if hits:
                self.copier.copy_in([b for b, _ in hits], torch.stack([r for _, r in hits]))
            return [OK if row is not None else MISSING for row in found], len(
                hits
            ) * self.copier.block_nbytes

        return self._run(keys, work)

    def _release(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._blocks.pop(key, None)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**super().stats(), "blocks_stored": len(self._blocks)}

    def _close(self) -> None:
        with self._lock:
            self._blocks.clear()
