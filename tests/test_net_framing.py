"""The wire layer on its own: frames, message validation, handshake, pinned slots."""

from __future__ import annotations

import ctypes
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from kvmux.compat import Compat
from kvmux.errors import (
    IncompatiblePeerError,
    LayoutError,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from kvmux.keys import BlockKey, chain_keys
from kvmux.net import iovec
from kvmux.net.frames import MAGIC, READ_AHEAD, Channel, Limits
from kvmux.net.handshake import (
    HANDSHAKE_HEADER_BYTES,
    PeerInfo,
    join_handshake,
    serve_handshake,
)
from kvmux.net.iovec import IOV_MAX, IoVecs
from kvmux.net.memory import byte_view
from kvmux.net.messages import (
    PEER_PROTOCOL,
    PROTOCOL_VERSION,
    Blocks,
    Error,
    FetchRequest,
    Hello,
    Join,
    LocateRequest,
    LookupReply,
    LookupRequest,
    TensorHeader,
    Welcome,
    expect,
    key_batches,
    pack_rows,
)
from kvmux.net.nixl_messages import NixlLocateReply
from kvmux.net.shm_messages import LocateReply
from kvmux.slots import PinnedSlots

LIMITS = Limits(max_header_bytes=64 * 1024, max_frame_bytes=1024 * 1024)


def soon(seconds: float = 2.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Channel]]:
    a, b = socket.socketpair()
    left, right = Channel(a, PEER_PROTOCOL, LIMITS), Channel(b, PEER_PROTOCOL, LIMITS)
    yield left, right
    left.close()
    right.close()


def keys(n: int) -> list[BlockKey]:
    return chain_keys(list(range(n * 4)), 4, "ns")


def raw_frame(header: bytes, declared: int | None = None) -> bytes:
    size = len(header) if declared is None else declared
    return struct.pack("!4sI", MAGIC, size) + header


def receive_raw(pair: tuple[Channel, Channel], data: bytes, *, then_close: bool = False) -> None:
    """Write ``data`` into the left end's socket as is (and, with ``then_close``, end the
    stream); the right end then receives a frame from it."""
    left, right = pair
    left.sock.sendall(data)
    if then_close:
        left.sock.shutdown(socket.SHUT_WR)
    right.recv(soon())


# -------------------------------------------------------------------- frames


