"""Faults in *what* arrives: blocks that vanish, and blocks that arrive damaged."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvmux.backend import Address, Backend
from kvmux.handle import MISSING, Outcome, Status
from kvmux.keys import BlockKey
from kvmux.testing.faults.choice import KeyChoice, unit
from kvmux.testing.faults.wrapper import FaultWrapper


class DropKeys(FaultWrapper):
    """Chosen keys are reported ``missing`` by ``load`` and never reach the backend.

    By default ``lookup`` still counts them, which models the common race: the
    store said it had the block, then lost it (evicted, expired) before the
    load. With ``on_lookup=True`` they vanish from lookups too.
    """

    def __init__(
        self,
        inner: Backend,
        *,
        rate: float = 0.0,
        keys: Iterable[BlockKey] = (),
        seed: int = 0,
        on_lookup: bool = False,
    ) -> None:
        super().__init__(inner)
        self.choice = KeyChoice.of(rate, keys, seed)
        self.on_lookup = on_lookup

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        if self.on_lookup:
            keys = keys[: next((i for i, k in enumerate(keys) if k in self.choice), len(keys))]
            if not keys:
                return 0
        return super().lookup(keys, source)

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> Sequence[Outcome]:
        injected: list[Outcome | None] = [MISSING if k in self.choice else None for k in keys]
        self.counters.add("injected_dropped", sum(o is not None for o in injected))
        return self.split(
            keys,
            block_ids,
            injected,
            lambda ks, bs: self.inner_runner.load(ks, bs, source, deadline),
            deadline,
        )


class CorruptBytes(FaultWrapper):
    """Loads of chosen keys complete ``ok`` but with ``nbytes`` bytes of the block inverted.

    This models a transport that damages data without noticing (a bad NIC, a
    torn read of memory being reused, a buggy peer). The outcome deliberately
    stays ``ok``: the point is to check that an *integrity* layer above (per-block
    checksums, the MultiConnector's verification) catches what the transport
    did not. Keys are chosen like ``DropKeys``'s (``keys`` and/or ``rate``;
    ``rate=1.0`` hits every load); byte positions depend only on ``seed`` and the key.
    """

    def __init__(
        self,
        inner: Backend,
        *,
        rate: float = 0.0,
        keys: Iterable[BlockKey] = (),
        seed: int = 0,
        nbytes: int = 1,
    ) -> None:
        super().__init__(inner)
        if nbytes < 1:
            raise ValueError(f"nbytes must be at least 1, got {nbytes}")
        self.choice = KeyChoice.of(rate, keys, seed)
        self.seed = seed
        self.nbytes = nbytes

    def positions(self, key: BlockKey) -> list[int]:
        """The byte offsets inside the block that a load of ``key`` damages."""
        size = self.copier.block_nbytes
        digest = key.digest
        return sorted(
            {
                int(unit(self.seed, b"byte", digest, bytes([i])) * size)
                for i in range(min(self.nbytes, size))
            }
        )

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> Sequence[Outcome]:
        outcomes = super().load(keys, block_ids, source, deadline)
        for key, block, outcome in zip(keys, block_ids, outcomes, strict=True):
            if outcome.status is Status.OK and key in self.choice:
                self._damage(key, block)
        return outcomes

    def _damage(self, key: BlockKey, block: int) -> None:
        row = self.copier.gather([block])
        where = torch.tensor(self.positions(key), dtype=torch.long)
        row[0, where] = torch.bitwise_not(row[0, where])
        self.copier.copy_in([block], row)
        self.counters.add("injected_corrupted")
