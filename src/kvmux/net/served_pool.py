"""What ``tcp`` and ``shm`` share: a bounded pool that peers pull from.

Every instance is both a producer and a consumer. ``save`` copies blocks into
the pool (as ``cpu`` does, so the engine may reuse its blocks once the handle
finishes); a server thread, listening from construction, answers peers'
lookups and serves their pulls; ``load(source=None)`` reads the own pool (the
``kv_both`` reuse case) and ``load(source=address)`` pulls from a peer. How
the bytes of a pull travel is the subclass's business: over the socket
(``tcp``) or through a shared segment (``shm``).

Each instance has a random *incarnation*, in its ``address()`` and in every
handshake: a consumer holding the address of an instance that has since died
and been replaced on the same port fails those keys at once, saying so, and
its next pull with the new address works (the dead peer's links, mapped
segments and agents are dropped). The address also carries the instance's
compatibility fingerprint (:mod:`kvmux.compat`), so an engine can tell before
asking that a producer runs another model.

Without a ``secret``, the server answers anyone who can reach its port; it
binds 127.0.0.1 unless ``host`` says otherwise. ``address()`` carries the
host peers must dial: ``advertise``, else the bound host, else (for a
wildcard bind) this machine's first non-loopback address
(:mod:`kvmux.net.advertise`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from abc import abstractmethod
from collections.abc import Hashable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from kvmux.backend import Address, Health
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.compat import Compat
from kvmux.errors import (
    ClosedError,
    InvalidRequestError,
    KvmuxError,
    PeerRestartedError,
    TransferError,
)
from kvmux.handle import Outcome, failed
from kvmux.keys import BlockKey
from kvmux.net.advertise import WILDCARDS, advertised_host
from kvmux.net.client import Link, PeerClient
from kvmux.net.frames import Limits
from kvmux.net.handshake import Terms, refusal
from kvmux.net.messages import (
    MAX_LEASES_PER_NOTICE,
    Error,
    LeaseReply,
    LookupReply,
    LookupRequest,
    Message,
    Release,
    Renew,
    Service,
    expect,
    key_batches,
)
from kvmux.net.server import FrameServer, Handler, ServerLimits, Session

log = logging.getLogger(__name__)


class ServedPoolConfig(CpuPoolConfig):
    host: str = Field(
        "127.0.0.1", description="address the server listens on (0.0.0.0: every interface)"
    )
    advertise: str | None = Field(
        None,
        description="address peers are told to reach this server at (in address()); "
        "default: host, or for a wildcard host this machine's first non-loopback IPv4 "
        "address. Set it with several interfaces or NAT between hosts",
    )
    port: int = Field(0, ge=0, le=65535, description="listening port; 0 picks a free one")
    secret: SecretStr | None = Field(
        None,
        description="shared secret both peers must prove (HMAC); never sent. Without one "
        "the server is open to anyone who can reach its port",
    )
    max_frame_bytes: int = Field(
        64 * 2**20, ge=2**16, description="largest frame accepted from a peer, header included"
    )
    max_header_bytes: int = Field(
        2**20, ge=2**16, description="largest frame header accepted from a peer"
    )
    max_connections: int = Field(
        256,
        ge=1,
        description="connections the server keeps open at once; past it, the oldest one "
        "still in its handshake is dropped, else the newcomer is refused (counted, logged)",
    )
    handshake_timeout_s: float = Field(
        3.0, gt=0, description="a connection that has not joined within this is closed"
    )
    idle_timeout_s: float = Field(
        300.0, gt=0, description="a joined connection without a request for this long is closed"
    )

    @field_validator("advertise")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        if value is not None and value in WILDCARDS:
            raise ValueError(f"advertise={value!r} is a wildcard; peers cannot reach it")
        return value


class PeerAddress(BaseModel):
    """The parts of an ``address()`` a consumer uses; other fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    host: str
    port: int = Field(ge=1, le=65535)
    host_id: str | None = None
    incarnation: str | None = Field(None, max_length=64)
    """The instance that published; any other at this endpoint no longer has its blocks."""

    @classmethod
    def parse(cls, address: Address) -> PeerAddress:
        try:
            return cls.model_validate(dict(address))
        except (TypeError, ValueError, ValidationError) as exc:
            raise InvalidRequestError(f"not a peer address: {address!r} ({exc})") from None

    @property
    def endpoint(self) -> tuple[str, int]:
        return (self.host, self.port)


