"""Deliberately broken backends: each breaks one promise the conformance suite checks.

They are small subclasses of the working ``cpu`` pool (or ``disk``), so everything
except the one broken behaviour is right, and ``test_suite_has_teeth`` can show that
the suite fails exactly the tests about that behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict

from kvmux.backend import Address, Backend
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.backends.disk import DiskBackend, DiskConfig
from kvmux.capabilities import Capabilities
from kvmux.handle import MISSING, OK, Outcome, Status, failed
from kvmux.keys import BlockKey

POOL_BYTES = 2**20
"""Small pools register fast; the suite's capacity tests pass their own size."""


class CorruptsOnLoad(CpuPoolBackend):
    """Flips one byte of the first block of every load (a bad copy routine)."""

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]:
        outcomes = super().load(keys, block_ids, source, deadline)
        if block_ids and outcomes[0].ok:
            row = self.copier.gather(block_ids[:1])
            row[0, 7] ^= 0x01
            self.copier.copy_in(block_ids[:1], row)
        return outcomes


class CountsEveryHit(CpuPoolBackend):
    """``lookup`` counts every key it holds, ignoring prefix semantics."""

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        with self.store.lock:
            return sum(key in self.store.slots for key in keys)


class OkForMissing(CpuPoolBackend):
    """Reports ``ok`` for keys it does not have (leaving their blocks as they were)."""

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]:
        super().load(keys, block_ids, source, deadline)
        return [OK] * len(keys)


class ZeroesMissingBlocks(CpuPoolBackend):
    """Reports missing keys honestly but clears their blocks first (a scratch write)."""

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]:
        outcomes = super().load(keys, block_ids, source, deadline)
        for block, outcome in zip(block_ids, outcomes, strict=True):
            if outcome.status is Status.MISSING:
                zeros = torch.zeros(1, self.copier.block_nbytes, dtype=torch.uint8)
                self.copier.copy_in([block], zeros)
        return outcomes


class SavesByReference(CpuPoolBackend):
    """Remembers *where* a block was instead of copying it (a fake zero-copy save):
    round trips pass until the engine reuses the source block."""

    def __init__(self, config: CpuPoolConfig) -> None:
        super().__init__(config)
        self._where: dict[BlockKey, int] = {}

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        return next((i for i, k in enumerate(keys) if k not in self._where), len(keys))

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        self._where.update(zip(keys, block_ids, strict=True))
        return [OK] * len(keys)

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for key, block in zip(keys, block_ids, strict=True):
            if key not in self._where:
                outcomes.append(MISSING)
                continue
            self.copier.copy_in([block], self.copier.gather([self._where[key]]))
            outcomes.append(OK)
        return outcomes


class ForgetsOnReopen(CpuPoolBackend):
    """Declares ``persistent`` but keeps blocks in memory only."""

    capabilities = Capabilities(persistent=True, capacity_bound=True)


class FailsWhenFull(CpuPoolBackend):
    """Declares ``capacity_bound`` but fails saves once full instead of evicting."""

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        free = self.store.slots.slots - len(self.store.slots)
        fits = [k not in self.store.slots for k in keys]
        if sum(fits) <= free:
            return super().save(keys, block_ids)
        return [failed("pool is full")] * len(keys)


class LaxConfig(CpuPoolConfig):
    model_config = ConfigDict(extra="allow", frozen=True)


class AcceptsAnyConfig(CpuPoolBackend):
    """Its config model silently accepts unknown fields (a typo is never reported)."""

    config_model = LaxConfig


class TrustsItsFiles(DiskBackend):
    """``disk`` that never checks what it reads (its checksum forced off): declares
    ``file_backed``, and loads whatever bytes its files hold as ``ok``."""

    def __init__(self, config: DiskConfig) -> None:
        super().__init__(config.model_copy(update={"checksum": False}))


BROKEN: dict[str, type[Backend]] = {
    cls.__name__: cls
    for cls in (
        CorruptsOnLoad,
        CountsEveryHit,
        OkForMissing,
        ZeroesMissingBlocks,
        SavesByReference,
        ForgetsOnReopen,
        FailsWhenFull,
        AcceptsAnyConfig,
        TrustsItsFiles,
    )
}


def factory(name: str, tmp_path: Path) -> Callable[..., Backend]:
    """A suite ``connector_factory`` for the broken class ``name`` (or ``CpuPoolBackend``);
    a backend that stores files keeps them in ``tmp_path``."""
    cls = BROKEN.get(name, CpuPoolBackend)
    model = cls.config_model
    place = {"path": tmp_path / "store"} if "path" in model.model_fields else {}

    def make(**overrides: Any) -> Backend:
        fields = {"capacity_bytes": POOL_BYTES, "timeout_s": 5.0, **place, **overrides}
        return cls(model(**fields))

    return make
