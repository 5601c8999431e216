"""A small threaded server for the pool connectors: one thread per connection.

A connection lives as long as its client keeps it (clients cache them), so a
thread each is simple and fair: a slow or hostile client only ever holds up
itself. A frame that is garbage, truncated, oversized or out of turn closes
that one connection (logged, counted); the listener keeps serving the rest.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvmux.errors import KvmuxError, ProtocolError, TransferError
from kvmux.net.frames import Channel, Limits
from kvmux.net.handshake import PeerInfo, serve_handshake
from kvmux.net.messages import PEER_PROTOCOL, Error, Message, Service

log = logging.getLogger(__name__)


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

    def send(
        self, msg: Message, payload: Sequence[memoryview] = (), *, deadline: float | None = None
    ) -> None:
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        self.channel.send(msg, payload, deadline=deadline)


Handler = Callable[[Session, Any], None]


class FrameServer:
    """Listens from construction; each connection is handshaken, then every request
    frame is passed to ``handlers[type(msg)]`` in arrival order.

    ``layout`` is asked at each handshake (the connector registers later than
    it starts listening); ``on_close`` runs for every session that ends.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        service: Service,
        limits: Limits,
        timeout_s: float,
        secret: str | None,
        layout: Callable[[], str | None],
        handlers: dict[type[Message], Handler],
        on_close: Callable[[Session], None],
    ) -> None:
        self._service = service
        self._limits = limits
        self._timeout_s = timeout_s
        self._secret = secret
        self._layout = layout
        self._handlers = handlers
        self._on_close = on_close
        self._lock = threading.Lock()
        self._channels: set[Channel] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.rejected = 0
        """Connections closed for a protocol violation."""
        self._listener = socket.create_server((host, port))
        self.host, self.port = self._listener.getsockname()[:2]
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
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        self._listener.close()
        for chan in channels:
            chan.shutdown()
        self._acceptor.join(timeout=5)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if not self._closed:
                    log.exception("kvmux %s: accept failed; no longer serving", self._service)
                return
            chan = Channel(sock, PEER_PROTOCOL, self._limits)
            thread = threading.Thread(
                target=self._serve, args=(chan,), name=f"kvmux-{self._service}-conn", daemon=True
            )
            with self._lock:
                if self._closed:
                    chan.close()
                    return
                self._channels.add(chan)
                self._threads.add(thread)
            thread.start()

    def _serve(self, chan: Channel) -> None:
        session: Session | None = None
        try:
            deadline = time.monotonic() + self._timeout_s
            peer = serve_handshake(
                chan,
                service=self._service,
                layout=self._layout(),
                secret=self._secret,
                deadline=deadline,
            )
            session = Session(chan, peer, self._limits, self._timeout_s)
            while True:
                msg = chan.recv(None, frame_timeout=self._timeout_s)
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
                self._threads.discard(threading.current_thread())

    def _reject(self, chan: Channel, exc: ProtocolError) -> None:
        with self._lock:
            self.rejected += 1
        log.warning("kvmux %s: closing connection from %s: %s", self._service, chan.peer, exc)
        # A courtesy to a confused client; the stream may already be unusable.
        with contextlib.suppress(TransferError):
            refusal = Error(code="protocol", message=str(exc)[:4096])
            chan.send(refusal, deadline=time.monotonic() + 1)
