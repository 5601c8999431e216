"""Noticing an upstream whose host went silent: a pulled cable, a host that froze.

A server that is down but whose host is up refuses connections at once, and
:mod:`kvmux.proxy.app` takes it out of rotation then. A host that stops
answering altogether refuses nothing: a connect waits for SYNs that are
lost, and a request already sent waits for an answer that never comes, both
until the client's deadline (minutes), while the proxy keeps choosing the
silent upstream. Waiting for a long answer is not a sign of that (a long
prompt is slow, not dead), so the proxy does not guess from how long the
answer takes; it asks the kernel instead:

* a connect is given ``unreachable_after_s`` (aiohttp's ``sock_connect``);
* every upstream socket has TCP keepalive on, probing once the connection
  has been quiet for a third of that, and ``TCP_USER_TIMEOUT`` of that long:
  the kernel of a host that is up acknowledges the probes however busy its
  server is, so only a host the probes cannot reach has its connection
  aborted (``ETIMEDOUT``), within about ``unreachable_after_s``.

Both surface as connection errors of aiohttp, which the proxy treats as it
treats a refused or reset connection.
"""

from __future__ import annotations

import socket

from aiohttp import ClientConnectorError, ConnectionTimeoutError
from aiohttp.connector import AddrInfoType, SocketFactoryType


def silent_host_detecting(unreachable_after_s: float) -> SocketFactoryType:
    """An aiohttp ``socket_factory`` whose sockets fail within about
    ``unreachable_after_s`` once their peer's host stops acknowledging. The
    keepalive options are Linux's; a platform without one of them (macOS has no
    ``TCP_USER_TIMEOUT``) goes without it, and only the connect timeout applies."""
    quiet_s = max(1, round(unreachable_after_s / 3))
    wanted = {
        "TCP_KEEPIDLE": quiet_s,
        "TCP_KEEPINTVL": quiet_s,
        "TCP_USER_TIMEOUT": max(1, round(unreachable_after_s * 1000)),  # milliseconds
    }
    options = [
        (getattr(socket, name), value) for name, value in wanted.items() if hasattr(socket, name)
    ]

    def make(addr_info: AddrInfoType) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        if family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in options:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
        return sock

    return make


def never_connected(exc: BaseException) -> bool:
    """Whether ``exc`` says the upstream was never reached (refused, or no answer to the
    connect within ``unreachable_after_s``): the request was never seen there."""
    return isinstance(exc, ClientConnectorError | ConnectionTimeoutError)
