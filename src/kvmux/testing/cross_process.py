"""Cross-process tests for a P2P backend: a producer in another OS process, consumers here.

A P2P backend is only proven once blocks cross a process boundary: no shared
Python objects, the address travelling as JSON, a producer that can die or
freeze by signal. :class:`CrossProcessTests` does that part for any backend,
kvmux's or a third party's (fsspec ``tests/abstract`` style)::

    from kvmux.testing.cross_process import CrossProcessTests

    class TestMineAcrossProcesses(CrossProcessTests):
        peer_config = {"backend": "mine", "timeout_s": 3.0}

The subclass names the backend (``peer_config``, its registry config: the
producer process builds it from that, so the backend must be installed, entry
point included). The mixin gives:

* fixtures ``producer`` (a :class:`~kvmux.testing.peer.PeerProcess` that saved
  ``blocks`` blocks of ``seed``, started once per class and stopped by PID),
  ``expected`` (those blocks' bytes) and ``consumer`` (a registered
  :class:`Consumer` here, closed after the test);
* helpers :meth:`~CrossProcessTests.open_consumer` and
  :meth:`~CrossProcessTests.spawn_producer` (another producer for one test,
  e.g. one to kill, stopped by PID when its ``with`` block ends);
* tests: blocks arrive byte-exact, unknown keys are missing, lookup counts the
  peer's leading keys, another layout is refused at the handshake, and, where
  the subclass says where a load starts moving bytes (``transfer_call``), a
  producer killed or frozen just then fails the keys within ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from kvmux.connector import Connector
from kvmux.handle import TransferResult
from kvmux.keys import BlockKey, chain_keys
from kvmux.registry import create_connector
from kvmux.testing import peer
from kvmux.testing.harness import GRACE_S
from kvmux.testing.peer import PeerProcess


@dataclass
class Consumer:
    """A registered consumer connector and its KV memory."""

    connector: Connector
    caches: dict[str, torch.Tensor]

    def load(
        self,
        keys: list[BlockKey],
        blocks: list[int],
        source: Any,
        bound_s: float | None = None,
    ) -> TransferResult:
        """Load and wait: at most ``bound_s`` (default: the connector's ``timeout_s``)
        plus the suite's grace, or the test fails as a hang."""
        bound = self.connector.config.timeout_s if bound_s is None else bound_s
        return self.connector.load(keys, blocks, source).result(timeout=bound + GRACE_S)

    def blocks(self, ids: list[int] | range) -> torch.Tensor:
        """Copies of these blocks' bytes, layers end to end (see ``block_bytes``)."""
        return peer.block_bytes(self.caches, ids)


def open_consumer(
    config: Mapping[str, Any],
    num_blocks: int,
    layout: str = "small",
    *,
    caches: dict[str, torch.Tensor] | None = None,
) -> Consumer:
    """A connector built from ``config`` through the registry and registered with
    ``caches`` (default: zeroed ``num_blocks`` blocks of the peer ``layout``)."""
    connector = create_connector(dict(config))
    if caches is None:
        caches = peer.empty_caches(num_blocks, layout)
    connector.register(peer.make_layout(caches), caches)
    return Consumer(connector, caches)


def statuses(result: TransferResult) -> list[str]:
    """Each key's status, as plain strings (``["ok", "missing", ...]``)."""
    return [o.status.value for o in result.outcomes]


_UNKNOWN = chain_keys(list(range(4 * 16)), 16, "nobody-saved-this")
"""Keys no producer saved."""


class CrossProcessTests:
    peer_config: ClassVar[Mapping[str, Any]]
    """The backend's registry config (``{"backend": NAME, "timeout_s": ..., ...}``),
    for the producer process and the consumers here alike."""
    blocks: ClassVar[int] = 64
    """Blocks the ``producer`` saves (under ``make_keys(blocks)``)."""
    seed: ClassVar[int] = 7
    """Seed of the ``producer``'s KV bytes."""

    def transfer_call(self, connector: Connector) -> tuple[object, str] | None:
        """The object and method name through which ``connector``'s load starts moving a
        batch's bytes (a NIXL agent's ``read``, say), for the test that kills the
        producer at that moment; None (the default) skips that test."""
        return None

    # -------------------------------------------------------------- helpers

    def open_consumer(
        self, num_blocks: int | None = None, layout: str = "small", **overrides: Any
    ) -> Consumer:
        """A consumer here, on ``peer_config`` with ``overrides``; the caller closes it."""
        config = {**self.peer_config, **overrides}
        return open_consumer(config, 2 * self.blocks if num_blocks is None else num_blocks, layout)

    def spawn_producer(
        self, blocks: int | None = None, **overrides: Any
    ) -> contextlib.AbstractContextManager[PeerProcess]:
        """Another producer process of ``seed``, for a ``with`` block that ends it by PID."""
        count = self.blocks if blocks is None else blocks
        return peer.spawn_peer({**self.peer_config, **overrides}, count, self.seed)

    # ------------------------------------------------------------- fixtures

    @pytest.fixture(scope="class")
    @classmethod
    def producer(cls) -> Iterator[PeerProcess]:
        with peer.spawn_peer(cls.peer_config, cls.blocks, cls.seed) as process:
            yield process

    @pytest.fixture(scope="class")
    @classmethod
    def expected(cls) -> torch.Tensor:
        return peer.block_bytes(peer.make_caches(cls.seed, cls.blocks), range(cls.blocks))

    @pytest.fixture
    def consumer(self) -> Iterator[Consumer]:
        consumer = self.open_consumer()
        yield consumer
        consumer.connector.close()

    # ---------------------------------------------------------------- tests

    def test_blocks_from_another_process_arrive_byte_exact(
        self, producer: PeerProcess, consumer: Consumer, expected: torch.Tensor
    ) -> None:
        n = self.blocks
        dst = list(range(2 * n - 1, n - 1, -1))  # reversed: no run of consecutive blocks
        result = consumer.load(producer.keys, dst, producer.address)
        assert result.ok, result.not_ok[:2]
        assert result.nbytes == n * expected.shape[1]
        assert torch.equal(consumer.blocks(dst), expected)
        # Loading again reuses what the first load set up (connection, mapping, agent).
        again = consumer.load(producer.keys[:8], list(range(8)), producer.address)
        assert again.ok and torch.equal(consumer.blocks(range(8)), expected[:8])

    def test_unknown_keys_are_missing_and_leave_their_blocks_untouched(
        self, producer: PeerProcess, consumer: Consumer, expected: torch.Tensor
    ) -> None:
        keys = [_UNKNOWN[0], producer.keys[3], _UNKNOWN[1], producer.keys[4]]
        result = consumer.load(keys, [0, 1, 2, 3], producer.address)
        assert statuses(result) == ["missing", "ok", "missing", "ok"]
        assert torch.equal(consumer.blocks([1, 3]), expected[[3, 4]])
        assert not consumer.blocks([0, 2]).any()
        keys = [producer.keys[0], _UNKNOWN[0], producer.keys[5], _UNKNOWN[1]]
        result = consumer.load(keys, [4, 5, 6, 7], producer.address)
        assert statuses(result) == ["ok", "missing", "ok", "missing"]
        assert torch.equal(consumer.blocks([4, 6]), expected[[0, 5]])
        assert not consumer.blocks([5, 7]).any()
        nothing = consumer.load(_UNKNOWN[:3], [8, 9, 10], producer.address)
        assert statuses(nothing) == ["missing"] * 3

    def test_lookup_counts_the_leading_keys_the_peer_holds(
        self, producer: PeerProcess, consumer: Consumer
    ) -> None:
        conn, keys, n = consumer.connector, producer.keys, self.blocks
        unknown = _UNKNOWN[:2]
        assert conn.lookup(keys, producer.address) == n
        assert conn.lookup(keys[:7] + unknown, producer.address) == 7
        assert conn.lookup(keys[:10] + unknown + keys[10:], producer.address) == 10
        assert conn.lookup(unknown, producer.address) == 0
        assert conn.lookup(peer.make_keys(n + 50), producer.address) == n

    def test_a_consumer_with_another_layout_is_refused_at_handshake(
        self, producer: PeerProcess
    ) -> None:
        other = self.open_consumer(num_blocks=8, layout="other")
        try:
            result = other.load(producer.keys[:4], [0, 1, 2, 3], producer.address)
            assert statuses(result) == ["failed"] * 4
            reason = result.outcomes[0].reason or ""
            assert "LayoutError" in reason and "layout mismatch" in reason
            assert not other.blocks(range(4)).any()
            assert other.connector.lookup(producer.keys, producer.address) == 0
        finally:
            other.connector.close()

    @pytest.mark.parametrize("fate", ["killed", "stopped"])
    def test_a_producer_dying_mid_transfer_fails_keys_within_timeout(
        self,
        fate: str,
        producer: PeerProcess,
        expected: torch.Tensor,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The producer answers, then dies (SIGKILL) or freezes (SIGSTOP: alive, never
        progresses) just as the bytes start to move; the survivor then loads from
        another producer at once."""
        big = 1024
        consumer = self.open_consumer(num_blocks=big)
        conn = consumer.connector
        try:
            where = self.transfer_call(conn)
            if where is None:
                pytest.skip(f"{type(self).__name__} names no transfer_call (where bytes start)")
            owner, name = where
            with self.spawn_producer(big, capacity_bytes=20 * 2**20) as doomed:
                real = getattr(owner, name)

                def transfer_as_it_dies(*args: Any, **kwargs: Any) -> Any:
                    if fate == "killed":
                        doomed.kill()
                    else:
                        os.kill(doomed.pid, signal.SIGSTOP)
                    return real(*args, **kwargs)

                monkeypatch.setattr(owner, name, transfer_as_it_dies)
                start = time.monotonic()
                during = consumer.load(doomed.keys, list(range(big)), doomed.address)
                elapsed = time.monotonic() - start
                monkeypatch.undo()
                if fate == "stopped":
                    os.kill(doomed.pid, signal.SIGCONT)
            assert elapsed < conn.config.timeout_s + 1, elapsed
            assert statuses(during) == ["failed"] * big
            again = consumer.load(producer.keys, list(range(self.blocks)), producer.address)
            assert again.ok and torch.equal(consumer.blocks(range(self.blocks)), expected)
        finally:
            conn.close()
