"""``pipes:tcp``: the registry bridges the tcp pipe to a whole Connector
(``BufferBackend(PipeLookupBuffer(TcpPipe))``); it must work end to end."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

import kvmux.bridges
from kvmux.bridges import BufferBackend, PipeLookupBuffer
from kvmux.buffer import LookupBuffer
from kvmux.config import BackendConfig
from kvmux.connector import Connector
from kvmux.keys import BlockKey
from kvmux.pipes.tcp import TcpPipe, TcpPipeConfig
from kvmux.registry import create_connector, create_pipe
from kvmux.testing.peer import (
    block_bytes,
    empty_caches,
    make_caches,
    make_keys,
    make_layout,
    spawn_peer,
)

CONFIG = {"backend": "pipes:tcp", "timeout_s": 3.0}


def registered(caches: dict[str, torch.Tensor]) -> Connector:
    conn = create_connector(CONFIG)
    conn.register(make_layout(caches), caches)
    return conn


@pytest.fixture
def producer() -> Iterator[tuple[Connector, dict[str, torch.Tensor]]]:
    caches = make_caches(5, 8)
    conn = registered(caches)
    yield conn, caches
    conn.close()


def test_the_registry_builds_a_pipe_backed_connector(
    producer: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, _ = producer
    backend = conn.backend
    assert isinstance(backend, BufferBackend)
    assert isinstance(backend.buffer, PipeLookupBuffer) and isinstance(backend.buffer.pipe, TcpPipe)
    assert conn.capabilities.p2p and conn.capabilities.consumes_on_load
    assert set(conn.address() or {}) == {"host", "port"}


def test_a_consumer_loads_what_the_producer_saved(
    producer: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, caches = producer
    keys = make_keys(8)
    assert conn.save(keys[:6], list(range(6))).result(5).ok
    consumer_caches = empty_caches(8)
    consumer = registered(consumer_caches)
    try:
        assert consumer.lookup(keys, conn.address()) == 6
        result = consumer.load(keys, [7, 6, 5, 4, 3, 2, 1, 0], conn.address()).result(10)
        assert [o.status.value for o in result.outcomes] == ["ok"] * 6 + ["missing"] * 2
        assert torch.equal(
            block_bytes(consumer_caches, [7, 6, 5, 4, 3, 2]), block_bytes(caches, range(6))
        )
        assert not block_bytes(consumer_caches, [1, 0]).any()
        # A pipe buffer hands each block over once.
        again = consumer.load(keys[:2], [0, 1], conn.address()).result(10)
        assert [o.status.value for o in again.outcomes] == ["missing"] * 2
    finally:
        consumer.close()


def test_a_producer_in_another_process_serves_through_the_pipe() -> None:
    consumer_caches = empty_caches(4)
    consumer = registered(consumer_caches)
    try:
        with spawn_peer(CONFIG, 4, seed=9) as peer:
            result = consumer.load(peer.keys, [3, 2, 1, 0], peer.address).result(10)
            assert result.ok, result.not_ok[:1]
        expected = block_bytes(make_caches(9, 4), range(4))
        assert torch.equal(block_bytes(consumer_caches, [3, 2, 1, 0]), expected)
    finally:
        consumer.close()


def test_a_consumer_with_another_layout_fails_keys_instead_of_loading_them(
    producer: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, _ = producer
    keys = make_keys(4)
    assert conn.save(keys, list(range(4))).result(5).ok
    other = empty_caches(4, layout="other")  # same block size in bytes, another dtype
    consumer = registered(other)
    try:
        assert consumer.lookup(keys, conn.address()) == 4  # lookups know no layout
        result = consumer.load(keys, list(range(4)), conn.address()).result(10)
        assert [o.status.value for o in result.outcomes] == ["failed"] * 4
        assert all("layout mismatch" in (o.reason or "") for o in result.outcomes)
        assert all(int(t.view(torch.uint8).count_nonzero()) == 0 for t in other.values())
    finally:
        consumer.close()


def test_a_remote_lookup_counts_only_the_leading_keys_the_producer_holds(
    producer: tuple[Connector, dict[str, torch.Tensor]],
) -> None:
    conn, _ = producer
    keys = make_keys(8)
    assert conn.save(keys[:5], list(range(5))).result(5).ok
    consumer = registered(empty_caches(8))
    try:
        assert consumer.lookup(keys, conn.address()) == 5
        assert consumer.lookup(keys[5:], conn.address()) == 0
    finally:
        consumer.close()


def test_a_pipe_config_model_names_the_pipe_wherever_it_is_passed() -> None:
    """Its default ``backend`` is ``pipes:tcp``: given to create_connector it is the
    bridged pipe (never the ``tcp`` backend), given to create_pipe the pipe itself."""
    config = TcpPipeConfig(timeout_s=3.0)
    conn = create_connector(config)
    pipe = create_pipe(config)
    try:
        assert isinstance(conn.backend, BufferBackend)
        assert conn.config is config
        assert isinstance(pipe, TcpPipe) and pipe.config is config
    finally:
        conn.close()
        pipe.close()


class _HangingBuffer(LookupBuffer):
    """A buffer whose client blocks on every read, as a store's over a cut link."""

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.released = threading.Event()

    def insert(self, key: BlockKey, tensor: torch.Tensor) -> None:
        raise AssertionError("not saved to in this test")

    def drop_select(self, key: BlockKey, timeout: float) -> torch.Tensor | None:
        self.released.wait(60)
        return None

    def contains(self, key: BlockKey) -> bool:
        return True

    def close(self) -> None:
        self.released.set()


