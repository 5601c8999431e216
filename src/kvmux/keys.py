"""Block keys: what names a block of KV cache across instances.

A key is a chained content hash (the hash of a block's tokens and of its
parent's key), so equal keys mean equal prefixes; the namespace separates
models, dtypes and layouts that must never exchange blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import NamedTuple, Self

import numpy as np

DIGEST_SIZE = 32


class _KeyFields(NamedTuple):
    digest: bytes
    namespace: str


class BlockKey(_KeyFields):
    """Identity of one KV block. Immutable, hashable, cheap to compare.

    ``digest`` is opaque bytes (an engine's block hash works as is);
    ``namespace`` is a short string such as ``"llama-8b/bf16/tp0"``. A tuple
    underneath, because lookups test thousands of keys per call and C-level
    hashing and equality make that 5x faster than a dataclass.
    """

    __slots__ = ()

    def __new__(cls, digest: bytes, namespace: str = "") -> BlockKey:
        if not isinstance(digest, bytes) or not digest:
            raise TypeError("BlockKey.digest must be non-empty bytes")
        if not isinstance(namespace, str):
            raise TypeError("BlockKey.namespace must be a str")
        return super().__new__(cls, digest, namespace)

    @classmethod
    def unchecked_batch(cls, digests: list[bytes], namespace: str) -> list[Self]:
        """The keys of these ``digests``, all in ``namespace``, built without
        ``__new__``'s checks: for fields already validated as a whole
        (:mod:`kvmux.net.messages` checks a request of thousands of keys once).
        ``map`` builds the tuples, so no Python code runs per key."""
        return list(map(tuple.__new__, repeat(cls), zip(digests, repeat(namespace))))

    @property
    def id(self) -> str:
        """A filesystem- and wire-safe string form: ``namespace:hexdigest``."""
        return f"{self.namespace}:{self.digest.hex()}"

    @classmethod
    def from_id(cls, text: str) -> BlockKey:
        namespace, _, hexdigest = text.rpartition(":")
        return cls(bytes.fromhex(hexdigest), namespace)

    @classmethod
    def child(cls, parent: BlockKey | None, content: bytes, namespace: str = "") -> BlockKey:
        """The key of a block whose content follows ``parent`` (None for the first)."""
        h = hashlib.blake2b(digest_size=DIGEST_SIZE)
        if parent is not None:
            h.update(parent.digest)
        h.update(content)
        return cls(h.digest(), parent.namespace if parent is not None else namespace)

    def __repr__(self) -> str:
        ns = f"{self.namespace}:" if self.namespace else ""
        return f"BlockKey({ns}{self.digest.hex()[:12]})"


def chain_keys(token_ids: Sequence[int], block_size: int, namespace: str = "") -> list[BlockKey]:
    """Keys of every *full* block of ``token_ids``, each chained to the one before.

    A trailing partial block has no key: block-granular backends never store it.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = BlockKey.child(
            parent, token_bytes(token_ids[start : start + block_size]), namespace
        )
        keys.append(parent)
    return keys


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The bytes a block key hashes for these tokens: each id as 8 bytes, little-endian.

    numpy does the packing: keying a 2,000-token prompt is on vLLM's scheduling path.
    """
    return np.asarray(token_ids, dtype="<i8").tobytes()


def check_unique(keys: Iterable[BlockKey]) -> None:
    """Raise ValueError naming the first key that repeats."""
    batch = list(keys)
    if len(set(batch)) == len(batch):  # the usual case, at C speed
        return
    seen: set[BlockKey] = set()
    for key in batch:
        if key in seen:
            raise ValueError(f"duplicate key in one call: {key!r}")
        seen.add(key)
