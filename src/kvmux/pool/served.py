"""ServedPoolBackend: a pool store, a server and a pull transport, put together.

Every instance is both a producer and a consumer. ``save`` copies blocks into
the store (as ``cpu`` does, so the engine may reuse its blocks once the
handle finishes); the server, started by ``register``, answers peers'
lookups and serves their pulls; ``load(source=None)`` reads the own pool
(the ``kv_both`` reuse case) and ``load(source=address)`` pulls from a peer
through the transport. A backend is this class with its config model,
capabilities and transport named (:mod:`kvmux.backends.tcp` and siblings).

With ``save_mode: borrow`` there is no pool: a save names the engine's
blocks, peers are served from the engine's KV memory itself, and the save's
handle ends once the blocks are given back (:mod:`kvmux.pool.lending`).

Until ``register`` there is no server: ``address()`` is None and peers
cannot reach the instance (nothing is stored yet anyway).
"""

from __future__ import annotations

import secrets
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, ClassVar

from kvmux.backend import Address, Backend, Health
from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.compat import Compat
from kvmux.handle import Outcome
from kvmux.keys import BlockKey
from kvmux.net.client import PeerClient
from kvmux.net.frames import Limits
from kvmux.net.handshake import Terms
from kvmux.net.messages import Release, Renew
from kvmux.pool.config import ServedPoolConfig
from kvmux.pool.peer import PeerAddress
from kvmux.pool.puller import Puller
from kvmux.pool.server import PoolServer
from kvmux.pool.store import PoolStore
from kvmux.pool.transport import PullTransport


class ServedPoolBackend(Backend):
    """A :class:`PoolStore` served by a :class:`PoolServer` and pulled from peers
    by a :class:`Puller` over ``transport``. Local saves and loads are memory
    copies (``inline``); a remote load runs on its peer's lane."""

    capabilities = Capabilities(p2p=True, capacity_bound=True)
    inline = True
    transport_type: ClassVar[type[PullTransport]]
    """The backend's data path, made once per instance."""
    config: ServedPoolConfig

    def __init__(self, config: ServedPoolConfig) -> None:
        super().__init__(config)
        if config.borrows_blocks:  # no pool to bound; the handles hold the blocks
            self.capabilities = replace(
                type(self).capabilities, borrows_blocks=True, capacity_bound=False
            )
        self.store = PoolStore(config.capacity_bytes, served=True, lend=config.borrows_blocks)
        self.transport = self.transport_type(config, self.store)
        self.incarnation = secrets.token_hex(16)
        """This instance, told apart from one restarted on its port (:mod:`kvmux.pool.peer`)."""
        self._terms = Terms(layout=None)
        """What this instance declares at handshakes; set by ``register``."""
        self._secret = config.secret.get_secret_value() if config.secret is not None else None
        self._limits = Limits(config.max_header_bytes, config.max_frame_bytes)
        client = PeerClient(
            service=self.transport.service,
            limits=self._limits,
            secret=self._secret,
            terms=lambda: self._terms,
            on_restart=self.transport.forget_peer,
        )
        self.puller = Puller(
            self.transport,
            client,
            timeout_s=config.timeout_s,
            counters=self.counters,
            lanes=self.lanes,
        )
        self.server: PoolServer | None = None

    def register(self, blocks: BlockCopier) -> None:
        """Register with the transport, make the pool, then start serving it."""
        self.transport.register(blocks)
        self.store.open(blocks, self.transport.make_pool, self.transport.before_overwrite)
        layout = blocks.layout
        self._terms = Terms(layout.fingerprint(), Compat.of(layout))
        self.server = PoolServer(
            self.config,
            self.store,
            self.transport,
            terms=self._terms,
            incarnation=self.incarnation,
            limits=self._limits,
            secret=self._secret,
        )

    # ---------------------------------------------------------------- transfers

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        if source is None:
            return self.store.lookup(keys)
        return self.puller.lookup(PeerAddress.parse(source), keys)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> Sequence[Outcome]:
        return self.store.save(keys, block_ids)

    def returned(self, block_ids: list[int]) -> Future[None] | None:
        return self.store.returned(block_ids)

    def lane(self, source: Address | None) -> Hashable:
        """A remote load runs on its peer's lane (:mod:`kvmux.lanes`): a peer that
        hangs delays nobody else's loads. A local one is a memory copy (inline)."""
        return None if source is None else PeerAddress.parse(source).endpoint

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> Sequence[Outcome]:
        if source is None:
            return self.store.load(keys, block_ids)
        return self.puller.load(PeerAddress.parse(source), keys, block_ids, deadline)

    def release(self, keys: list[BlockKey]) -> None:
        self.store.release(keys)

    # ------------------------------------------------------------ publications

    def publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        self.store.publish(keys, lease, lease_s)

    def renew(self, leases: list[str], source: Address | None) -> None:
        if source is None:
            self.store.renew(leases)
        else:
            self.puller.notify(PeerAddress.parse(source), Renew, leases)

    def unpublish(self, leases: list[str], source: Address | None) -> None:
        if source is None:
            self.store.unpublish(leases)
        else:
            self.puller.notify(PeerAddress.parse(source), Release, leases)

    # ------------------------------------------------------------------- public

    def address(self) -> dict[str, Any] | None:
        server, terms = self.server, self._terms
        if server is None:
            return None
        return {
            "host": server.host,
            "port": server.port,
            "incarnation": self.incarnation,
            "layout": terms.layout,
            "compat": terms.compat.model_dump(mode="json", exclude_none=True),
            **({"unix": server.unix_name} if server.unix_name is not None else {}),
            **self.transport.address(),
        }

    def health(self) -> Health:
        if self.server is not None and not self.server.alive:
            return Health(False, "server thread is not running; peers cannot pull")
        return Health(True)

    def stats(self) -> dict[str, float]:
        out = self.store.stats()
        if self.server is not None:
            out.update(self.server.stats())
        out.update(self.transport.stats())
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.puller.close()
        self.store.close()
        self.transport.close()
