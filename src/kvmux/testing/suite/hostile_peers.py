"""A P2P backend's server under attack: garbage, slow and stalled connections.

Whoever reaches a P2P backend's port can send it anything, or nothing, as
slowly as they like. These tests attack the address a producer hands out
(``host`` and ``port``) with raw sockets and check that the server keeps
serving a real consumer throughout. Where the backend's config takes them,
they also check the limits kvmux's own servers promise:

* ``max_connections``: stalled connections never keep more than that many
  open, and never shut out a consumer that completes its handshake;
* ``handshake_timeout_s``: a connection that has not joined by then is
  closed, whether it says nothing or trickles bytes.

A backend whose config has no such field skips that test, naming the field.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from kvmux.errors import ConfigError
from kvmux.testing.harness import GRACE_S, Harness, Pair
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase

STALLED = 200
"""Connections a test holds open against one server."""
CAP = 16
"""``max_connections`` the capping test configures."""
HANDSHAKE_S = 0.5
"""``handshake_timeout_s`` the deadline test configures."""

_PREFIX = struct.Struct("!4sI")
GARBAGE: dict[str, bytes] = {
    "http": b"GET / HTTP/1.1\r\nHost: kvmux\r\n\r\n",
    "random": os.urandom(4096),
    "zeros": bytes(64),
    "huge-header": _PREFIX.pack(b"KVMX", 2**32 - 1),
    "truncated-header": _PREFIX.pack(b"KVMX", 60000) + b'{"kind": "join", ',
}
"""What strangers send: not a frame, a frame announcing more than any limit, a frame
announcing a large header of which only the start ever comes."""
SLOW_JOIN = _PREFIX.pack(b"KVMX", 4000) + b'{"kind": "join", "version": 3, "service": '
"""The start of a plausible frame (a header of a size any server accepts) that a
slow stranger sends a little of, then nothing: not a protocol violation, a stall."""


def endpoint(pair: Pair) -> tuple[str, int]:
    """The producer's TCP endpoint, from its address (skips if it names none)."""
    source = pair.source or {}
    host, port = source.get("host"), source.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        pytest.skip(f"needs an address() with 'host' and 'port' to attack (got {source!r})")
    return host, port


def pair_with(harness: Harness, **overrides: Any) -> Pair:
    """A pair whose backends take ``overrides``; skips, naming the field, if not."""
    try:
        return harness.pair(**overrides)
    except ValidationError as exc:  # a factory that builds its config model itself
        unknown = [e["loc"][0] for e in exc.errors() if e["type"] == "extra_forbidden" and e["loc"]]
        names = [name for name in overrides if name in unknown]
        if not names:
            raise
        pytest.skip(f"requires config field {names[0]!r} (the config model has no such field)")
    except (TypeError, ConfigError) as exc:
        names = [name for name in overrides if name in str(exc)]
        if not names:
            raise
        pytest.skip(f"requires config field {names[0]!r} (the factory refused it: {exc})")


@contextlib.contextmanager
def strangers() -> Iterator[list[socket.socket]]:
    """Raw connections the test opens; all closed afterwards."""
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for sock in opened:
            sock.close()


def connect(address: tuple[str, int], into: list[socket.socket]) -> socket.socket | None:
    """A raw connection to ``address`` (None if the server no longer listens)."""
    try:
        sock = socket.create_connection(address, timeout=5)
    except ConnectionRefusedError:
        return None
    into.append(sock)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has hung up on ``sock`` (reads what it sent, without waiting)."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def wait_closed(sock: socket.socket, within_s: float) -> float | None:
    """Seconds until the server hung up on ``sock``, or None if not within ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if closed_by_server(sock):
            return time.monotonic() - start
        time.sleep(0.01)
    return None


class HostilePeerTests(SuiteBase):
    @requires("p2p")
    def test_garbage_and_stalled_strangers_leave_the_server_serving(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(8)
        expected = pair.save_all(keys, range(8))
        address = endpoint(pair)
        with strangers() as opened:
            for payload in GARBAGE.values():
                sock = connect(address, opened)
                if sock is not None:
                    with contextlib.suppress(OSError):  # a server may hang up at once
                        sock.sendall(payload)
            for _ in range(8):
                connect(address, opened)  # connects, then says nothing
            pair.load_and_verify(keys, range(8, 16), expected)
        assert pair.saver.health().healthy, pair.saver.health().detail
        later = harness.keys(4)  # and after they left (fresh keys: a load may consume)
        pair.load_and_verify(later, range(8, 12), pair.save_all(later, range(4)))

    @requires("p2p")
    def test_stalled_connections_are_capped_and_cannot_shut_a_consumer_out(
        self, harness: Harness
    ) -> None:
        pair = pair_with(harness, max_connections=CAP, handshake_timeout_s=60.0)
        keys = harness.keys(8)
        expected = pair.save_all(keys, range(8))
        address = endpoint(pair)
        with strangers() as opened:
            for i in range(STALLED):
                sock = connect(address, opened)
                assert sock is not None, f"the server stopped listening after {i} connections"
                with contextlib.suppress(OSError):
                    sock.sendall(SLOW_JOIN[: 1 + i % len(SLOW_JOIN)])
            deadline = time.monotonic() + 10
            while True:
                still_open = [s for s in opened if not closed_by_server(s)]
                if len(still_open) <= CAP or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert len(still_open) <= CAP, (
                f"{len(still_open)} of {STALLED} stalled connections still open; "
                f"max_connections={CAP}"
            )
            # All slots are held by strangers in their handshake: a consumer still gets in.
            pair.load_and_verify(keys, range(8, 16), expected)
        stats = pair.saver.stats()
        if "refused_connections" in stats:
            assert stats["refused_connections"] >= STALLED - CAP, stats

    @requires("p2p")
    def test_a_connection_that_does_not_join_in_time_is_closed(self, harness: Harness) -> None:
        pair = pair_with(harness, handshake_timeout_s=HANDSHAKE_S)
        keys = harness.keys(4)
        expected = pair.save_all(keys, range(4))
        address = endpoint(pair)
        bound = HANDSHAKE_S + GRACE_S
        with strangers() as opened:
            silent = connect(address, opened)
            trickler = connect(address, opened)
            assert silent is not None and trickler is not None
            start = time.monotonic()
            trickle = SLOW_JOIN
            closed = False
            for i in range(len(trickle)):  # a byte every 50 ms: each one on time, the whole late
                if closed_by_server(trickler):
                    closed = True
                    break
                with contextlib.suppress(OSError):
                    trickler.sendall(trickle[i : i + 1])
                if time.monotonic() - start > bound:
                    break
                time.sleep(0.05)
            assert closed or wait_closed(trickler, bound) is not None, (
                f"a connection trickling a header was still open after {bound:.1f} s "
                f"(handshake_timeout_s={HANDSHAKE_S})"
            )
            assert wait_closed(silent, bound) is not None, (
                f"a silent connection was still open after {bound:.1f} s "
                f"(handshake_timeout_s={HANDSHAKE_S})"
            )
            pair.load_and_verify(keys, range(8, 12), expected)
        stats = pair.saver.stats()
        if "handshake_timeouts" in stats:
            assert stats["handshake_timeouts"] >= 2, stats
