"""Deterministic choices for fault injection, independent of timing and threads."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from kvmux.keys import BlockKey


def unit(seed: int, *parts: bytes) -> float:
    """A number in [0, 1) fixed by ``seed`` and ``parts`` (a keyed hash, not an RNG
    stream, so the answer for one key does not depend on which keys came before)."""
    h = hashlib.blake2b(seed.to_bytes(8, "little", signed=True), digest_size=8)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little") / 2**64


@dataclass(frozen=True)
class KeyChoice:
    """Which keys a fault hits: every key in ``keys``, plus a ``rate`` fraction of the
    rest, chosen by a hash of ``seed`` and the key. The default hits nothing."""

    rate: float = 0.0
    keys: frozenset[BlockKey] = frozenset()
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")

    @classmethod
    def of(cls, rate: float, keys: Iterable[BlockKey], seed: int) -> KeyChoice:
        return cls(rate, frozenset(keys), seed)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, BlockKey):
            return False
        return key in self.keys or unit(self.seed, b"choose", key.digest) < self.rate
