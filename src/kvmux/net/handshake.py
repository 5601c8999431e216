"""The opening exchange of a pool connection: service, secret, compatibility, incarnation.

The server speaks first (``hello`` with a fresh nonce), the client answers
(``join`` with its own nonce and an HMAC of the server's), the server answers
``welcome`` with an HMAC of the client's nonce, or ``error``. So each side
proves it knows the secret without sending it, a recorded exchange cannot be
replayed, and the role in each MAC keeps one side's proof from being
reflected back as the other's.

Both sides then check the other's terms, the server first and the client
again (it never trusts that the server did): the protocol version, the
compatibility fingerprint (:mod:`kvmux.compat`) field by field, and the
layout's fingerprint. The server is always the producer (peers pull), so a
refusal names the field and both values: ``incompatible peer: dtype differs:
the producer's is 'float32', the consumer's 'bfloat16'``. Blocks of another
model or layout are refused before any is moved.

Until the peer has joined, neither side reads a header longer than
:data:`HANDSHAKE_HEADER_BYTES`: a stranger cannot make it hold more.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from kvmux.compat import Compat, difference
from kvmux.errors import KvmuxError, TransferError
from kvmux.net.frames import READ_AHEAD, Channel, Limits
from kvmux.net.messages import PROTOCOL_VERSION, Error, Hello, Join, Service, Welcome, expect

HANDSHAKE_HEADER_BYTES = 8192
"""Largest header read before the handshake is done; a hello or join is under 2 KiB."""
HANDSHAKE_READ_AHEAD = 512
"""Read-ahead of a connection before its handshake (a header longer than this is
gathered as it arrives; see :mod:`kvmux.net.frames`)."""


@dataclass(frozen=True)
class Terms:
    """What one side declares for the other to check."""

    layout: str | None
    """The KV layout's fingerprint (None before ``register``)."""
    compat: Compat = field(default_factory=Compat)
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class PeerInfo:
    """What the handshake learnt about the other side."""

    layout: str | None
    limits: Limits
    compat: Compat = field(default_factory=Compat)
    incarnation: str | None = None
    """The server's (a client learns it; a server leaves it None)."""


def _mac(secret: str, role: bytes, nonce: str) -> str:
    return hmac.new(
        secret.encode(), b"kvmux/1/" + role + b"/" + bytes.fromhex(nonce), hashlib.sha256
    ).hexdigest()


def _proves(secret: str, role: bytes, nonce: str, mac: str | None) -> bool:
    return mac is not None and hmac.compare_digest(_mac(secret, role, nonce), mac)


def layout_mismatch(mine: str | None, theirs: str | None) -> str | None:
    """The refusal text if blocks of these two layouts cannot be exchanged."""
    if mine is None or theirs is None or mine == theirs:
        return None
    return (
        f"layout mismatch: the producer serves KV layout {mine}, the consumer has {theirs}; "
        f"blocks of different layouts (dtype, shapes, block size) are never exchanged"
    )


def refusal(producer: Terms, consumer: Terms) -> Error | None:
    """Why a consumer with ``consumer``'s terms may not pull from ``producer``, or None.

    The first difference wins, the most telling first: protocol version, whose
    KV it is (model, dtype, tensor-parallel shard), how it is laid out."""
    if producer.version != consumer.version:
        return Error(
            code="incompatible",
            message=f"incompatible peer: protocol version differs: the producer speaks "
            f"{producer.version}, the consumer {consumer.version}; run one kvmux version",
        )
    diff = difference(producer.compat, consumer.compat)
    if diff is not None and not diff.of_layout:
        return Error(
            code="incompatible",
            message=f"incompatible peer: {diff}; its blocks are not this model's KV, "
            "none are exchanged",
        )
    if diff is not None:
        return Error(
            code="layout_mismatch",
            message=f"layout mismatch: {diff}; blocks of different layouts are never exchanged",
        )
    mismatch = layout_mismatch(producer.layout, consumer.layout)
    return Error(code="layout_mismatch", message=mismatch) if mismatch is not None else None


