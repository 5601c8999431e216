"""LookupBuffer: the middle plug-in level, a keyed store of tensors.

``insert`` never blocks; ``drop_select`` waits for a key to arrive (or times
out) and removes it, so a producer and a consumer meet through keys instead of
through order. Databases, key-value stores and caches fit here; wrap one in
:class:`kvmux.bridges.BufferBackend` to use it as a Connector.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from kvmux.backend import Health
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.keys import BlockKey


class LookupBuffer(ABC):
    config_model: ClassVar[type[BackendConfig]] = BackendConfig
    capabilities: ClassVar[Capabilities] = Capabilities(consumes_on_load=True)

    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    @abstractmethod
    def insert(self, key: BlockKey, tensor: torch.Tensor) -> None:
        """Store ``tensor`` under ``key`` without waiting for a reader. The buffer
        owns ``tensor`` afterwards; the caller will not modify it."""

    @abstractmethod
    def drop_select(self, key: BlockKey, timeout: float) -> torch.Tensor | None:
        """Remove and return the tensor under ``key``, waiting up to ``timeout``
        seconds for it to be inserted; None if it never came."""

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether ``drop_select(key)`` would return at once."""

    def count_leading(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` ``contains`` would confirm. Override it when
        the buffer can answer for many keys in one round trip."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                return i
        return len(keys)

    def address(self) -> dict[str, Any] | None:
        """Where a remote peer reaches this buffer, if it is one end of a channel."""
        return None

    def connect(self, address: Mapping[str, Any]) -> None:
        """Attach to the peer buffer at ``address`` (channel-like buffers only)."""
        raise NotImplementedError(f"{type(self).__name__} does not connect to peers")

    def health(self) -> Health:
        """Whether the store answers. Override where that can be asked (a remote master)."""
        return Health(True)

    @abstractmethod
    def close(self) -> None:
        """Release resources. Idempotent."""
