"""Pipe: the lowest plug-in level, a point-to-point channel of tensors.

One endpoint listens (``address()`` says where), the other ``connect``s to it;
after that both ends may send and receive, each direction in FIFO order.
Before the peer attaches, send and receive wait for it (within their timeout). A
third party that can move bytes between two processes implements this and
gets a whole Connector from :class:`kvmux.bridges.PipeLookupBuffer` and
:class:`kvmux.bridges.BufferBackend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from kvmux.config import BackendConfig


class Pipe(ABC):
    config_model: ClassVar[type[BackendConfig]] = BackendConfig

    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    @abstractmethod
    def send_tensor(self, tensor: torch.Tensor | None) -> None:
        """Send one tensor (or None, a valid message of its own). Blocks until handed to
        the transport; raises TransferError if the peer is gone."""

    @abstractmethod
    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor | None:
        """The next tensor the peer sent, in order. Raises TransferTimeout after
        ``timeout`` seconds, TransferError if the peer is gone."""

    @abstractmethod
    def address(self) -> dict[str, Any]:
        """Where the peer endpoint connects to reach this one."""

    @abstractmethod
    def connect(self, address: Mapping[str, Any]) -> None:
        """Make this endpoint the connecting side of a pipe to ``address``."""

    @property
    @abstractmethod
    def connected(self) -> bool:
        """True once the other endpoint is attached."""

    @abstractmethod
    def close(self) -> None:
        """Release the channel; the peer's pending and later calls fail. Idempotent."""
