"""The opening exchange of a pool connection: service, layout, limits, shared secret.

The server speaks first (``hello`` with a fresh nonce), the client answers
(``join`` with its own nonce and an HMAC of the server's), the server answers
``welcome`` with an HMAC of the client's nonce, or ``error``. So each side
proves it knows the secret without sending it, a recorded exchange cannot be
replayed, and the role in each MAC keeps one side's proof from being
reflected back as the other's. Layouts are compared here, so blocks of two
different layouts are refused before any is moved.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from kvmux.errors import LayoutError, TransferError
from kvmux.net.frames import Channel, Limits
from kvmux.net.messages import Error, Hello, Join, Service, Welcome, expect


@dataclass(frozen=True)
class PeerInfo:
    """What the handshake learnt about the other side."""

    layout: str | None
    limits: Limits


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


def serve_handshake(
    chan: Channel,
    *,
    service: Service,
    layout: str | None,
    secret: str | None,
    deadline: float,
) -> PeerInfo:
    """Server side. Raises TransferError (after telling the client why) on refusal."""
    nonce = secrets.token_hex(16)
    chan.send(
        Hello(
            service=service,
            nonce=nonce,
            layout=layout,
            max_frame_bytes=chan.limits.max_frame_bytes,
            max_header_bytes=chan.limits.max_header_bytes,
        ),
        deadline=deadline,
    )
    join = expect(chan.recv(deadline), Join)
    refusal: Error | None = None
    mismatch = layout_mismatch(layout, join.layout)
    if join.service != service:
        refusal = Error(
            code="service", message=f"this peer serves {service!r}, not {join.service!r}"
        )
    elif secret is not None and not _proves(secret, b"client", nonce, join.mac):
        refusal = Error(code="auth", message="shared secret check failed")
    elif mismatch is not None:
        refusal = Error(code="layout_mismatch", message=mismatch)
    if refusal is not None:
        chan.send(refusal, deadline=deadline)
        raise TransferError(f"refused {chan.peer}: {refusal.message}")
    reply_mac = _mac(secret, b"server", join.nonce) if secret is not None else None
    chan.send(Welcome(mac=reply_mac), deadline=deadline)
    return PeerInfo(join.layout, Limits(join.max_header_bytes, join.max_frame_bytes))


def join_handshake(
    chan: Channel,
    *,
    service: Service,
    layout: str | None,
    secret: str | None,
    deadline: float,
) -> PeerInfo:
    """Client side. Raises LayoutError on a layout mismatch, TransferError on any
    other refusal, including a server that cannot prove the secret."""
    hello = expect(chan.recv(deadline), Hello)
    nonce = secrets.token_hex(16)
    chan.send(
        Join(
            service=service,
            nonce=nonce,
            mac=_mac(secret, b"client", hello.nonce) if secret is not None else None,
            layout=layout,
            max_frame_bytes=chan.limits.max_frame_bytes,
            max_header_bytes=chan.limits.max_header_bytes,
        ),
        deadline=deadline,
    )
    if hello.service != service:
        raise TransferError(f"{chan.peer} serves {hello.service!r}, not {service!r}")
    mismatch = layout_mismatch(hello.layout, layout)
    welcome = expect(chan.recv(deadline), Welcome)
    if mismatch is not None:  # the server should have refused; never trust that it did
        raise LayoutError(mismatch)
    if secret is not None and not _proves(secret, b"server", nonce, welcome.mac):
        raise TransferError(f"{chan.peer} could not prove the shared secret")
    return PeerInfo(hello.layout, Limits(hello.max_header_bytes, hello.max_frame_bytes))
