"""``tcp``: a producer in another OS process serves its pool; consumers pull."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmux.compat import ModelInfo
from kvmux.connector import Connector
from kvmux.errors import ClosedError, ConfigError
from kvmux.handle import Status
from kvmux.layout import KVLayout
from kvmux.net.frames import MAGIC, Channel, Limits
from kvmux.net.handshake import join_handshake, serve_handshake
from kvmux.net.messages import (
    PEER_PROTOCOL,
    Blocks,
    Error,
    FetchReply,
    FetchRequest,
    expect,
)
from kvmux.registry import create_connector
from kvmux.testing import cross_process
from kvmux.testing.cross_process import Consumer, CrossProcessTests, statuses
from kvmux.testing.peer import (
    PeerProcess,
    block_bytes,
    empty_caches,
    make_caches,
    make_keys,
    make_layout,
    spawn_peer,
)
from kvmux.testing.suite import hostile_peers as hostile

from support import P2P_GRACE_S, P2P_TIMEOUT_S, wait_until

SEED = 7
N = 64
POOL_BYTES = 4 * 2**20
"""Small pools: a default 256 MiB one costs a noticeable fraction of a second to map."""
CONFIG: dict[str, Any] = {
    "backend": "tcp",
    "timeout_s": P2P_TIMEOUT_S,
    "capacity_bytes": POOL_BYTES,
}


def open_consumer(
    num_blocks: int = 2 * N, layout: str = "small", *, strided: bool = False, **config: Any
) -> Consumer:
    """A registered consumer; ``strided`` KV tensors are views with gaps between rows,
    which cannot be received into directly (the staging path)."""
    caches = empty_caches(num_blocks, layout)
    if strided:
        caches = {
            name: torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)[..., : t.shape[-1]]
            for name, t in caches.items()
        }
        assert not any(t.is_contiguous() for t in caches.values())
    return cross_process.open_consumer({**CONFIG, **config}, num_blocks, caches=caches)


# ------------------------------------------------------------ across processes


class TestTcpAcrossProcesses(CrossProcessTests):
    peer_config = CONFIG
    blocks = N
    seed = SEED

    def test_blocks_from_another_process_arrive_byte_exact_into_strided_kv(
        self, producer: PeerProcess, expected: torch.Tensor
    ) -> None:
        consumer = open_consumer(strided=True)
        try:
            dst = list(range(2 * N - 1, N - 1, -1))  # reversed: no run of consecutive blocks
            result = consumer.load(producer.keys, dst, producer.address)
            assert result.ok, result.not_ok[:2]
            assert result.nbytes == N * expected.shape[1]
            assert torch.equal(consumer.blocks(dst), expected)
        finally:
            consumer.connector.close()

    def test_killed_producer_fails_keys_within_timeout(
        self, producer: PeerProcess, expected: torch.Tensor
    ) -> None:
        big = 4096  # 64 MiB in 16 KiB blocks: long enough to kill mid-stream
        consumer = open_consumer(num_blocks=big)
        try:
            with self.spawn_producer(big, capacity_bytes=80 * 2**20) as doomed:
                assert consumer.connector.lookup(doomed.keys[:1], doomed.address) == 1  # warm
                start = time.monotonic()
                handle = consumer.connector.load(doomed.keys, list(range(big)), doomed.address)
                wait_until(lambda: bool(consumer.blocks([0]).any()), P2P_TIMEOUT_S)  # flowing
                doomed.kill()
                result = handle.result(timeout=P2P_TIMEOUT_S + P2P_GRACE_S)
                assert time.monotonic() - start < P2P_TIMEOUT_S + 1
            assert set(statuses(result)) <= {"ok", "failed"}
            assert result.by_status(Status.OK), "block 0 had arrived before the kill"
            assert result.by_status(Status.FAILED), "the producer died long before sending 64 MiB"
            assert all(o.reason for _, o in result.not_ok)
            ok = [i for i, o in enumerate(result.outcomes) if o.ok]
            if ok:  # what did arrive is exact
                assert torch.equal(consumer.blocks(ok), block_bytes(make_caches(SEED, big), ok))
            # The consumer is unharmed: it loads from another producer at once.
            again = consumer.load(producer.keys, list(range(N)), producer.address)
            assert again.ok and torch.equal(consumer.blocks(range(N)), expected)
        finally:
            consumer.connector.close()

    def test_an_unreachable_peer_fails_every_key_quickly(self, consumer: Consumer) -> None:
        with socket.create_server(("127.0.0.1", 0)) as probe:
            port = probe.getsockname()[1]  # free once the probe closes
        start = time.monotonic()
        nowhere = {"host": "127.0.0.1", "port": port}
        result = consumer.load(make_keys(3), [0, 1, 2], nowhere)
        assert statuses(result) == ["failed"] * 3 and "connect" in (result.outcomes[0].reason or "")
        assert consumer.connector.lookup(make_keys(3), nowhere) == 0
        assert time.monotonic() - start < 2


# ------------------------------------------------------------------ in process


@pytest.fixture
def local_producer() -> Iterator[tuple[Connector, dict[str, torch.Tensor]]]:
    conn = create_connector({"backend": "tcp", "timeout_s": 0.5})
    caches = make_caches(SEED, 16)
    conn.register(make_layout(caches), caches)
    assert conn.save(make_keys(16), list(range(16))).result(5).ok
    yield conn, caches
    conn.close()


def address_of(conn: Connector) -> dict[str, Any]:
    address = conn.address()
    assert address is not None
    return address


def raw_connection(conn: Connector) -> socket.socket:
    address = address_of(conn)
    sock = socket.create_connection((address["host"], address["port"]), timeout=5)
    sock.recv(65536)  # the server's hello
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server hung up (reads until EOF or reset, within the socket timeout)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize(
    ("frame", "protocol_error"),
    [
        (b"GET / HTTP/1.1\r\nHost: kvmux\r\n\r\n", True),
        (struct.pack("!4sI", MAGIC, 2**31), True),
        (struct.pack("!4sI", MAGIC, 14) + b'{"kind": "hi"}', True),
        (struct.pack("!4sI", MAGIC, 200) + b'{"kind": "join"', False),  # then silence
    ],
    ids=["garbage", "oversized", "unknown-message", "truncated"],
)
def test_a_bad_frame_closes_only_its_connection_and_the_server_keeps_serving(
    local_producer: tuple[Connector, dict[str, torch.Tensor]], frame: bytes, protocol_error: bool
) -> None:
    producer, caches = local_producer
    consumer = open_consumer(num_blocks=16)
    try:
        assert consumer.connector.lookup(make_keys(16), producer.address()) == 16  # a live link
        attacker = raw_connection(producer)
        attacker.sendall(frame)
        assert closed_by_server(attacker)
        attacker.close()
        result = consumer.load(make_keys(16), list(range(16)), producer.address())
        assert result.ok and torch.equal(consumer.blocks(range(16)), block_bytes(caches, range(16)))
    finally:
        consumer.connector.close()
    assert producer.stats()["rejected_connections"] == (1 if protocol_error else 0)
    assert producer.health().healthy


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous-kv", "strided-kv"])
def test_keys_fail_when_the_producer_stops_sending_midway(strided: bool) -> None:
    consumer = open_consumer(num_blocks=8, strided=strided, timeout_s=0.5)
    fake = MisbehavingProducer(consumer, whole=3, then="stall")
    try:
        start = time.monotonic()
        result = consumer.load(make_keys(8), list(range(8)), fake.address, bound_s=0.5)
        assert 0.4 < time.monotonic() - start < 3
        assert statuses(result) == ["ok"] * 3 + ["failed"] * 5
        assert torch.equal(consumer.blocks(range(3)), fake.payload[:3])
    finally:
        fake.close()
        consumer.connector.close()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous-kv", "strided-kv"])
def test_keys_fail_at_once_when_the_producer_hangs_up_midway(strided: bool) -> None:
    consumer = open_consumer(num_blocks=8, strided=strided, timeout_s=5)
    fake = MisbehavingProducer(consumer, whole=5, then="hang_up")
    try:
        start = time.monotonic()
        result = consumer.load(make_keys(8), list(range(8)), fake.address, bound_s=5)
        assert time.monotonic() - start < 2
        assert statuses(result) == ["ok"] * 5 + ["failed"] * 3
        assert "mid-transfer" in (result.outcomes[5].reason or "")
        assert torch.equal(consumer.blocks(range(5)), fake.payload[:5])
    finally:
        fake.close()
        consumer.connector.close()


class MisbehavingProducer:
    """Speaks the protocol, claims every key, sends ``whole`` blocks and half the
    next, then stalls or hangs up: a producer dying or freezing mid-stream."""

    def __init__(self, consumer: Consumer, whole: int, then: str) -> None:
        layout = consumer.connector.layout
        assert layout is not None
        self.fingerprint = layout.fingerprint()
        self.nbytes = layout.block_nbytes
        self.whole, self.then = whole, then
        self.payload = torch.randint(0, 256, (8, self.nbytes), dtype=torch.uint8)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = {"host": "127.0.0.1", "port": self.listener.getsockname()[1]}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        sock, _ = self.listener.accept()
        chan = Channel(sock, PEER_PROTOCOL, Limits(2**20, 2**26))
        deadline = time.monotonic() + 5
        serve_handshake(
            chan, service="tcp", layout=self.fingerprint, secret=None, deadline=deadline
        )
        req = expect(chan.recv(deadline), FetchRequest)
        n = len(req.block_keys())
        chan.send(FetchReply(found=b"\1" * n, block_nbytes=self.nbytes), deadline=deadline)
        header = PEER_PROTOCOL.dump_json(Blocks(first=0, count=n, nbytes=n * self.nbytes))
        body = self.payload[: self.whole].numpy().tobytes() + b"\0" * (self.nbytes // 2)
        sock.sendall(struct.pack("!4sI", MAGIC, len(header)) + header + body)
        if self.then == "stall":
            self.done.wait(10)
        sock.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.listener.close()


def test_eviction_keeps_the_pool_within_capacity() -> None:
    caches = make_caches(SEED, 12)
    block = make_layout(caches).block_nbytes
    conn = create_connector({"backend": "tcp", "capacity_bytes": 8 * block})
    try:
        conn.register(make_layout(caches), caches)
        keys = make_keys(12)
        assert conn.save(keys, list(range(12))).result(5).ok
        stats = conn.stats()
        assert stats["capacity_blocks"] == 8 and stats["blocks_stored"] == 8
        assert stats["evictions"] == 4
        assert conn.lookup(keys) == 0  # the oldest went first
        assert conn.lookup(keys[4:]) == 8
        consumer = open_consumer(num_blocks=12)
        result = consumer.load(keys, list(range(12)), conn.address())
        assert statuses(result) == ["missing"] * 4 + ["ok"] * 8
        assert torch.equal(consumer.blocks(range(4, 12)), block_bytes(caches, range(4, 12)))
        consumer.connector.close()
    finally:
        conn.close()


def test_a_shared_secret_admits_only_peers_that_know_it() -> None:
    caches = make_caches(SEED, 4)
    producer = create_connector({"backend": "tcp", "secret": "s3cret"})
    producer.register(make_layout(caches), caches)
    producer.save(make_keys(4), [0, 1, 2, 3]).result(5)
    consumers = {
        secret: open_consumer(num_blocks=4, secret=secret) for secret in ("s3cret", "wrong", None)
    }
    try:
        results = {
            s: c.load(make_keys(4), [0, 1, 2, 3], producer.address()) for s, c in consumers.items()
        }
        assert results["s3cret"].ok
        for secret in ("wrong", None):
            assert statuses(results[secret]) == ["failed"] * 4
            assert "auth" in (results[secret].outcomes[0].reason or "")
        assert "s3cret" not in repr(producer.config) and "s3cret" not in json.dumps(
            producer.address()
        )
    finally:
        for c in consumers.values():
            c.connector.close()
        producer.close()


def test_a_load_without_source_reads_the_own_pool(
    local_producer: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, caches = local_producer
    before = block_bytes(caches, range(4))
    caches["layer.0"][:4].zero_()
    assert conn.load(make_keys(4), [0, 1, 2, 3]).result(5).ok
    assert torch.equal(block_bytes(caches, range(4)), before)


def test_address_is_plain_json_and_listens_on_loopback_by_default(
    local_producer: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, _ = local_producer
    address = address_of(conn)
    assert json.loads(json.dumps(address)) == address
    assert address["host"] == "127.0.0.1" and address["port"] > 0
    assert conn.layout is not None and address["layout"] == conn.layout.fingerprint()


def test_close_stops_the_server_and_is_idempotent() -> None:
    conn = create_connector({"backend": "tcp"})
    caches = make_caches(SEED, 4)
    conn.register(make_layout(caches), caches)  # the server starts here
    port = address_of(conn)["port"]
    conn.close()
    conn.close()
    assert not conn.health().healthy
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises(ClosedError):
        conn.lookup(make_keys(1))
    assert not [t for t in threading.enumerate() if t.name.startswith("kvmux-tcp")]


# ------------------------------------------------------------ server hardening

STALLED = 200
RSS_BOUND_MB = 40
"""Growth allowed for 200 stalled connections; a buffer of the announced header size
per connection cost about 210 MB before headers were read as their bytes arrive."""


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize("stage", ["before-join", "after-join"])
def test_stalled_connections_cost_the_server_little_memory(stage: str) -> None:
    """200 connections that announce a header and stall: before their handshake (a
    plausible join frame, cut short) or after it (no secret: anyone may join; then a
    1 MiB header announced, one byte sent). Measured on a producer process."""
    config = {
        "backend": "tcp",
        "capacity_bytes": POOL_BYTES,
        "handshake_timeout_s": 60,  # the stalls must last through the measurement
    }
    with spawn_peer(config, 4, SEED) as peer:
        endpoint = (peer.address["host"], peer.address["port"])
        time.sleep(0.5)
        before = _rss_mb(peer.pid)
        socks = []
        try:
            for _ in range(STALLED):
                sock = socket.create_connection(endpoint, timeout=5)
                socks.append(sock)
                if stage == "before-join":
                    sock.sendall(hostile.SLOW_JOIN)
                else:
                    chan = Channel(sock, PEER_PROTOCOL, Limits(2**20, 2**26))
                    join_handshake(
                        chan, service="tcp", layout=None, secret=None, deadline=time.monotonic() + 5
                    )
                    sock.sendall(struct.pack("!4sI", MAGIC, 2**20 - 1) + b"{")
            time.sleep(1.0)
            growth = _rss_mb(peer.pid) - before
            assert not any(map(hostile.closed_by_server, socks)), "the stalls must be held open"
        finally:
            for sock in socks:
                sock.close()
    print(f"\nRSS growth under {STALLED} stalled connections ({stage}): {growth:.1f} MB")
    assert growth < RSS_BOUND_MB, f"{growth:.1f} MB for {STALLED} stalled connections"


def test_a_client_without_a_layout_is_refused_blocks_at_every_request() -> None:
    """The producer works the refusal out once per connection, and still says it
    each time: no later request of that connection gets blocks."""
    caches = make_caches(SEED, 2)
    producer = create_connector(CONFIG)
    try:
        producer.register(make_layout(caches), caches)
        assert producer.save(make_keys(2), [0, 1]).result(5).ok
        address = producer.address()
        assert address is not None
        with socket.create_connection((address["host"], address["port"]), timeout=5) as sock:
            chan = Channel(sock, PEER_PROTOCOL, Limits(2**20, 2**26))
            deadline = time.monotonic() + 5
            join_handshake(chan, service="tcp", layout=None, secret=None, deadline=deadline)
            for _ in range(3):
                chan.send(FetchRequest.of(make_keys(2)), deadline=deadline)
                reply = chan.recv(deadline)
                assert isinstance(reply, Error) and reply.code == "layout_mismatch", reply
                assert "no KV layout" in reply.message
    finally:
        producer.close()


def test_idle_links_are_closed_and_the_consumer_reconnects_on_its_own() -> None:
    caches = make_caches(SEED, 4)
    producer = create_connector({"backend": "tcp", "idle_timeout_s": 0.3})
    consumer = open_consumer(num_blocks=4)
    try:
        producer.register(make_layout(caches), caches)
        assert producer.save(make_keys(4), [0, 1, 2, 3]).result(5).ok
        assert consumer.load(make_keys(4), [0, 1, 2, 3], producer.address()).ok
        wait_until(lambda: producer.stats()["idle_connections_closed"] >= 1, 5)
        assert producer.stats()["server_connections"] == 0
        again = consumer.load(make_keys(4), [0, 1, 2, 3], producer.address())
        assert again.ok and torch.equal(consumer.blocks(range(4)), block_bytes(caches, range(4)))
    finally:
        consumer.connector.close()
        producer.close()


def test_a_consumer_of_another_model_fails_every_key_naming_the_field() -> None:
    caches = make_caches(SEED, 4)
    producer = create_connector({"backend": "tcp"})
    consumer = create_connector({"backend": "tcp", "timeout_s": P2P_TIMEOUT_S})
    try:
        producer.register(
            KVLayout.from_caches(caches, 16, model=ModelInfo(name="/models/a", dtype="float16")),
            caches,
        )
        assert producer.save(make_keys(4), [0, 1, 2, 3]).result(5).ok
        mine = empty_caches(4)
        other = ModelInfo(name="/models/b", dtype="float16")
        consumer.register(KVLayout.from_caches(mine, 16, model=other), mine)
        result = consumer.load(make_keys(4), [0, 1, 2, 3], producer.address()).result(10)
        assert statuses(result) == ["failed"] * 4
        reason = result.outcomes[0].reason or ""
        assert "IncompatiblePeerError" in reason
        assert "model differs: the producer's is '/models/a', the consumer's '/models/b'" in reason
        assert not any(t.any() for t in mine.values())
        assert consumer.lookup(make_keys(4), producer.address()) == 0
    finally:
        consumer.close()
        producer.close()


def test_past_max_connections_of_joined_clients_a_newcomer_is_told_busy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmux.net.server")
    caches = make_caches(SEED, 4)
    producer = create_connector({"backend": "tcp", "max_connections": 1})
    first, second = open_consumer(num_blocks=4), open_consumer(num_blocks=4)
    try:
        producer.register(make_layout(caches), caches)
        assert producer.save(make_keys(4), [0, 1, 2, 3]).result(5).ok
        assert first.load(make_keys(4), [0, 1, 2, 3], producer.address()).ok  # keeps its link
        refused = second.load(make_keys(4), [0, 1, 2, 3], producer.address())
        assert statuses(refused) == ["failed"] * 4
        assert "busy" in (refused.outcomes[0].reason or "")
        assert "max_connections" in (refused.outcomes[0].reason or "")
        assert producer.stats()["refused_connections"] == 1
        lines = [r.getMessage() for r in caplog.records if "max_connections=1" in r.getMessage()]
        assert len(lines) == 1, lines
        assert first.load(make_keys(4), [0, 1, 2, 3], producer.address()).ok
    finally:
        first.connector.close()
        second.connector.close()
        producer.close()


# ------------------------------------------------------------------ addresses


def test_a_wildcard_bound_server_advertises_an_address_peers_can_dial() -> None:
    from kvmux.net.advertise import first_host_address

    settings = {"backend": "tcp", "capacity_bytes": POOL_BYTES, "host": "0.0.0.0"}
    wildcard = create_connector(settings)
    named = create_connector({**settings, "advertise": "kvmux-p.example"})
    caches = make_caches(SEED, 4)
    for conn in (wildcard, named):
        conn.register(make_layout(caches), caches)  # the server starts here
    try:
        assert wildcard.address()["host"] == first_host_address() != "0.0.0.0"
        assert named.address()["host"] == "kvmux-p.example"
    finally:
        wildcard.close()
        named.close()
    with pytest.raises(ConfigError, match=r"advertise.*wildcard"):
        create_connector({**settings, "advertise": "0.0.0.0"})


# ------------------------------------------------- borrowed blocks and a hung reader

STALL_BLOCKS = 256
"""256 KiB blocks: 64 MiB, many times what loopback socket buffers hold."""


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_reader_that_hangs_or_dies_holds_borrowed_blocks_no_longer_than_timeout_s(
    fault: str,
) -> None:
    """A decode that stops mid-pull (SIGSTOP) keeps the engine's blocks only until the
    producer's send deadline; one killed (kill -9) gives them back at once."""
    config = {"backend": "tcp", "save_mode": "borrow", "timeout_s": 2.0}
    producer = create_connector(config)
    reader: subprocess.Popen[str] | None = None
    try:
        caches = make_caches(SEED, STALL_BLOCKS, "large")
        producer.register(make_layout(caches), caches)
        keys = make_keys(STALL_BLOCKS)
        save = producer.save(keys, list(range(STALL_BLOCKS)))
        assert save.saved(5).ok
        address = producer.address()
        assert address is not None
        script = Path(__file__).with_name("stalled_reader.py")
        argv = [sys.executable, str(script), address["host"], str(address["port"])]
        reader = subprocess.Popen(
            [*argv, str(STALL_BLOCKS), "large"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert reader.stdout is not None and reader.stdout.readline().strip() == "asked"
        wait_until(lambda: producer.stats()["pinned_blocks"] > 0, 5.0)
        os.kill(reader.pid, getattr(signal, fault))
        producer.release(keys)  # vLLM wants its blocks back: the engine finished the request
        started = time.monotonic()
        if fault == "SIGSTOP":
            assert not save.wait(0.5), "blocks came back while a reader was still sending"
            assert save.wait(config["timeout_s"] + P2P_GRACE_S), "a hung reader kept the blocks"
        else:
            assert save.wait(P2P_GRACE_S), "a dead reader kept the blocks"
            assert time.monotonic() - started < config["timeout_s"]
        assert save.result(0).ok
        assert producer.stats()["lent_blocks"] == 0
        assert producer.lookup(keys, None) == 0
    finally:
        if reader is not None:
            reader.kill()
            reader.wait(10)
        producer.close()
