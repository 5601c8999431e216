"""A small threaded server for the pool connectors: one thread per connection, a bounded number.

A connection lives as long as its client keeps it (clients cache them), so a
thread each is simple and fair: a slow or hostile client only ever holds up
itself. A frame that is garbage, truncated, oversized or out of turn closes
that one connection (logged, counted); the listener keeps serving the rest.

What a stranger can cost: before its handshake a connection has a 512-byte
read-ahead, reads no header over 8 KiB and holds nothing it has not been sent
(:mod:`kvmux.net.frames`); with a ``secret``, nothing more is allocated until
the client has proven it. A connection that has not joined within
``handshake_timeout_s`` is closed, and so is one idle for ``idle_timeout_s``
after it joined (clients reconnect on their own). At most ``max_connections``
are open at once; when one more arrives, the oldest connection still in its
handshake makes room for it, and only when every connection has joined is the
newcomer refused (told ``busy``, counted, logged). So stalled connections
cannot keep a client that completes its handshake out.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvmux.errors import KvmuxError, ProtocolError, TransferError, TransferTimeout
from kvmux.net.frames import Channel, Limits
from kvmux.net.handshake import HANDSHAKE_READ_AHEAD, PeerInfo, Terms, serve_handshake
from kvmux.net.iovec import IoVecs
from kvmux.net.local import HAS_ABSTRACT_SOCKETS, listen_unix
from kvmux.net.messages import PEER_PROTOCOL, Error, Message, Service, check_service

log = logging.getLogger(__name__)

_LOG_INTERVAL_S = 10.0
"""At most one warning per this many seconds about each kind of closed connection."""


class _Throttled:
    """A warning logged at most once per interval, saying how many were held back: a
    stream of hostile connections must not become a stream of log lines."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = 0
        self._logged_at = -_LOG_INTERVAL_S

    def warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._logged_at < _LOG_INTERVAL_S:
                self._held += 1
                return
            held, self._held, self._logged_at = self._held, 0, now
        if held:
            message += f" ({held} more like it in the last {_LOG_INTERVAL_S:.0f} s)"
        log.warning(message, *args)


@dataclass(frozen=True)
class ServerLimits:
    """How many connections a server keeps, and how long it waits on each."""

    max_connections: int
    handshake_timeout_s: float
    """A connection must have joined (hello, join, welcome) within this."""
    idle_timeout_s: float
    """A joined connection that sends no request for this long is closed."""


class Session:
    """One accepted, authenticated connection, as a request handler sees it."""

    def __init__(self, channel: Channel, peer: PeerInfo, limits: Limits, timeout_s: float) -> None:
        self.channel = channel
        self.peer = peer
        self.timeout_s = timeout_s
        self.frame_limit = min(limits.max_frame_bytes, peer.limits.max_frame_bytes)
        """Largest frame both sides accept."""
        self.leases: set[int] = set()
        """Pins this client holds (shm); the server ends them when the connection goes."""
        self.refusal: Error | None = None
        """Why this client may not receive blocks (None: it may), valid once
        ``refusal_known``. Neither side's terms change while the connection lives,
        so the server works it out at the first request for blocks, not at each."""
        self.refusal_known = False

    def send(
        self,
        msg: Message,
        payload: Sequence[memoryview] | IoVecs = (),
        *,
        deadline: float | None = None,
    ) -> None:
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        self.channel.send(msg, payload, deadline=deadline)


Handler = Callable[[Session, Any], None]


