"""``shm``: a producer in another OS process keeps its pool in shared memory;
consumers on this host copy straight out of it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmux.backends import shm
from kvmux.backends.shm import ShmBackend
from kvmux.connector import Connector
from kvmux.errors import InvalidRequestError
from kvmux.keys import BlockKey
from kvmux.net.client import PeerClient
from kvmux.net.frames import Limits
from kvmux.net.handshake import Terms
from kvmux.net.local import HAS_ABSTRACT_SOCKETS, dial_unix
from kvmux.net.messages import LocateRequest, expect
from kvmux.net.segment import SHM_DIR
from kvmux.net.shm_messages import LocateReply
from kvmux.registry import create_connector
from kvmux.testing.cross_process import Consumer, CrossProcessTests, open_consumer, statuses
from kvmux.testing.peer import PeerProcess, block_bytes, make_caches, make_keys, make_layout

from support import P2P_GRACE_S, P2P_TIMEOUT_S, wait_until

SEED = 11
N = 64
POOL_BYTES = 4 * 2**20
"""Small pools: a default 256 MiB one costs a noticeable fraction of a second to map."""
CONFIG: dict[str, Any] = {
    "backend": "shm",
    "timeout_s": P2P_TIMEOUT_S,
    "capacity_bytes": POOL_BYTES,
}


def segments_of(pid: int) -> list[Path]:
    return sorted(SHM_DIR.glob(f"kvmux-{pid}-*"))


# ------------------------------------------------------------ across processes


class TestShmAcrossProcesses(CrossProcessTests):
    peer_config = CONFIG
    blocks = N
    seed = SEED

    def test_killed_producer_fails_keys_within_timeout_and_its_segment_is_swept(
        self, producer: PeerProcess, expected: torch.Tensor
    ) -> None:
        big = 4096  # 64 MiB
        consumer = self.open_consumer(num_blocks=big)
        try:
            with self.spawn_producer(big, capacity_bytes=80 * 2**20) as doomed:
                assert consumer.connector.lookup(doomed.keys[:1], doomed.address) == 1
                orphans = segments_of(doomed.pid)
                assert len(orphans) == 1
                start = time.monotonic()
                handle = consumer.connector.load(doomed.keys, list(range(big)), doomed.address)
                wait_until(lambda: bool(consumer.blocks([0]).any()), P2P_TIMEOUT_S)  # copying
                doomed.kill()
                during = handle.result(timeout=P2P_TIMEOUT_S + P2P_GRACE_S)
                after = consumer.load(doomed.keys[:8], list(range(8)), doomed.address)
                assert time.monotonic() - start < P2P_TIMEOUT_S + 1
            # Blocks located before the kill are still mapped here and can only be the
            # producer's bytes; whatever did not make it failed. Nothing hung.
            assert set(statuses(during)) <= {"ok", "failed"}
            ok = [i for i, o in enumerate(during.outcomes) if o.ok]
            assert torch.equal(consumer.blocks(ok), block_bytes(make_caches(SEED, big), ok))
            assert statuses(after) == ["failed"] * 8
            assert "TransferError" in (after.outcomes[0].reason or "")
            # A killed process cannot unlink its segment; the next segment made on this
            # host sweeps it (this one, or one another test run made meanwhile).
            sweeper = self.open_consumer(num_blocks=4)
            sweeper.connector.close()
            assert not any(path.exists() for path in orphans)
            # The consumer is unharmed: it loads from another producer at once.
            again = consumer.load(producer.keys, list(range(N)), producer.address)
            assert again.ok and torch.equal(consumer.blocks(range(N)), expected)
        finally:
            consumer.connector.close()

    def test_a_live_producers_segment_is_never_swept(self, producer: PeerProcess) -> None:
        before = segments_of(producer.pid)
        assert len(before) == 1
        self.open_consumer(num_blocks=4).connector.close()  # creating a segment sweeps orphans
        assert segments_of(producer.pid) == before

    def test_a_peer_on_another_host_is_refused_clearly(
        self, producer: PeerProcess, consumer: Consumer
    ) -> None:
        elsewhere = {**producer.address, "host_id": "some-other-machine"}
        result = consumer.load(producer.keys[:2], [0, 1], elsewhere)
        assert statuses(result) == ["failed"] * 2
        assert "another host" in (result.outcomes[0].reason or "")


# ------------------------------------------------------------------ in process


def test_the_segment_is_unlinked_on_close() -> None:
    conn = create_connector({"backend": "shm"})
    assert isinstance(conn.backend, ShmBackend)
    caches = make_caches(SEED, 4)
    conn.register(make_layout(caches), caches)
    assert conn.backend.transport.segment_name is not None
    path = SHM_DIR / conn.backend.transport.segment_name
    assert path.exists()
    conn.close()
    conn.close()
    assert not path.exists()


def test_eviction_keeps_the_pool_within_capacity() -> None:
    caches = make_caches(SEED, 12)
    block = make_layout(caches).block_nbytes
    conn = create_connector({"backend": "shm", "capacity_bytes": 8 * block})
    try:
        conn.register(make_layout(caches), caches)
        keys = make_keys(12)
        assert conn.save(keys, list(range(12))).result(5).ok
        assert conn.stats()["blocks_stored"] == 8 and conn.stats()["evictions"] == 4
        consumer = open_consumer(CONFIG, num_blocks=12)
        result = consumer.load(keys, list(range(12)), conn.address())
        assert statuses(result) == ["missing"] * 4 + ["ok"] * 8
        assert torch.equal(consumer.blocks(range(4, 12)), block_bytes(caches, range(4, 12)))
        assert conn.stats()["pinned_blocks"] == 0  # the consumer unpinned
        consumer.connector.close()
    finally:
        conn.close()


def _link_families(consumer: Consumer) -> list[socket.AddressFamily]:
    """The address family of every link the consumer keeps to its peers."""
    client = consumer.connector.backend.puller._client
    return [link.channel.sock.family for links in client._idle.values() for link in links]


def test_a_tcp_producer_offers_no_unix_socket() -> None:
    caches = make_caches(SEED, 4)
    conn = create_connector({**CONFIG, "backend": "tcp"})
    try:
        conn.register(make_layout(caches), caches)
        assert "unix" not in conn.address()
    finally:
        conn.close()


@pytest.fixture
def small_pool() -> Iterator[tuple[Connector, dict[str, torch.Tensor]]]:
    """A producer whose 4-slot pool is full, with a short lease."""
    caches = make_caches(SEED, 8)
    block = make_layout(caches).block_nbytes
    conn = create_connector({"backend": "shm", "capacity_bytes": 4 * block, "lease_s": 0.3})
    assert isinstance(conn.backend, ShmBackend)
    conn.register(make_layout(caches), caches)
    assert conn.save(make_keys(4), [0, 1, 2, 3]).result(5).ok
    yield conn, caches
    conn.close()


def locate_and_hold(conn: Connector, keys: list[BlockKey]) -> tuple[PeerClient, LocateReply]:
    """Pin ``keys`` like a consumer that then never unpins; returns the open client."""
    assert conn.layout is not None
    fingerprint = conn.layout.fingerprint()
    client = PeerClient(
        service="shm", limits=Limits(2**20, 2**26), secret=None, terms=lambda: Terms(fingerprint)
    )
    address = conn.address()
    deadline = time.monotonic() + 5

    def exchange(link: Any) -> LocateReply:
        link.channel.send(LocateRequest.of(keys), deadline=deadline)
        return expect(link.channel.recv(deadline), LocateReply)

    return client, client.call((address["host"], address["port"]), deadline, exchange)


@pytest.mark.skipif(not HAS_ABSTRACT_SOCKETS, reason="no abstract Unix sockets here")
def test_a_consumer_on_this_host_pulls_over_the_producers_unix_socket(
    small_pool: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, caches = small_pool
    address = conn.address()
    assert address["unix"] == f"kvmux-shm-{conn.backend.incarnation}"
    consumer = open_consumer(CONFIG, num_blocks=4)
    try:
        assert consumer.load(make_keys(4), [0, 1, 2, 3], address).ok
        assert torch.equal(consumer.blocks(range(4)), block_bytes(caches, range(4)))
        assert _link_families(consumer) == [socket.AF_UNIX]
    finally:
        consumer.connector.close()
    conn.close()
    assert dial_unix(address["unix"], 1.0) is None, "the socket closes with its connector"


def test_a_unix_socket_that_does_not_answer_leaves_the_pull_to_tcp(
    small_pool: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    # A peer in another network namespace of this host, or one restarted since the
    # address was taken: nothing answers at the name, and TCP still reaches it.
    conn, caches = small_pool
    address = {**conn.address(), "unix": "kvmux-shm-" + "0" * 32}
    consumer = open_consumer(CONFIG, num_blocks=4)
    try:
        assert consumer.connector.lookup(make_keys(4), address) == 4
        assert consumer.load(make_keys(4), [0, 1, 2, 3], address).ok
        assert torch.equal(consumer.blocks(range(4)), block_bytes(caches, range(4)))
        assert _link_families(consumer) == [socket.AF_INET]
    finally:
        consumer.connector.close()


def test_a_unix_name_that_is_not_a_kvmux_one_is_refused_as_an_address(
    small_pool: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, _ = small_pool
    address = {**conn.address(), "unix": "../../run/other.sock"}
    consumer = open_consumer(CONFIG, num_blocks=4)
    try:
        with pytest.raises(InvalidRequestError, match="unix"):
            consumer.connector.load(make_keys(1), [0], address)
    finally:
        consumer.connector.close()


def test_pinned_blocks_are_not_evicted_until_the_lease_ends(
    small_pool: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, _ = small_pool
    client, reply = locate_and_hold(conn, make_keys(4))
    try:
        assert (reply.row_array() >= 0).all() and conn.stats()["pinned_blocks"] == 4
        newer = make_keys(8)[4:]
        held = conn.save(newer[:1], [4]).result(5)
        assert statuses(held) == ["failed"], "every slot is pinned: nothing may be overwritten"
        assert conn.lookup(make_keys(4)) == 4
        time.sleep(0.35)  # the consumer never unpinned; its lease runs out
        assert conn.save(newer, [4, 5, 6, 7]).result(5).ok
        assert conn.stats()["pinned_blocks"] == 0 and conn.lookup(newer) == 4
    finally:
        client.close()


def test_a_consumer_that_disconnects_releases_its_pins(
    small_pool: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, _ = small_pool
    client, _ = locate_and_hold(conn, make_keys(2))
    assert conn.stats()["pinned_blocks"] == 2
    client.close()
    wait_until(lambda: conn.stats()["pinned_blocks"] == 0, 2)


# ------------------------------------------------- unpinned reads, checked after


@pytest.fixture
def pinning_counted(
    small_pool: tuple[Connector, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """How many slots the ``small_pool`` producer pinned, one entry per locate."""
    conn, _ = small_pool
    transport = conn.backend.transport
    pinned: list[int] = []
    pin = transport.pin

    def counted(rows: Any, session: Any) -> int:
        pinned.append(len(rows))
        return pin(rows, session)

    monkeypatch.setattr(transport, "pin", counted)
    return pinned


def rewrite_during_the_copy(consumer: Consumer, rewrite: Any) -> None:
    """Run ``rewrite`` on the producer once, right after the consumer's first copy,
    before it checks the versions: as if the producer wrote while it copied."""
    copier = consumer.connector.backend.transport.copier
    copy_in = copier.copy_in
    pending = [rewrite]

    def copy_then_rewrite(*args: Any, **kwargs: Any) -> None:
        copy_in(*args, **kwargs)
        if pending:
            pending.pop()()

    copier.copy_in = copy_then_rewrite  # type: ignore[method-assign]


@pytest.mark.skipif(not shm.UNPINNED_READS, reason="this processor locates and pins every load")
def test_a_load_pins_nothing_when_no_row_is_rewritten_meanwhile(
    small_pool: tuple[Connector, dict[str, torch.Tensor]], pinning_counted: list[int]
) -> None:
    conn, caches = small_pool
    consumer = open_consumer(CONFIG, num_blocks=4)
    try:
        result = consumer.load(make_keys(4), [0, 1, 2, 3], conn.address())
        assert result.ok and torch.equal(consumer.blocks(range(4)), block_bytes(caches, range(4)))
        assert pinning_counted == [], "nothing was rewritten: no locate, no lease"
    finally:
        consumer.connector.close()


@pytest.mark.skipif(not shm.UNPINNED_READS, reason="this processor locates and pins every load")
def test_a_row_rewritten_while_copied_is_copied_again_under_a_pin(
    small_pool: tuple[Connector, dict[str, torch.Tensor]], pinning_counted: list[int]
) -> None:
    conn, caches = small_pool
    keys = make_keys(4)
    consumer = open_consumer(CONFIG, num_blocks=4)
    try:

        def save_again() -> None:  # same key, same bytes, its slot written anew
            conn.release(keys[:1])
            assert conn.save(keys[:1], [0]).result(5).ok

        rewrite_during_the_copy(consumer, save_again)
        result = consumer.load(keys, [0, 1, 2, 3], conn.address())
        assert result.ok and torch.equal(consumer.blocks(range(4)), block_bytes(caches, range(4)))
        assert pinning_counted == [1], "only the rewritten key is located, and pinned"
        # and unpinned after: the unpin is one-way, the producer may not have read it yet
        wait_until(lambda: conn.stats()["pinned_blocks"] == 0, timeout_s=P2P_GRACE_S)
    finally:
        consumer.connector.close()


@pytest.mark.skipif(not shm.UNPINNED_READS, reason="this processor locates and pins every load")
def test_a_key_rewritten_away_while_copied_fails_rather_than_missing(
    small_pool: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, caches = small_pool
    keys = make_keys(8)
    consumer = open_consumer(CONFIG, num_blocks=4)
    try:

        def replace_it() -> None:  # the first key's slot now holds another key
            conn.release(keys[:1])
            assert conn.save(keys[4:5], [4]).result(5).ok

        rewrite_during_the_copy(consumer, replace_it)
        result = consumer.load(keys[:4], [0, 1, 2, 3], conn.address())
        # Its block holds some of what was copied: failed (bytes unsure), not missing
        # (which promises an untouched block). The others arrived.
        assert statuses(result) == ["failed", "ok", "ok", "ok"]
        assert "overwritten" in (result.outcomes[0].reason or "")
        assert torch.equal(consumer.blocks(range(1, 4)), block_bytes(caches, range(1, 4)))
    finally:
        consumer.connector.close()


def test_a_save_bumps_the_versions_of_the_rows_it_writes(
    small_pool: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, _ = small_pool
    segment = conn.backend.transport._segment
    assert segment is not None
    before = segment.versions.copy()
    keys = make_keys(8)
    conn.release(keys[1:2])  # frees its slot; the next save takes it
    assert conn.save(keys[4:5], [4]).result(5).ok
    changed = (segment.versions != before).nonzero()[0].tolist()
    assert len(changed) == 1 and segment.versions[changed[0]] == before[changed[0]] + 1
