"""PullTransport: how a served pool's blocks reach a consumer, one strategy per backend.

A served pool (:class:`~kvmux.pool.served.ServedPoolBackend`) is the same
store, server and puller for every backend; what differs is this strategy:
where the pool's memory lives (plain host memory, a shared segment, memory
registered with NIXL or a Transfer Engine), which requests its server answers
beyond lookups and lease notices, and the consumer's half of one pull. ``tcp``
streams bytes over the socket (:mod:`kvmux.backends.tcp`); the pinned
transports locate, pin and then move them (:mod:`kvmux.pool.pinned`).

Each transport instance serves one backend instance, both as producer (its
``handlers`` run on the server's connection threads) and as consumer
(``pull`` runs on the backend's lanes): everything it touches from both
must be thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from kvmux.blocks import BlockCopier
from kvmux.errors import NotRegisteredError
from kvmux.handle import Outcome
from kvmux.keys import BlockKey
from kvmux.net.client import Link
from kvmux.net.messages import Message, Service
from kvmux.net.server import Handler, Session
from kvmux.pool.config import ServedPoolConfig
from kvmux.pool.peer import PeerAddress
from kvmux.pool.store import BeforeOverwrite, PoolStore

Refusal = Callable[[Session], bool]
"""The server's per-request layout check: True (and the peer told why) when the
session must not receive blocks."""


class PullTransport(ABC):
    """One backend's data path; see the module docstring."""

    service: ClassVar[Service]
    """The name both ends announce at the handshake (a ``tcp`` client cannot join
    an ``shm`` server)."""
    same_host: ClassVar[bool] = False
    """Whether every peer is on this host: then the server also listens on an
    abstract Unix socket, which consumers dial first (:mod:`kvmux.net.local`)."""

    def __init__(self, config: ServedPoolConfig, store: PoolStore) -> None:
        self.config = config
        self.store = store
        self._copier: BlockCopier | None = None

    @property
    def copier(self) -> BlockCopier:
        if self._copier is None:
            raise NotRegisteredError(f"{type(self).__name__}: not registered")
        return self._copier

    # ------------------------------------------------------------------ memory

    def register(self, blocks: BlockCopier) -> None:
        """The engine's KV memory, before the pool is made: refuse what this
        transport cannot move (raise), register what it reads into. Extend, calling
        this first."""
        self._copier = blocks

    @abstractmethod
    def make_pool(self, slots: int, block_nbytes: int) -> torch.Tensor:
        """The ``[slots, block_nbytes]`` uint8 pool, where peers can reach it."""

    before_overwrite: BeforeOverwrite | None = None
    """Hook: told the pool rows a save is about to write, before any byte changes
    (under the store's lock). None: nobody needs to know."""

    # ---------------------------------------------------------------- producer

    @abstractmethod
    def handlers(self, refused: Refusal) -> dict[type[Message], Handler]:
        """Server handlers for this transport's own requests; a handler that sends
        blocks asks ``refused(session)`` first."""

    def session_closed(self, session: Session) -> None:
        """Hook: a peer's connection ended (end what it held)."""

    # ---------------------------------------------------------------- consumer

    @abstractmethod
    def pull(
        self, link: Link, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]:
        """One request's worth of a remote load over ``link``: per-key outcomes.
        Raises TransferError if the exchange failed, ``PullInterrupted`` if it
        failed after some keys had their final outcome."""

    def check_peer(self, peer: PeerAddress) -> None:
        """Hook: refuse a peer this transport cannot reach (raise TransferError)."""

    def forget_peer(self, endpoint: tuple[str, int]) -> None:
        """Hook: drop anything cached for the peer at ``endpoint`` (it failed, or a new
        incarnation of it answers there now)."""

    # ------------------------------------------------------------------ public

    def address(self) -> dict[str, Any]:
        """What peers need beyond host and port (an agent name, an RPC port)."""
        return {}

    def stats(self) -> dict[str, float]:
        """This transport's own levels."""
        return {}

    def close(self) -> None:
        """Hook: after the server and the puller have stopped."""
