"""The ``tcp`` pipe: a FIFO of tensors between two endpoints."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvmux.errors import ClosedError, InvalidRequestError, TransferError, TransferTimeout
from kvmux.pipes.tcp import TcpPipe, TcpPipeConfig
from kvmux.registry import create_pipe


def open_pipe(**config: object) -> TcpPipe:
    pipe = create_pipe({"backend": "tcp", "timeout_s": 2.0, **config})
    assert isinstance(pipe, TcpPipe)
    return pipe


@pytest.fixture
def ends() -> Iterator[tuple[TcpPipe, TcpPipe]]:
    listener, connector = open_pipe(), open_pipe()
    connector.connect(listener.address())
    yield listener, connector
    connector.close()
    listener.close()


TENSORS = {
    "float16": torch.randn(4, 8).to(torch.float16),
    "bfloat16": torch.randn(3, 5).to(torch.bfloat16),
    "float32-scalar": torch.tensor(3.5),
    "int64": torch.arange(-5, 5),
    "uint8": torch.randint(0, 256, (7, 3), dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "empty": torch.zeros(0, 4),
    "non-contiguous": torch.arange(12.0).reshape(3, 4).t(),
}


@pytest.mark.parametrize("name", TENSORS)
def test_a_tensor_arrives_with_its_dtype_shape_and_bytes(
    ends: tuple[TcpPipe, TcpPipe], name: str
) -> None:
    listener, connector = ends
    tensor = TENSORS[name]
    connector.send_tensor(tensor)
    got = listener.recv_tensor(2)
    assert got is not None
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor)
    listener.send_tensor(tensor)  # and the other way
    back = connector.recv_tensor(2)
    assert back is not None and torch.equal(back, tensor)


def test_none_is_a_message_of_its_own_and_order_is_kept(ends: tuple[TcpPipe, TcpPipe]) -> None:
    listener, connector = ends
    for item in [torch.ones(2), None, torch.zeros(3), None]:
        connector.send_tensor(item)
    received = [listener.recv_tensor(2) for _ in range(4)]
    assert received[1] is None and received[3] is None
    assert received[0] is not None and torch.equal(received[0], torch.ones(2))
    assert received[2] is not None and torch.equal(received[2], torch.zeros(3))


def test_a_big_tensor_round_trips(ends: tuple[TcpPipe, TcpPipe]) -> None:
    listener, connector = ends
    big = torch.randint(0, 256, (64 * 2**20,), dtype=torch.uint8)
    sender = threading.Thread(target=connector.send_tensor, args=(big,))
    sender.start()
    got = listener.recv_tensor(5)
    sender.join(5)
    assert got is not None and torch.equal(got, big)


def test_recv_waits_for_a_peer_only_until_its_timeout() -> None:
    pipe = open_pipe()
    try:
        assert not pipe.connected
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            pipe.recv_tensor(0.2)
        assert 0.15 < time.monotonic() - start < 1.5
    finally:
        pipe.close()


def test_send_waits_for_a_peer_that_attaches_late() -> None:
    listener, connector = open_pipe(), open_pipe()
    try:
        threading.Timer(0.2, connector.connect, args=(listener.address(),)).start()
        listener.send_tensor(torch.arange(3))  # blocks until the connector attaches
        got = connector.recv_tensor(2)
        assert got is not None and torch.equal(got, torch.arange(3))
    finally:
        connector.close()
        listener.close()


def test_a_recv_timeout_leaves_the_pipe_usable(ends: tuple[TcpPipe, TcpPipe]) -> None:
    listener, connector = ends
    with pytest.raises(TransferTimeout):
        listener.recv_tensor(0.05)
    assert listener.connected
    connector.send_tensor(torch.arange(4))
    got = listener.recv_tensor(2)
    assert got is not None and torch.equal(got, torch.arange(4))


def test_a_peer_that_is_gone_is_a_transfer_error_not_a_timeout(
    ends: tuple[TcpPipe, TcpPipe],
) -> None:
    listener, connector = ends
    connector.close()
    with pytest.raises(TransferError) as info:
        listener.recv_tensor(2)
    assert not isinstance(info.value, TransferTimeout)
    assert not listener.connected
    with pytest.raises(TransferError):
        for _ in range(100):  # the first sends may still fit in socket buffers
            listener.send_tensor(torch.zeros(2**16))


def test_a_tensor_over_the_frame_limit_is_refused() -> None:
    small, big = open_pipe(max_frame_bytes=2**16), open_pipe()
    try:
        big.connect(small.address())
        with pytest.raises(InvalidRequestError, match="max_frame_bytes"):
            small.send_tensor(torch.zeros(2**16, dtype=torch.uint8))
        big.send_tensor(torch.zeros(2**17, dtype=torch.uint8))  # fine for the sender...
        with pytest.raises(TransferError, match="max_frame_bytes"):
            small.recv_tensor(2)  # ...but the receiver refuses it unread
    finally:
        big.close()
        small.close()


@pytest.mark.parametrize("stray_says", [b"hello? is this http?\r\n\r\n", b""])
def test_a_stray_connection_does_not_take_the_peer_slot(stray_says: bytes) -> None:
    listener, connector = open_pipe(), open_pipe()
    stray = socket.create_connection((listener.address()["host"], listener.address()["port"]))
    try:
        stray.sendall(stray_says)
        connector.connect(listener.address())
        connector.send_tensor(torch.arange(5))
        got = listener.recv_tensor(2)
        assert got is not None and torch.equal(got, torch.arange(5))
    finally:
        stray.close()
        connector.close()
        listener.close()


def test_close_is_idempotent_and_later_calls_fail(ends: tuple[TcpPipe, TcpPipe]) -> None:
    listener, _ = ends
    listener.close()
    listener.close()
    with pytest.raises(ClosedError):
        listener.recv_tensor(0.1)
    with pytest.raises(ClosedError):
        listener.send_tensor(None)


def test_the_endpoint_listens_on_loopback_from_creation() -> None:
    pipe = TcpPipe(TcpPipeConfig(timeout_s=1.0))
    try:
        address = pipe.address()
        assert address["host"] == "127.0.0.1" and address["port"] > 0
        socket.create_connection((address["host"], address["port"]), timeout=1).close()
    finally:
        pipe.close()