class FrameServer:
    """Listens from construction; each connection is handshaken, then every request
    frame is passed to ``handlers[type(msg)]`` in arrival order.

    ``terms`` is asked at each handshake (the connector registers later than
    it starts listening); ``incarnation`` is announced in every hello;
    ``on_close`` runs for every session that ends. With ``unix_name``, peers on
    this host may also connect to that abstract Unix socket.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        service: Service,
        limits: Limits,
        server_limits: ServerLimits,
        timeout_s: float,
        secret: str | None,
        terms: Callable[[], Terms],
        incarnation: str,
        handlers: dict[type[Message], Handler],
        on_close: Callable[[Session], None],
        unix_name: str | None = None,
    ) -> None:
        self._service = check_service(service)
        self._limits = limits
        self._server_limits = server_limits
        self._timeout_s = timeout_s
        self._secret = secret
        self._terms = terms
        self._incarnation = incarnation
        self._handlers = handlers
        self._on_close = on_close
        self._lock = threading.Lock()
        self._channels: set[Channel] = set()
        self._joining: dict[Channel, None] = {}
        """Connections still in their handshake, oldest first."""
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.rejected = 0
        """Connections closed for a protocol violation."""
        self.refused = 0
        """Connections closed because ``max_connections`` were open."""
        self.handshake_timeouts = 0
        """Connections closed for not joining within ``handshake_timeout_s``."""
        self.idle_closed = 0
        """Joined connections closed after ``idle_timeout_s`` without a request."""
        self._refusals_log = _Throttled()
        self._rejects_log = _Throttled()
        listener = socket.create_server((host, port))
        self.host, self.port = listener.getsockname()[:2]
        self._listeners = [listener]
        self.unix_name: str | None = None
        """The abstract Unix socket name this server also listens on, for peers on
        this host (:mod:`kvmux.net.local`); None if not given one, or no such
        sockets here."""
        if unix_name is not None and HAS_ABSTRACT_SOCKETS:
            try:
                self._listeners.append(listen_unix(unix_name))
            except BaseException:
                listener.close()
                raise
            self.unix_name = unix_name
        self._wake, self._woken = socket.socketpair()
        """Closing ``_wake`` ends the acceptor's wait on the listeners."""
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"kvmux-{service}-accept", daemon=True
        )
        self._acceptor.start()

    @property
    def alive(self) -> bool:
        return self._acceptor.is_alive() and not self._closed

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._channels)

    def close(self) -> None:
        """Stop accepting, wake and join every connection thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = list(self._channels)
        self._wake.close()
        self._acceptor.join(timeout=5)
        for listener in self._listeners:
            listener.close()
        for chan in channels:
            chan.shutdown()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    # ---------------------------------------------------------------- accepting

    def _accept_loop(self) -> None:
        """One thread accepts on every listener (the TCP port, the Unix socket)."""
        with selectors.DefaultSelector() as ready, self._woken:
            ready.register(self._woken, selectors.EVENT_READ, None)
            for listener in self._listeners:
                ready.register(listener, selectors.EVENT_READ, listener)
            while True:
                for key, _ in ready.select():
                    if key.data is None:  # close()
                        return
                    try:
                        sock, _ = key.data.accept()
                    except OSError:
                        if not self._closed:
                            log.exception(
                                "kvmux %s: accept failed; no longer serving", self._service
                            )
                        return
                    self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        """Serve a new connection on a thread of its own, or refuse it."""
        chan = Channel(sock, PEER_PROTOCOL, self._limits, read_ahead=HANDSHAKE_READ_AHEAD)
        thread = threading.Thread(
            target=self._serve, args=(chan,), name=f"kvmux-{self._service}-conn", daemon=True
        )
        with self._lock:
            if self._closed:
                chan.close()
                return
            admitted, shed = self._make_room()
            if admitted:
                self._channels.add(chan)
                self._joining[chan] = None
                self._threads.add(thread)
        if shed is not None:
            shed.shutdown()  # its thread wakes, fails its handshake and ends
        if admitted:
            thread.start()
        else:
            self._refuse(chan)

    def _make_room(self) -> tuple[bool, Channel | None]:
        """Whether one more connection fits under the cap, and the connection still in
        its handshake that was dropped to make room, if one was. Caller holds the lock."""
        if len(self._channels) < self._server_limits.max_connections:
            return True, None
        self._count_refusal()
        if not self._joining:
            return False, None
        oldest = next(iter(self._joining))
        del self._joining[oldest]
        self._channels.discard(oldest)
        return True, oldest

    def _count_refusal(self) -> None:
        """Count one connection refused at the cap. Caller holds the lock."""
        self.refused += 1
        self._refusals_log.warn(
            "kvmux %s server on %s:%s: a connection refused at max_connections=%d (the "
            "oldest one still in its handshake goes first; %d refused so far)",
            self._service,
            self.host,
            self.port,
            self._server_limits.max_connections,
            self.refused,
        )

    def _refuse(self, chan: Channel) -> None:
        """Tell a newcomer there is no room (one small write into an empty socket
        buffer: it does not block the acceptor), then close it."""
        busy = Error(
            code="busy",
            message=f"{self._server_limits.max_connections} connections are open, the "
            "server's max_connections; try again later",
        )
        with contextlib.suppress(TransferError):
            chan.send(busy, deadline=time.monotonic() + 0.05)
        chan.close()

    # ------------------------------------------------------------------ serving

    def _serve(self, chan: Channel) -> None:
        session: Session | None = None
        try:
            session = self._join(chan)
            if session is None:
                return
            idle_s = self._server_limits.idle_timeout_s
            while True:
                try:
                    msg = chan.recv(time.monotonic() + idle_s, frame_timeout=self._timeout_s)
                except TransferTimeout:
                    if chan.broken:
                        raise  # a frame started, then stalled
                    with self._lock:  # counted and gone at once: readers see both or neither
                        self.idle_closed += 1
                        self._channels.discard(chan)
                    log.debug(
                        "kvmux %s: closing %s, idle for %.0f s", self._service, chan.peer, idle_s
                    )
                    return
                handler = self._handlers.get(type(msg))
                if handler is None:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from a client")
                handler(session, msg)
        except ProtocolError as exc:
            self._reject(chan, exc)
        except KvmuxError as exc:
            log.debug("kvmux %s: connection from %s ended: %s", self._service, chan.peer, exc)
        except Exception:
            log.exception("kvmux %s server: error serving %s", self._service, chan.peer)
        finally:
            if session is not None:
                self._on_close(session)
            chan.close()
            with self._lock:
                self._channels.discard(chan)
                self._joining.pop(chan, None)
                self._threads.discard(threading.current_thread())

    def _join(self, chan: Channel) -> Session | None:
        """The handshake, within ``handshake_timeout_s``; None if it timed out."""
        terms = self._terms()
        try:
            peer = serve_handshake(
                chan,
                service=self._service,
                layout=terms.layout,
                compat=terms.compat,
                incarnation=self._incarnation,
                secret=self._secret,
                deadline=time.monotonic() + self._server_limits.handshake_timeout_s,
            )
        except TransferTimeout:
            with self._lock:
                self.handshake_timeouts += 1
            log.debug(
                "kvmux %s: closing %s, no handshake within %.1f s",
                self._service,
                chan.peer,
                self._server_limits.handshake_timeout_s,
            )
            return None
        with self._lock:
            self._joining.pop(chan, None)
        return Session(chan, peer, self._limits, self._timeout_s)

    def _reject(self, chan: Channel, exc: ProtocolError) -> None:
        with self._lock:
            self.rejected += 1
        self._rejects_log.warn(
            "kvmux %s: closing connection from %s: %s", self._service, chan.peer, exc
        )
        # A courtesy to a confused client; the stream may already be unusable.
        with contextlib.suppress(TransferError):
            refusal = Error(code="protocol", message=str(exc)[:4096])
            chan.send(refusal, deadline=time.monotonic() + 1)