def test_a_frame_carries_a_validated_header_and_its_payload(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    data = torch.arange(256, dtype=torch.uint8)
    left.send(Blocks(first=0, count=1, nbytes=256), [byte_view(data)], deadline=soon())
    msg = right.recv(soon())
    assert msg == Blocks(first=0, count=1, nbytes=256)
    out = torch.zeros(256, dtype=torch.uint8)
    right.recv_into([byte_view(out[:100]), byte_view(out[100:])], soon())
    assert torch.equal(out, data)


def test_keys_cross_the_wire_as_block_keys(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    left.send(FetchRequest.of(keys(3)), deadline=soon())
    msg = right.recv(soon())
    assert isinstance(msg, FetchRequest) and list(msg.block_keys()) == keys(3)


def test_keys_of_several_namespaces_and_digest_sizes_cross_in_order(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    mixed = [*keys(2), BlockKey(b"\x01", "other"), BlockKey(b"\x02" * 40, "other"), *keys(3)]
    left.send(LocateRequest.of(mixed), deadline=soon())
    msg = right.recv(soon())
    assert isinstance(msg, LocateRequest) and msg.block_keys() == mixed
    assert [count for _, _, count in msg.runs] == [2, 1, 1, 3]


def test_garbage_is_a_protocol_error(pair: tuple[Channel, Channel]) -> None:
    with pytest.raises(ProtocolError, match="not a kvmux frame"):
        receive_raw(pair, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert pair[1].broken


def test_an_oversized_header_is_refused_before_it_is_read(
    pair: tuple[Channel, Channel],
) -> None:
    with pytest.raises(ProtocolError, match="max_header_bytes"):
        receive_raw(pair, raw_frame(b"", declared=2**31))


def test_an_oversized_payload_is_refused_before_it_is_read(
    pair: tuple[Channel, Channel],
) -> None:
    header = json.dumps({"kind": "blocks", "first": 0, "count": 1, "nbytes": 2**40}).encode()
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        receive_raw(pair, raw_frame(header))


@pytest.mark.parametrize(
    "header",
    [
        b"{not json",
        b'{"kind": "format_disk"}',
        b'{"kind": "lookup_reply", "count": 1, "extra": true}',
        b'{"kind": "lookup_reply", "count": -1}',
        b'{"kind": "lookup", "keys": ["ns:zz"]}',
        b'{"kind": "lookup", "runs": [], "digests": ""}',
        b'{"kind": "lookup", "runs": [["ns", 2, 2]], "digests": "AAEC"}',
        b'{"kind": "lookup", "runs": [["ns", 1, 1]], "digests": "A!=="}',
        b'{"kind": "lookup", "runs": [["ns", 0, 1]], "digests": ""}',
        b'{"kind": "lookup", "runs": [["ns", 1, 4097]], "digests": ""}',
        b'{"kind": "lookup", "runs": [["a\\nb", 1, 1]], "digests": "AA=="}',
        b'{"kind": "fetch_reply", "found": "AAI=", "block_nbytes": 8}',
        b'{"kind": "nixl_locate_reply", "lease": 1, "lease_s": 1.0, "agent": '
        b'"kvmux-1-0123456789abcdef", "metadata": null, "base": 0, "slots": 4, '
        b'"block_nbytes": 8, "rows": "AAAA"}',
    ],
    ids=[
        "not-json",
        "unknown-kind",
        "extra-field",
        "negative",
        "old-key-list",
        "no-keys",
        "digests-short",
        "not-base64",
        "empty-digest",
        "too-many-keys",
        "newline-namespace",
        "found-not-a-flag",
        "rows-not-int32s",
    ],
)
def test_a_header_that_does_not_validate_is_a_protocol_error(
    pair: tuple[Channel, Channel], header: bytes
) -> None:
    with pytest.raises(ProtocolError, match="invalid message"):
        receive_raw(pair, raw_frame(header))


def test_a_frame_cut_short_by_a_closed_peer_is_a_transfer_error(
    pair: tuple[Channel, Channel],
) -> None:
    header = LookupReply(count=3).model_dump_json().encode()
    with pytest.raises(TransferError, match="closed the connection"):
        receive_raw(pair, raw_frame(header)[:-4], then_close=True)


def test_waiting_for_a_frame_that_has_not_started_leaves_the_stream_usable(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    for count in range(3):
        with pytest.raises(TransferTimeout):
            right.recv(soon(0.05))
        assert not right.broken
        left.send(LookupReply(count=count), deadline=soon())
        assert right.recv(soon()) == LookupReply(count=count)


def test_a_frame_that_stalls_midway_times_out_and_breaks_the_stream(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    left.sock.sendall(raw_frame(LookupReply(count=3).model_dump_json().encode())[:-2])
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        right.recv(None, frame_timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2
    assert right.broken


class _CountingSocket(socket.socket):
    """A socket that counts its ``setsockopt`` calls."""

    setsockopts = 0

    def setsockopt(self, *args: object) -> None:  # type: ignore[override]
        self.setsockopts += 1
        super().setsockopt(*args)  # type: ignore[arg-type]


def test_a_busy_connection_does_not_set_its_kernel_timeouts_at_every_request() -> None:
    a, b = socket.socketpair()
    counted = _CountingSocket(fileno=a.detach())
    client, server = Channel(counted, PEER_PROTOCOL, LIMITS), Channel(b, PEER_PROTOCOL, LIMITS)
    try:
        for count in range(50):  # each request with a fresh deadline, as loads have
            client.send(LookupReply(count=count), deadline=soon(10))
            server.send(expect(server.recv(soon(10)), LookupReply), deadline=soon(10))
            assert client.recv(soon(10)) == LookupReply(count=count)
        assert counted.setsockopts <= 4, f"{counted.setsockopts} setsockopt calls in 50 requests"
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("first_s", [0.3, 5.0], ids=["shorter-before", "longer-before"])
def test_a_receive_ends_at_its_deadline_whatever_timeout_the_last_one_had(
    pair: tuple[Channel, Channel], first_s: float
) -> None:
    """Never before the deadline (the kernel's timeout is never shorter than the time
    left), and only a little after (at most 1% of it, kept for the next requests)."""
    left, right = pair
    left.send(LookupReply(count=1), deadline=soon())
    assert right.recv(soon(first_s)) == LookupReply(count=1)
    for wait_s in (0.25, 0.5):
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            right.recv(start + wait_s)
        took = time.monotonic() - start
        assert wait_s <= took < wait_s + 0.2, f"a {wait_s} s receive ended after {took:.3f} s"
        assert not right.broken


def test_a_header_larger_than_the_senders_limit_is_not_sent(
    pair: tuple[Channel, Channel],
) -> None:
    left, _ = pair
    small = Channel(left.sock, PEER_PROTOCOL, Limits(256, 1024 * 1024))
    with pytest.raises(ProtocolError, match="max_header_bytes"):
        small.send(LookupRequest.of(keys(20)), deadline=soon())


# ------------------------------------------------- payloads as address tables


def scattered(tensor: torch.Tensor, sizes: list[int], seed: int) -> IoVecs:
    """Ranges of ``tensor`` of the given sizes, laid out in a shuffled order (with a
    gap after each), listed in an order that is not the memory's."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(sizes), generator=gen).tolist()
    starts = [0] * len(sizes)
    at = 0
    for i in order:
        starts[i] = at
        at += sizes[i] + 3
    assert at <= tensor.numel()
    base = tensor.data_ptr()
    table = np.array([[base + s, n] for s, n in zip(starts, sizes, strict=True)], dtype=np.uint64)
    return IoVecs(table, tensor)


def gathered(ranges: IoVecs) -> bytes:
    return b"".join(ctypes.string_at(a, n) for a, n in ranges.table.tolist())


def random_sizes(count: int, total: int, seed: int) -> list[int]:
    gen = np.random.default_rng(seed)
    cuts = np.sort(gen.choice(np.arange(1, total), count - 1, replace=False))
    return np.diff([0, *cuts.tolist(), total]).tolist()


def test_thousands_of_scattered_ranges_arrive_byte_exact_in_ranges_cut_elsewhere(
    pair: tuple[Channel, Channel],
) -> None:
    """More ranges than one system call takes, on both sides, cut at other places:
    the bytes arrive in order, and each side's counters say how many moved."""
    left, right = pair
    total = 768 * 1024  # in one frame of LIMITS' max_frame_bytes
    source = torch.randint(0, 256, (2 * total,), dtype=torch.uint8)
    sink = torch.zeros(2 * total, dtype=torch.uint8)
    out = scattered(source, random_sizes(3 * IOV_MAX + 5, total, 1), 1)
    into = scattered(sink, random_sizes(2 * IOV_MAX + 7, total, 2), 2)
    sender = threading.Thread(
        target=left.send,
        args=(Blocks(first=0, count=1, nbytes=total), out),
        kwargs={"deadline": soon()},
    )
    sender.start()
    msg = right.recv(soon())
    assert msg == Blocks(first=0, count=1, nbytes=total)
    right.recv_into(into, soon())
    sender.join()
    assert gathered(into) == gathered(out)
    assert right.bytes_delivered == total
    assert left.bytes_sent == right.bytes_received


def test_payload_bytes_already_read_ahead_land_in_the_first_ranges(
    pair: tuple[Channel, Channel],
) -> None:
    """A small frame's payload comes in with its header into the read-ahead buffer;
    the ranges get it from there, and the next frame is still read in step."""
    left, right = pair
    source = torch.arange(300, dtype=torch.uint8)
    sink = torch.zeros(400, dtype=torch.uint8)
    out = IoVecs(np.array([[source.data_ptr(), 300]], dtype=np.uint64), source)
    into = scattered(sink, [7, 1, 150, 142], 3)
    left.send(Blocks(first=0, count=1, nbytes=300), out, deadline=soon())
    left.send(LookupReply(count=2), deadline=soon())
    assert right.recv(soon()) == Blocks(first=0, count=1, nbytes=300)
    right.recv_into(into, soon())
    assert gathered(into) == bytes(range(256)) + bytes(range(44))
    assert right.recv(soon()) == LookupReply(count=2)


HALF = 16 * 1024
"""Half of a frame's payload: small enough that no alignment padding precedes it."""


def _send_half(chan: Channel) -> Blocks:
    """A frame's prefix and header announcing ``2 * HALF`` bytes, and ``HALF`` of them."""
    header = Blocks(first=0, count=1, nbytes=2 * HALF)
    encoded = PEER_PROTOCOL.dump_json(header)
    chan.sock.sendall(raw_frame(encoded) + b"\1" * HALF)
    return header


@pytest.mark.parametrize("fate", ["stalls", "closes"])
def test_a_sender_that_stops_mid_payload_fails_a_range_read_by_its_deadline(
    pair: tuple[Channel, Channel], fate: str
) -> None:
    """Half the payload, then nothing (a timeout at the read's deadline) or the end
    of the stream (at once); either way the bytes that came are counted."""
    left, right = pair
    sink = torch.zeros(8 * HALF, dtype=torch.uint8)
    header = _send_half(left)
    if fate == "closes":
        left.sock.shutdown(socket.SHUT_WR)
    assert right.recv(soon()) == header
    start = time.monotonic()
    expected = (TransferTimeout, "timed out") if fate == "stalls" else (TransferError, "closed")
    with pytest.raises(expected[0], match=expected[1]):
        right.recv_into(scattered(sink, random_sizes(64, 2 * HALF, 4), 4), start + 0.3)
    elapsed = time.monotonic() - start
    assert elapsed < 1.0, elapsed
    if fate == "stalls":
        assert elapsed > 0.25, elapsed
    assert right.broken
    assert right.bytes_delivered == HALF


def test_a_table_libc_would_misread_is_refused() -> None:
    good = np.zeros((3, 2), dtype=np.uint64)
    for bad in (good.astype(np.int64), good.T.copy(), np.zeros((2, 3), dtype=np.uint64).T):
        with pytest.raises(ValueError, match="C-ordered"):
            IoVecs(bad, None)
    IoVecs(good, None)


def test_advance_skips_whole_rows_and_cuts_the_next_without_changing_the_callers() -> None:
    table = np.array([[100, 10], [200, 20], [300, 30]], dtype=np.uint64)
    assert iovec.advance(table, 0) is table
    assert iovec.advance(table, 10).tolist() == [[200, 20], [300, 30]]
    assert iovec.advance(table, 15).tolist() == [[205, 15], [300, 30]]
    assert iovec.advance(table, 60).tolist() == []
    assert table.tolist() == [[100, 10], [200, 20], [300, 30]]


# ------------------------------------------------------------------ messages


@pytest.mark.parametrize("mixed", [False, True], ids=["one-run", "a-run-per-key"])
def test_key_batches_fit_the_header_budget(mixed: bool) -> None:
    many = keys(9000)
    if mixed:  # the worst case: every key starts a run of its own
        many = [BlockKey(k.digest, f"ns{i % 2}" * 20) for i, k in enumerate(many)]
    batches = list(key_batches(many, 64 * 1024))
    assert [k for b in batches for k in many[b.start : b.stop]] == many
    for batch in batches:
        encoded = PEER_PROTOCOL.dump_json(LookupRequest.of(many[batch.start : batch.stop]))
        assert len(encoded) <= 64 * 1024


def locate_reply(**fields: object) -> LocateReply:
    """A valid shm locate reply of a 4-slot pool, but for ``fields``."""
    valid: dict[str, object] = {
        "lease": 1,
        "lease_s": 1.0,
        "segment": "kvmux-1-0123456789abcdef",
        "token": "0" * 32,
        "offset": 4096,
        "slots": 4,
        "block_nbytes": 8,
        "rows": pack_rows([0]),
    }
    return LocateReply.model_validate({**valid, **fields})


def test_a_segment_name_cannot_point_outside_the_shared_memory_directory() -> None:
    for name in ["../../etc/passwd", "kvmux-1-../x", "/dev/shm/kvmux-1-0123456789abcdef"]:
        with pytest.raises(ValidationError):
            locate_reply(segment=name)
    assert locate_reply(segment="kvmux-1-0123456789abcdef").segment


@pytest.mark.parametrize("count", [1, 15, 16, 300], ids=lambda n: f"{n}-rows")
@pytest.mark.parametrize("row", [4, -2])
def test_locate_rows_must_lie_inside_the_pool(row: int, count: int) -> None:
    """Whatever the number of rows (a few are checked one by one, many at once)."""
    inside = [i % 4 for i in range(count - 1)]
    with pytest.raises(ValidationError, match="outside the pool"):
        locate_reply(rows=pack_rows([*inside[: count // 2], row, *inside[count // 2 :]]))
    assert locate_reply(rows=pack_rows([*inside, -1])).row_bounds() == (
        -1,
        max(inside, default=-1),
    )


@pytest.mark.parametrize("count", [1, 300], ids=lambda n: f"{n}-rows")
def test_rows_without_a_segment_are_refused_only_if_one_is_found(count: int) -> None:
    missing = pack_rows([-1] * count)
    assert locate_reply(segment=None, token=None, rows=missing).row_bounds() == (-1, -1)
    with pytest.raises(ValidationError, match="without a segment"):
        locate_reply(segment=None, token=None, rows=pack_rows([-1] * count + [2]))


def test_locate_rows_cross_the_wire_as_int32s(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    reply = locate_reply(rows=pack_rows([3, None, 0]))
    left.send(reply, deadline=soon())
    got = right.recv(soon())
    assert got == reply and isinstance(got, LocateReply)
    assert got.row_array().tolist() == [3, -1, 0]


def test_a_peek_reply_carries_one_version_per_row_and_where_they_lie(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    versions = np.array([7, 0], dtype="<u8").tobytes()
    reply = locate_reply(rows=pack_rows([3, None]), versions_offset=4096, versions=versions)
    left.send(reply, deadline=soon())
    got = right.recv(soon())
    assert isinstance(got, LocateReply) and got.version_array().tolist() == [7, 0]
    with pytest.raises(ValidationError, match="one uint64 per row"):
        locate_reply(rows=pack_rows([3, None]), versions_offset=4096, versions=versions[:8])
    with pytest.raises(ValidationError, match="one uint64 per row"):
        locate_reply(rows=pack_rows([3, None]), versions=versions)  # where would they be?
    with pytest.raises(ValidationError, match="aligned"):
        locate_reply(versions_offset=4097)


def test_a_reply_its_transport_registered_crosses_the_wire(pair: tuple[Channel, Channel]) -> None:
    """``nixl_locate_reply`` is not listed in kvmux.net.messages: importing its module
    registered it (and made the ``rows-not-int32s`` header above a check of its rows)."""
    left, right = pair
    reply = NixlLocateReply(
        lease=1,
        lease_s=1.0,
        agent="kvmux-1-0123456789abcdef",
        metadata=None,
        base=0,
        slots=4,
        block_nbytes=8,
        rows=pack_rows([1, None]),
    )
    left.send(reply, deadline=soon())
    assert right.recv(soon()) == reply


def test_pack_rows_encodes_a_slot_array_as_it_does_a_list() -> None:
    """A producer packs ``find_many``'s array (-1: missing) with no loop per row."""
    as_array = pack_rows(np.array([3, -1, 0], dtype=np.int64))
    assert as_array == pack_rows([3, None, 0]) == struct.pack("<3i", 3, -1, 0)


def test_a_tensor_header_must_agree_with_its_shape_and_dtype() -> None:
    TensorHeader(dtype="bfloat16", shape=[3, 4], nbytes=24)
    with pytest.raises(ValidationError, match="header says"):
        TensorHeader(dtype="bfloat16", shape=[3, 4], nbytes=25)
    with pytest.raises(ValidationError, match="unknown torch dtype"):
        TensorHeader(dtype="Tensor", shape=[1], nbytes=1)


# ----------------------------------------------------------------- handshake


def handshake(
    server_secret: str | None,
    client_secret: str | None,
    server_layout: str | None = "aa",
    client_layout: str | None = "aa",
    *,
    server_compat: Compat | None = None,
    client_compat: Compat | None = None,
    incarnation: str | None = None,
    joined: list[PeerInfo] | None = None,
) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides over a socket pair; the errors each side raised (and, in
    ``joined``, what the client learnt)."""
    a, b = socket.socketpair()
    errors: list[BaseException | None] = [None, None]

    def serve() -> None:
        try:
            serve_handshake(
                Channel(b, PEER_PROTOCOL, LIMITS),
                service="tcp",
                layout=server_layout,
                compat=server_compat,
                incarnation=incarnation,
                secret=server_secret,
                deadline=soon(),
            )
        except BaseException as exc:
            errors[0] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        info = join_handshake(
            Channel(a, PEER_PROTOCOL, LIMITS),
            service="tcp",
            layout=client_layout,
            compat=client_compat,
            secret=client_secret,
            deadline=soon(),
        )
        if joined is not None:
            joined.append(info)
    except BaseException as exc:
        errors[1] = exc
    thread.join(5)
    a.close()
    b.close()
    return errors[0], errors[1]


def test_peers_with_the_same_secret_join() -> None:
    assert handshake("s3cret-value", "s3cret-value") == (None, None)


def test_the_secret_never_crosses_the_wire() -> None:
    a, b = socket.socketpair()
    server = Channel(b, PEER_PROTOCOL, LIMITS)
    hello = Hello(
        service="tcp", nonce="1" * 32, layout=None, max_frame_bytes=2**20, max_header_bytes=2**16
    )
    server.send(hello, deadline=soon())

    def client_side() -> None:
        with pytest.raises(TransferError):
            join_handshake(
                Channel(a, PEER_PROTOCOL, LIMITS),
                service="tcp",
                layout=None,
                secret="s3cret-value",
                deadline=soon(),
            )

    client = threading.Thread(target=client_side)
    client.start()
    joined = server.recv(soon())
    b.close()  # the client's wait for a welcome ends
    client.join(5)
    a.close()
    assert isinstance(joined, Join) and joined.mac is not None
    assert "s3cret" not in joined.model_dump_json()


@pytest.mark.parametrize(("server", "client"), [("right", "wrong"), ("right", None)])
def test_a_client_without_the_secret_is_refused(server: str, client: str | None) -> None:
    server_error, client_error = handshake(server, client)
    assert isinstance(server_error, TransferError)
    assert isinstance(client_error, TransferError) and "auth" in str(client_error)


def test_a_server_that_cannot_prove_the_secret_is_not_trusted() -> None:
    _, client_error = handshake(None, "s3cret")
    assert isinstance(client_error, TransferError)
    assert "could not prove the shared secret" in str(client_error)


def test_different_layouts_are_refused_at_handshake() -> None:
    server_error, client_error = handshake(None, None, server_layout="aa", client_layout="bb")
    assert isinstance(server_error, TransferError)
    assert isinstance(client_error, LayoutError) and "layout mismatch" in str(client_error)


def test_a_hello_names_everything_a_client_must_check() -> None:
    hello = Hello(service="shm", nonce="0" * 32, layout=None, max_frame_bytes=1, max_header_bytes=1)
    assert set(json.loads(hello.model_dump_json())) >= {"version", "service", "nonce", "layout"}
    assert set(json.loads(hello.model_dump_json())) >= {"incarnation", "compat"}


MODEL = Compat(model="/models/a", dtype="float32", tp_size=2, tp_rank=0, kv_dtype="float32")


@pytest.mark.parametrize(
    ("field", "other"),
    [("model", "/models/b"), ("dtype", "bfloat16"), ("tp_size", 4), ("tp_rank", 1)],
)
def test_a_peer_of_another_model_is_refused_naming_the_field(field: str, other: object) -> None:
    theirs = MODEL.model_copy(update={field: other})
    server_error, client_error = handshake(None, None, server_compat=MODEL, client_compat=theirs)
    assert isinstance(server_error, TransferError)
    assert isinstance(client_error, IncompatiblePeerError)
    message = str(client_error)
    assert message.startswith(f"incompatible peer: {field} differs")
    assert repr(getattr(MODEL, field)) in message and repr(other) in message


@pytest.mark.parametrize(("field", "other"), [("kv_dtype", "bfloat16"), ("block_size", 32)])
def test_another_kv_dtype_or_block_size_is_a_layout_mismatch_naming_the_field(
    field: str, other: object
) -> None:
    mine = MODEL.model_copy(update={"block_size": 16})
    _, client_error = handshake(
        None, None, server_compat=mine, client_compat=mine.model_copy(update={field: other})
    )
    assert isinstance(client_error, LayoutError)
    assert str(client_error).startswith(f"layout mismatch: {field} differs")


def test_the_model_is_named_before_the_layout_when_both_differ() -> None:
    theirs = MODEL.model_copy(update={"dtype": "bfloat16", "kv_dtype": "bfloat16"})
    _, client_error = handshake(None, None, "aa", "bb", server_compat=MODEL, client_compat=theirs)
    assert isinstance(client_error, IncompatiblePeerError) and "dtype differs" in str(client_error)


def test_what_one_side_does_not_declare_is_not_compared() -> None:
    assert handshake(None, None, server_compat=MODEL, client_compat=Compat()) == (None, None)
    assert handshake(None, None, server_compat=MODEL, client_compat=None) == (None, None)


def test_a_client_learns_the_servers_incarnation_and_fingerprint() -> None:
    joined: list[PeerInfo] = []
    assert handshake(None, None, server_compat=MODEL, incarnation="5" * 32, joined=joined) == (
        None,
        None,
    )
    assert joined[0].incarnation == "5" * 32 and joined[0].compat == MODEL


def _serve_one(chan: Channel) -> tuple[threading.Thread, list[BaseException]]:
    """The server side of one handshake, in a thread; the errors it raised, once joined."""
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            serve_handshake(chan, service="tcp", layout=None, secret=None, deadline=soon())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread, errors


def test_a_peer_of_another_protocol_version_is_told_both_versions(
    pair: tuple[Channel, Channel],
) -> None:
    client, server = pair
    thread, errors = _serve_one(server)
    hello = expect(client.recv(soon()), Hello)
    join = Join(
        version=PROTOCOL_VERSION + 1,
        service="tcp",
        nonce="2" * 32,
        mac=None,
        layout=None,
        max_frame_bytes=hello.max_frame_bytes,
        max_header_bytes=hello.max_header_bytes,
    )
    client.send(join, deadline=soon())
    with pytest.raises(IncompatiblePeerError) as refused:
        expect(client.recv(soon()), Welcome)
    thread.join(5)
    assert str(refused.value) == (
        f"incompatible peer: protocol version differs: the producer speaks "
        f"{PROTOCOL_VERSION}, the consumer {PROTOCOL_VERSION + 1}; run one kvmux version"
    )
    assert isinstance(errors[0], TransferError)


def test_a_client_refuses_an_incompatible_server_that_welcomed_it(
    pair: tuple[Channel, Channel],
) -> None:
    client, server = pair
    errors: list[BaseException] = []

    def lenient_server() -> None:  # welcomes anyone, whatever they declared
        server.send(
            Hello(
                service="tcp",
                nonce="3" * 32,
                layout=None,
                compat=MODEL,
                max_frame_bytes=LIMITS.max_frame_bytes,
                max_header_bytes=LIMITS.max_header_bytes,
            ),
            deadline=soon(),
        )
        server.recv(soon())
        server.send(Welcome(mac=None), deadline=soon())

    thread = threading.Thread(target=lenient_server)
    thread.start()
    try:
        join_handshake(
            client,
            service="tcp",
            layout=None,
            compat=MODEL.model_copy(update={"model": "/models/b"}),
            secret=None,
            deadline=soon(),
        )
    except BaseException as exc:
        errors.append(exc)
    thread.join(5)
    assert isinstance(errors[0], IncompatiblePeerError) and "model differs" in str(errors[0])


def test_before_joining_a_header_over_the_handshake_limit_is_refused_unread(
    pair: tuple[Channel, Channel],
) -> None:
    client, server = pair
    thread, errors = _serve_one(server)
    expect(client.recv(soon()), Hello)
    client.sock.sendall(raw_frame(b"{", declared=HANDSHAKE_HEADER_BYTES + 1))
    thread.join(5)
    assert isinstance(errors[0], ProtocolError)
    assert f"max_header_bytes={HANDSHAKE_HEADER_BYTES}" in str(errors[0])


def test_a_header_that_arrives_in_pieces_is_gathered_whole(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    request = LookupRequest.of(keys(1000))  # a header of tens of KiB, over the read-ahead
    frame = raw_frame(PEER_PROTOCOL.dump_json(request))
    assert len(frame) > 2 * READ_AHEAD

    def trickle() -> None:
        for start in range(0, len(frame), 3000):
            left.sock.sendall(frame[start : start + 3000])
            time.sleep(0.002)

    sender = threading.Thread(target=trickle)
    sender.start()
    got = right.recv(soon())
    sender.join(5)
    assert isinstance(got, LookupRequest) and got.block_keys() == keys(1000)


# ---------------------------------------------------------------- pinned slots


def test_a_pinned_slot_is_never_evicted() -> None:
    slots = PinnedSlots(2)
    a, b, c = keys(3)
    sa, sb = slots.allocate(a, set()), slots.allocate(b, set())
    assert sa is not None and sb is not None
    slots.pin([sa])
    assert slots.allocate(c, slots.protected()) == sb  # b goes; a (older but pinned) stays
    assert slots.find(a) == sa
    slots.pin([slots.find(c) or 0])
    assert slots.allocate(keys(4)[3], slots.protected()) is None  # everything pinned


def test_a_key_released_while_pinned_keeps_its_slot_until_unpinned() -> None:
    slots = PinnedSlots(1)
    a, b = keys(2)
    slot = slots.allocate(a, set())
    assert slot is not None
    slots.pin([slot])
    slots.release(a)
    assert slots.find(a) is None and slots.prefix([a]) == 0
    assert slots.allocate(b, slots.protected()) is None  # the slot is still being read
    slots.unpin([slot])
    assert slots.allocate(b, slots.protected()) == slot


def test_an_expired_lease_unpins_its_slots() -> None:
    slots = PinnedSlots(1)
    a, b = keys(2)
    slot = slots.allocate(a, set())
    assert slot is not None
    slots.lease([slot], expires=10.0)
    slots.reap(now=5.0)
    assert slots.allocate(b, slots.protected()) is None
    slots.reap(now=10.0)
    assert slots.pinned == 0 and slots.allocate(b, slots.protected()) == slot


def test_a_server_of_another_version_is_named_so_whatever_it_answers(
    pair: tuple[Channel, Channel],
) -> None:
    """An older server cannot parse this version's join and answers with a protocol
    error; the client still says what is wrong: the versions."""
    client, server = pair

    def old_server() -> None:
        server.send(
            Hello(
                version=PROTOCOL_VERSION - 1,
                service="tcp",
                nonce="4" * 32,
                layout=None,
                max_frame_bytes=LIMITS.max_frame_bytes,
                max_header_bytes=LIMITS.max_header_bytes,
            ),
            deadline=soon(),
        )
        server.recv(soon())
        server.send(
            Error(code="protocol", message="join: version: Input should be 2"), deadline=soon()
        )

    thread = threading.Thread(target=old_server)
    thread.start()
    with pytest.raises(
        IncompatiblePeerError, match="protocol version differs: the producer speaks"
    ):
        join_handshake(client, service="tcp", layout=None, secret=None, deadline=soon())
    thread.join(5)
