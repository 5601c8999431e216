"""The consumer side of a pool connection: handshaken links, cached per peer.

Connecting and handshaking cost a round trip or two, so links are kept after
a clean exchange and reused (a few per peer, one per concurrent transfer).
A cached link may have died with its peer since; if it fails before the peer
sent a single byte of the answer, the exchange is retried once on a fresh
link. Any other failure closes the link: a stream in an unknown state is
never reused.

Every server announces a random *incarnation* in its hello. A caller that
knows which incarnation published what it asks for (it is in the producer's
``address()``) passes it along, and an exchange with any other process at
that address fails at once with PeerRestartedError, instead of asking a new
process for blocks it never had. A handshake that meets a new incarnation at
a known address drops the links to the old one and tells the connector
(``on_restart``), which drops whatever else it cached for that peer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvmux.errors import ClosedError, PeerRestartedError, TransferError, TransferTimeout
from kvmux.net.frames import Channel, Limits
from kvmux.net.handshake import HANDSHAKE_READ_AHEAD, PeerInfo, Terms, join_handshake
from kvmux.net.local import dial_unix
from kvmux.net.messages import PEER_PROTOCOL, Service, check_service

T = TypeVar("T")
_IDLE_PER_PEER = 4


@dataclass(eq=False)
class Link:
    """A handshaken connection to one peer (hashed by identity)."""

    endpoint: tuple[str, int]
    channel: Channel
    peer: PeerInfo
    header_budget: int
    """Largest request header both sides accept."""


class PeerClient:
    def __init__(
        self,
        *,
        service: Service,
        limits: Limits,
        secret: str | None,
        terms: Callable[[], Terms],
        on_restart: Callable[[tuple[str, int]], None] = lambda endpoint: None,
    ) -> None:
        self._service = check_service(service)
        self._limits = limits
        self._secret = secret
        self._terms = terms
        self._on_restart = on_restart
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[Link]] = {}
        self._busy: set[Link] = set()
        self._incarnations: dict[tuple[str, int], str] = {}
        """The incarnation last met at each endpoint."""
        self._closed = False

    def call(
        self,
        peer: tuple[str, int],
        deadline: float,
        exchange: Callable[[Link], T],
        *,
        incarnation: str | None = None,
        unix: str | None = None,
    ) -> T:
        """Run ``exchange`` on a link to ``peer``; the link returns to the cache only if
        ``exchange`` returned and left its channel in step. With ``incarnation``, a
        peer that is another process than that one fails it with PeerRestartedError.
        With ``unix``, a new link dials that abstract Unix socket first (a peer on
        this host, :mod:`kvmux.net.local`), then TCP."""
        link, reused = self._checkout(peer, deadline, unix)
        received = link.channel.bytes_received
        try:
            return self._use(peer, link, exchange, incarnation)
        except TransferError as exc:
            answered = link.channel.bytes_received != received
            stale = isinstance(exc, TransferTimeout | PeerRestartedError)
            if not reused or answered or stale:
                raise
        # A cached link the peer had closed (it restarted, or dropped idle links):
        # the others are likely stale too; one retry on a fresh connection.
        self.forget(peer)
        link, _ = self._checkout(peer, deadline, unix)
        return self._use(peer, link, exchange, incarnation)

    def _use(
        self,
        peer: tuple[str, int],
        link: Link,
        exchange: Callable[[Link], T],
        incarnation: str | None,
    ) -> T:
        current = link.peer.incarnation
        if incarnation is not None and current is not None and current != incarnation:
            self._checkin(peer, link)  # a good link, to the process that is there now
            raise PeerRestartedError(
                f"the peer at {peer[0]}:{peer[1]} restarted: what was asked for was "
                f"published by its incarnation {incarnation[:12]}, which is gone (it is "
                f"now {current[:12]}); those blocks no longer exist"
            )
        try:
            result = exchange(link)
        except BaseException:
            self._discard(link)
            raise
        self._checkin(peer, link)
        return result

    def forget(self, peer: tuple[str, int]) -> None:
        """Close the idle links to ``peer`` (it failed; the next call reconnects)."""
        with self._lock:
            links = self._idle.pop(peer, [])
        for link in links:
            link.channel.close()

    def close(self) -> None:
        """Close every link, waking transfers in flight (they fail). Idempotent."""
        with self._lock:
            self._closed = True
            links = [link for idle in self._idle.values() for link in idle]
            links.extend(self._busy)
            self._idle.clear()
        for link in links:
            link.channel.close()

    def _checkout(
        self, peer: tuple[str, int], deadline: float, unix: str | None
    ) -> tuple[Link, bool]:
        with self._lock:
            if self._closed:
                raise ClosedError("connector is closed")
            idle = self._idle.get(peer)
            if idle:
                link = idle.pop()
                self._busy.add(link)
                return link, True
        link = self._connect(peer, deadline, unix)
        with self._lock:
            if self._closed:
                link.channel.close()
                raise ClosedError("connector is closed")
            self._busy.add(link)
        return link, False

    def _checkin(self, peer: tuple[str, int], link: Link) -> None:
        with self._lock:
            self._busy.discard(link)
            idle = self._idle.setdefault(peer, [])
            if not self._closed and not link.channel.broken and len(idle) < _IDLE_PER_PEER:
                idle.append(link)
                return
        link.channel.close()

    def _discard(self, link: Link) -> None:
        with self._lock:
            self._busy.discard(link)
        link.channel.close()

    def _connect(self, peer: tuple[str, int], deadline: float, unix: str | None) -> Link:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"no time left to connect to {peer[0]}:{peer[1]}")
        sock = dial_unix(unix, left) if unix is not None else None
        try:
            if sock is None:
                sock = socket.create_connection(peer, timeout=left)
        except TimeoutError:
            raise TransferTimeout(f"connecting to {peer[0]}:{peer[1]} timed out") from None
        except OSError as exc:
            raise TransferError(f"cannot connect to {peer[0]}:{peer[1]}: {exc}") from None
        chan = Channel(sock, PEER_PROTOCOL, self._limits, read_ahead=HANDSHAKE_READ_AHEAD)
        terms = self._terms()
        try:
            info = join_handshake(
                chan,
                service=self._service,
                layout=terms.layout,
                compat=terms.compat,
                secret=self._secret,
                deadline=deadline,
            )
        except BaseException:
            chan.close()
            raise
        if info.incarnation is not None:
            self._met(peer, info.incarnation)
        budget = min(self._limits.max_header_bytes, info.limits.max_header_bytes)
        return Link(peer, chan, info, budget)

    def _met(self, peer: tuple[str, int], incarnation: str) -> None:
        """Record the incarnation at ``peer``; a new one drops the old one's links."""
        with self._lock:
            before = self._incarnations.get(peer)
            self._incarnations[peer] = incarnation
            if before is None or before == incarnation:
                return
            idle = self._idle.get(peer, [])
            stale = [link for link in idle if link.peer.incarnation != incarnation]
            self._idle[peer] = [link for link in idle if link not in stale]
        for link in stale:
            link.channel.close()
        self._on_restart(peer)