def serve_handshake(
    chan: Channel,
    *,
    service: Service,
    layout: str | None,
    secret: str | None,
    deadline: float,
    compat: Compat | None = None,
    incarnation: str | None = None,
) -> PeerInfo:
    """Server side. Raises TransferError (after telling the client why) on refusal.
    The secret is checked before anything the client declared is looked at."""
    mine = Terms(layout, compat or Compat())
    nonce = secrets.token_hex(16)
    chan.send(
        Hello(
            service=service,
            nonce=nonce,
            incarnation=incarnation,
            layout=mine.layout,
            compat=mine.compat,
            max_frame_bytes=chan.limits.max_frame_bytes,
            max_header_bytes=chan.limits.max_header_bytes,
        ),
        deadline=deadline,
    )
    join = expect(chan.recv(deadline, max_header_bytes=HANDSHAKE_HEADER_BYTES), Join)
    refused: Error | None = None
    if join.service != service:
        refused = Error(
            code="service", message=f"this peer serves {service!r}, not {join.service!r}"
        )
    elif secret is not None and not _proves(secret, b"client", nonce, join.mac):
        refused = Error(code="auth", message="shared secret check failed")
    else:
        refused = refusal(mine, Terms(join.layout, join.compat or Compat(), join.version))
    if refused is not None:
        chan.send(refused, deadline=deadline)
        raise TransferError(f"refused {chan.peer}: {refused.message}")
    reply_mac = _mac(secret, b"server", join.nonce) if secret is not None else None
    chan.send(Welcome(mac=reply_mac), deadline=deadline)
    chan.set_read_ahead(READ_AHEAD)
    limits = Limits(join.max_header_bytes, join.max_frame_bytes)
    return PeerInfo(join.layout, limits, join.compat or Compat())


def join_handshake(
    chan: Channel,
    *,
    service: Service,
    layout: str | None,
    secret: str | None,
    deadline: float,
    compat: Compat | None = None,
) -> PeerInfo:
    """Client side. Raises LayoutError on a layout mismatch, IncompatiblePeerError on
    another model, dtype, shard or protocol version, TransferError on any other
    refusal, including a server that cannot prove the secret."""
    mine = Terms(layout, compat or Compat())
    hello = expect(chan.recv(deadline, max_header_bytes=HANDSHAKE_HEADER_BYTES), Hello)
    nonce = secrets.token_hex(16)
    chan.send(
        Join(
            service=service,
            nonce=nonce,
            mac=_mac(secret, b"client", hello.nonce) if secret is not None else None,
            layout=mine.layout,
            compat=mine.compat,
            max_frame_bytes=chan.limits.max_frame_bytes,
            max_header_bytes=chan.limits.max_header_bytes,
        ),
        deadline=deadline,
    )
    if hello.service != service:
        raise TransferError(f"{chan.peer} serves {hello.service!r}, not {service!r}")
    theirs = Terms(hello.layout, hello.compat or Compat(), hello.version)
    refused = refusal(theirs, mine)
    try:
        welcome = expect(chan.recv(deadline, max_header_bytes=HANDSHAKE_HEADER_BYTES), Welcome)
    except KvmuxError:
        if refused is None:
            raise
        # Ours names the difference; a server of another version may refuse in words
        # this version cannot parse.
        raise refused.to_exception() from None
    if refused is not None:  # the server should have refused; never trust that it did
        raise refused.to_exception()
    if secret is not None and not _proves(secret, b"server", nonce, welcome.mac):
        raise TransferError(f"{chan.peer} could not prove the shared secret")
    chan.set_read_ahead(READ_AHEAD)
    limits = Limits(hello.max_header_bytes, hello.max_frame_bytes)
    return PeerInfo(hello.layout, limits, theirs.compat, hello.incarnation)