def test_a_buffer_whose_read_blocks_fails_the_load_at_its_deadline_not_later() -> None:
    buffer = _HangingBuffer(BackendConfig(backend="hanging", timeout_s=1.0))
    conn = Connector(BufferBackend(buffer, buffer.config))
    caches = empty_caches(4)
    conn.register(make_layout(caches), caches)
    try:
        started = time.monotonic()
        result = conn.load(make_keys(4), [0, 1, 2, 3]).result(10)
        took = time.monotonic() - started
        assert [o.status.value for o in result.outcomes] == ["failed"] * 4
        assert 1.0 <= took < 2.5, took
        assert not block_bytes(caches, range(4)).any()
    finally:
        buffer.released.set()
        conn.close()


class _DictBuffer(LookupBuffer):
    """An in-process buffer that records each read and the thread that made it; a
    key in ``hang_on`` blocks its read until ``released`` is set."""

    def __init__(self, config: BackendConfig, hang_on: frozenset[BlockKey] = frozenset()) -> None:
        super().__init__(config)
        self.store: dict[BlockKey, torch.Tensor] = {}
        self.hang_on = hang_on
        self.released = threading.Event()
        self.reads: list[tuple[BlockKey, threading.Thread]] = []

    def insert(self, key: BlockKey, tensor: torch.Tensor) -> None:
        self.store[key] = tensor

    def drop_select(self, key: BlockKey, timeout: float) -> torch.Tensor | None:
        self.reads.append((key, threading.current_thread()))
        if key in self.hang_on:
            self.released.wait(60)
        return self.store.pop(key, None)

    def contains(self, key: BlockKey) -> bool:
        return key in self.store

    def close(self) -> None:
        self.released.set()


def _connector(buffer: _DictBuffer, caches: dict[str, torch.Tensor]) -> Connector:
    conn = Connector(BufferBackend(buffer, buffer.config))
    conn.register(make_layout(caches), caches)
    return conn


def test_a_load_reads_its_whole_batch_in_one_bounded_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    buffer = _DictBuffer(BackendConfig(backend="dict", timeout_s=5.0))
    keys = make_keys(8)
    caches = make_caches(3, 6)
    producer = _connector(buffer, caches)
    consumer_caches = empty_caches(8)
    consumer = _connector(buffer, consumer_caches)
    callers: list[threading.Thread] = []
    real_bounded_call = kvmux.bridges.bounded_call

    def counting(fn: Callable[[], object], timeout_s: float, what: str) -> object:
        callers.append(threading.current_thread())
        return real_bounded_call(fn, timeout_s, what)

    try:
        assert producer.save(keys[:6], list(range(6))).result(5).ok
        monkeypatch.setattr(kvmux.bridges, "bounded_call", counting)
        result = consumer.load(keys, [7, 6, 5, 4, 3, 2, 1, 0]).result(10)
        assert [o.status.value for o in result.outcomes] == ["ok"] * 6 + ["missing"] * 2
        assert torch.equal(
            block_bytes(consumer_caches, [7, 6, 5, 4, 3, 2]), block_bytes(caches, range(6))
        )
        assert not block_bytes(consumer_caches, [1, 0]).any()
        # One bounded call for the 8 keys, so one reader thread, not the loader's own.
        assert len(callers) == 1
        assert [key for key, _ in buffer.reads] == keys
        readers = {thread for _, thread in buffer.reads}
        assert len(readers) == 1 and readers != {callers[0]}
        assert readers.pop().name.startswith("kvmux-bounded: ")
    finally:
        consumer.close()
        producer.close()


def test_a_buffer_that_hangs_mid_batch_keeps_the_keys_read_before_the_hang() -> None:
    keys = make_keys(5)
    buffer = _DictBuffer(BackendConfig(backend="dict", timeout_s=1.0), frozenset(keys[2:3]))
    caches = make_caches(3, 5)
    producer = _connector(buffer, caches)
    consumer_caches = empty_caches(5)
    consumer = _connector(buffer, consumer_caches)
    try:
        assert producer.save(keys, list(range(5))).result(5).ok
        started = time.monotonic()
        result = consumer.load(keys, [0, 1, 2, 3, 4]).result(10)
        took = time.monotonic() - started
        assert [o.status.value for o in result.outcomes] == ["ok"] * 2 + ["failed"] * 3
        assert 1.0 <= took < 2.5, took
        # The hung read's reason, as when each key had a bounded call of its own.
        hung = rf"reading {keys[2].id} from the buffer took over [0-9.]+ s"
        assert all(re.fullmatch(hung, o.reason or "") for o in result.outcomes[2:])
        assert torch.equal(block_bytes(consumer_caches, [0, 1]), block_bytes(caches, [0, 1]))
        assert not block_bytes(consumer_caches, [2, 3, 4]).any()
        # The abandoned reader, once released, ends without reading another key:
        # the blocks it never read stay in the buffer.
        buffer.released.set()
        reader = buffer.reads[-1][1]
        reader.join(5)
        assert not reader.is_alive()
        assert [key for key, _ in buffer.reads] == keys[:3]
        assert set(buffer.store) == set(keys[3:])
    finally:
        consumer.close()
        producer.close()