class PullInterrupted(TransferError):
    """A pull that broke off midway: ``outcomes`` are final for the first keys of
    the batch (those that arrived whole), the rest fail with this error."""

    def __init__(self, message: str, outcomes: list[Outcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


class ServedPoolBackend(CpuPoolBackend):
    """The ``cpu`` pool plus a server and a puller. Subclasses say where the pool
    lives, which extra requests the server answers, and how a remote load moves
    bytes."""

    capabilities = Capabilities(p2p=True, capacity_bound=True)
    service: ClassVar[Service]
    config: ServedPoolConfig

    def __init__(self, config: ServedPoolConfig) -> None:
        super().__init__(config)
        self._terms = Terms(layout=None)
        """What this instance declares at handshakes; set by ``register``."""
        self.incarnation = secrets.token_hex(16)
        secret = config.secret.get_secret_value() if config.secret is not None else None
        self._limits = Limits(config.max_header_bytes, config.max_frame_bytes)
        self._client = PeerClient(
            service=self.service,
            limits=self._limits,
            secret=secret,
            terms=lambda: self._terms,
            on_restart=self._forget_peer,
        )
        self._server = FrameServer(
            host=config.host,
            port=config.port,
            service=self.service,
            limits=self._limits,
            server_limits=ServerLimits(
                config.max_connections, config.handshake_timeout_s, config.idle_timeout_s
            ),
            timeout_s=config.timeout_s,
            secret=secret,
            terms=lambda: self._terms,
            incarnation=self.incarnation,
            handlers={
                LookupRequest: self._serve_lookup,
                Renew: self._serve_renew,
                Release: self._serve_release,
                **self._handlers(),
            },
            on_close=self._session_closed,
        )
        self.advertised_host = advertised_host(self._server.host, config.advertise)
        """Where peers reach the server; see :mod:`kvmux.net.advertise`."""

    # ------------------------------------------------------------ for subclasses

    @abstractmethod
    def _handlers(self) -> dict[type[Message], Handler]:
        """Server handlers for the subclass's own requests."""

    @abstractmethod
    def _pull(
        self, link: Link, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]:
        """One request's worth of a remote load over ``link``: per-key outcomes.
        Raises TransferError if the exchange failed, PullInterrupted
        if it failed after some keys had their final outcome."""

    def _session_closed(self, session: Session) -> None:
        """Hook: a peer's connection ended."""

    def _check_peer(self, peer: PeerAddress) -> None:
        """Hook: refuse a peer this transport cannot reach (raise TransferError)."""

    def _forget_peer(self, endpoint: tuple[str, int]) -> None:
        """Hook: drop anything cached for the peer at ``endpoint`` (it failed, or a new
        incarnation of it answers there now)."""

    # ------------------------------------------------------------------ storage

    def register(self, blocks: BlockCopier) -> None:
        super().register(blocks)
        layout = blocks.layout
        with self._lock:
            self._terms = Terms(layout.fingerprint(), Compat.of(layout))

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        if source is None:
            return super().lookup(keys, None)
        peer = PeerAddress.parse(source)
        found = 0
        try:
            self._check_peer(peer)
            deadline = time.monotonic() + self.config.timeout_s
            found = self._client.call(
                peer.endpoint,
                deadline,
                lambda link: self._ask_prefix(link, keys, deadline),
                incarnation=peer.incarnation,
            )
        except KvmuxError as exc:
            self.counters.add("lookup_errors")
            log.warning("kvmux %s: lookup at %s:%s failed: %s", self.service, *peer.endpoint, exc)
            self._forget(peer, exc)
        return found

    @staticmethod
    def _ask_prefix(link: Link, keys: list[BlockKey], deadline: float) -> int:
        found = 0
        for batch in key_batches(keys, link.header_budget):
            link.channel.send(LookupRequest.of(keys[batch.start : batch.stop]), deadline=deadline)
            count = expect(link.channel.recv(deadline), LookupReply).count
            found += count
            if count < len(batch):
                break
        return found

    def lane(self, source: Address | None) -> Hashable:
        """A remote load runs on its peer's lane (:mod:`kvmux.lanes`): a peer that
        hangs delays nobody else's loads. A local one is a memory copy (inline)."""
        return None if source is None else PeerAddress.parse(source).endpoint

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> list[Outcome]:
        if source is None:
            return super().load(keys, block_ids, None, deadline)
        return self._load_remote(PeerAddress.parse(source), keys, block_ids, deadline)

    def _load_remote(
        self, peer: PeerAddress, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]:
        """Pull batch by batch over one link; once a batch fails, the rest fail with it."""
        self._check_peer(peer)
        outcomes: list[Outcome] = []

        def exchange(link: Link) -> None:
            for batch in key_batches(keys, link.header_budget):
                got = self._pull(
                    link,
                    keys[batch.start : batch.stop],
                    block_ids[batch.start : batch.stop],
                    deadline,
                )
                outcomes.extend(got)

        try:
            self._client.call(peer.endpoint, deadline, exchange, incarnation=peer.incarnation)
        except KvmuxError as exc:
            self._forget(peer, exc)
            if isinstance(exc, PullInterrupted):
                outcomes.extend(exc.outcomes)
            reason = f"{type(exc).__name__}: pulling from {peer.host}:{peer.port}: {exc}"
            outcomes.extend([failed(reason)] * (len(keys) - len(outcomes)))
        return outcomes

    # ------------------------------------------------------------ publications

    def renew(self, leases: list[str], source: Address | None) -> None:
        if source is None:
            return super().renew(leases, None)
        self._notify(PeerAddress.parse(source), Renew, leases)

    def unpublish(self, leases: list[str], source: Address | None) -> None:
        if source is None:
            return super().unpublish(leases, None)
        self._notify(PeerAddress.parse(source), Release, leases)

    def _notify(self, peer: PeerAddress, notice: type[Renew | Release], leases: list[str]) -> None:
        """Send ``notice`` messages for ``leases`` to ``peer`` in the background, on a
        lane of their own one thread wide: in order, behind no load, never in the
        caller's way. Each is answered (so a stale cached link is noticed and the
        notice resent on a fresh one, see ``PeerClient.call``). A peer that cannot
        be told is logged and counted; its leases then end at their own time."""
        step = MAX_LEASES_PER_NOTICE
        notices = [notice(leases=leases[i : i + step]) for i in range(0, len(leases), step)]
        deadline = time.monotonic() + self.config.timeout_s

        def send(link: Link) -> None:
            for msg in notices:
                link.channel.send(msg, deadline=deadline)
                expect(link.channel.recv(deadline), LeaseReply)

        def tell() -> None:
            try:
                self._check_peer(peer)
                self._client.call(peer.endpoint, deadline, send, incarnation=peer.incarnation)
            except KvmuxError as exc:
                self.counters.add("lease_notice_errors")
                log.info(
                    "kvmux %s: could not send %s for %d publication(s) to %s:%s: %s",
                    self.service,
                    notice.model_fields["kind"].default,
                    len(leases),
                    *peer.endpoint,
                    exc,
                )

        with contextlib.suppress(ClosedError):  # closing: the leases end at their time
            self.lanes.submit(("notices", peer.endpoint), tell, 1)

    def _serve_renew(self, session: Session, msg: Renew) -> None:
        session.send(LeaseReply(known=self._renew_here(msg.leases)))

    def _serve_release(self, session: Session, msg: Release) -> None:
        session.send(LeaseReply(known=self._release_here(msg.leases)))

    def _forget(self, peer: PeerAddress, cause: KvmuxError) -> None:
        """Drop what is cached for a peer that failed. Not for a restarted one: the
        links and agents it has now are good, and the handshake dropped the old ones."""
        if isinstance(cause, PeerRestartedError):
            return
        self._client.forget(peer.endpoint)
        self._forget_peer(peer.endpoint)

    # ------------------------------------------------------------------- server

    def _layout_refused(self, session: Session) -> bool:
        """Re-check the terms per request: a client that joined before this instance
        registered must still never receive blocks of another model or layout."""
        mine, theirs = self._terms, session.peer
        refused = refusal(mine, Terms(theirs.layout, theirs.compat))
        if refused is None and theirs.layout is None and mine.layout is not None:
            refused = Error(
                code="layout_mismatch",
                message="the client registered no KV layout; it cannot receive blocks",
            )
        if refused is None:
            return False
        session.send(refused)
        return True

    def _serve_lookup(self, session: Session, req: LookupRequest) -> None:
        keys = req.block_keys()  # parsed before taking the lock saves wait on
        with self._lock:
            count = self._slots.prefix(keys)
        session.send(LookupReply(count=count))

    # ------------------------------------------------------------------- public

    def address(self) -> dict[str, Any]:
        terms = self._terms
        return {
            "host": self.advertised_host,
            "port": self._server.port,
            "incarnation": self.incarnation,
            "layout": terms.layout,
            "compat": terms.compat.model_dump(mode="json", exclude_none=True),
        }

    def health(self) -> Health:
        if not self._server.alive:
            return Health(False, "server thread is not running; peers cannot pull")
        return Health(True)

    def stats(self) -> dict[str, float]:
        out = super().stats()
        server = self._server
        out.update(
            server_connections=server.connections,
            rejected_connections=server.rejected,
            refused_connections=server.refused,
            handshake_timeouts=server.handshake_timeouts,
            idle_connections_closed=server.idle_closed,
        )
        return out

    def close(self) -> None:
        self._server.close()
        self._client.close()
        super().close()
