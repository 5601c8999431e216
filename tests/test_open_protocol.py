"""A transport kvmux does not know, defined here: it registers its own messages in the
pool protocol and talks over kvmux's server and client, handshake and framing included."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import ClassVar, Literal

import pytest
import torch

from kvmux.errors import ProtocolError, TransferError
from kvmux.net.client import Link, PeerClient
from kvmux.net.frames import Limits
from kvmux.net.handshake import Terms
from kvmux.net.memory import byte_view
from kvmux.net.messages import PEER_PROTOCOL, Count, LookupReply, Message, WireProtocol, expect
from kvmux.net.server import FrameServer, ServerLimits, Session

LIMITS = Limits(max_header_bytes=64 * 1024, max_frame_bytes=1024 * 1024)


class _Bytes(Message):
    """Raw bytes follow the header."""

    has_payload: ClassVar[bool] = True
    nbytes: Count

    def payload_nbytes(self) -> int:
        return self.nbytes


@PEER_PROTOCOL.register
class EchoRequest(_Bytes):
    """Send these bytes back, reversed."""

    kind: Literal["echo"] = "echo"


@PEER_PROTOCOL.register
class EchoReply(_Bytes):
    kind: Literal["echo_reply"] = "echo_reply"


def serve_echo(session: Session, msg: EchoRequest) -> None:
    data = torch.empty(msg.nbytes, dtype=torch.uint8)
    session.channel.recv_into([byte_view(data)], time.monotonic() + 5)
    session.send(EchoReply(nbytes=msg.nbytes), [byte_view(data.flip(0))])


@pytest.fixture
def echo_server() -> Iterator[FrameServer]:
    server = FrameServer(
        host="127.0.0.1",
        port=0,
        service="echo",
        limits=LIMITS,
        server_limits=ServerLimits(max_connections=4, handshake_timeout_s=5, idle_timeout_s=30),
        timeout_s=5,
        secret=None,
        terms=lambda: Terms(layout=None),
        incarnation=secrets.token_hex(16),
        handlers={EchoRequest: serve_echo},
        on_close=lambda session: None,
    )
    yield server
    server.close()


def echo(server: FrameServer, data: torch.Tensor, service: str = "echo") -> torch.Tensor:
    client = PeerClient(service=service, limits=LIMITS, secret=None, terms=lambda: Terms(None))
    deadline = time.monotonic() + 5

    def exchange(link: Link) -> torch.Tensor:
        link.channel.send(EchoRequest(nbytes=data.numel()), [byte_view(data)], deadline=deadline)
        reply = expect(link.channel.recv(deadline), EchoReply)
        out = torch.empty(reply.nbytes, dtype=torch.uint8)
        link.channel.recv_into([byte_view(out)], deadline)
        return out

    try:
        return client.call((server.host, server.port), deadline, exchange)
    finally:
        client.close()


def test_a_registered_message_round_trips_through_server_and_client(
    echo_server: FrameServer,
) -> None:
    data = torch.arange(200, dtype=torch.uint8)
    assert torch.equal(echo(echo_server, data), data.flip(0))
    assert echo_server.rejected == 0


def test_a_client_of_another_service_is_refused_at_the_handshake(
    echo_server: FrameServer,
) -> None:
    with pytest.raises(TransferError, match="serves 'echo', not 'tcp'"):
        echo(echo_server, torch.zeros(1, dtype=torch.uint8), service="tcp")


def test_a_service_name_must_be_a_short_lowercase_name() -> None:
    with pytest.raises(ValueError, match="'My Service' is not a short lowercase name"):
        PeerClient(service="My Service", limits=LIMITS, secret=None, terms=lambda: Terms(None))


def test_a_message_no_protocol_registered_is_not_sent() -> None:
    class Unregistered(Message):
        kind: Literal["unregistered"] = "unregistered"

    with pytest.raises(ProtocolError, match="Unregistered is not a message of the pool protocol"):
        PEER_PROTOCOL.dump_json(Unregistered())


def test_a_taken_kind_is_refused_naming_its_owner() -> None:
    class Impostor(Message):
        kind: Literal["lookup_reply"] = "lookup_reply"

    with pytest.raises(ValueError, match=r"LookupReply's; .*Impostor needs another"):
        PEER_PROTOCOL.register(Impostor)
    assert PEER_PROTOCOL.register(LookupReply) is LookupReply  # registering again: harmless


def test_a_message_needs_one_literal_short_kind() -> None:
    class Untagged(Message):
        kind: str = "untagged"

    class Shouting(Message):
        kind: Literal["SHOUT"] = "SHOUT"

    protocol = WireProtocol("test")
    with pytest.raises(TypeError, match="no kind: Literal"):
        protocol.register(Untagged)
    with pytest.raises(ValueError, match="message kind 'SHOUT' is not a short lowercase name"):
        protocol.register(Shouting)
