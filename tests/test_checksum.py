"""``checksum``: damaged blocks end failed, never ok; the checksum lives with the block.

(It also passes the conformance suite over ``cpu`` and ``disk``: see
``test_multi_conformance.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvmux.backend import Backend
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.connector import Connector
from kvmux.handle import Status
from kvmux.integrity import TRAILER_BYTES, ChecksumBackend
from kvmux.keys import BlockKey, chain_keys
from kvmux.registry import create_connector
from kvmux.testing.faults import CorruptBytes, FaultWrapper
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory

N = 4
SRC, DST = list(range(N)), list(range(8, 8 + N))
KEYS: list[BlockKey] = chain_keys(list(range(N * 4)), 4, "checksum")


@pytest.fixture
def memory() -> KVMemory:
    return KVMemory(DEFAULT_LAYOUT, 16, "cpu", seed=9)


Open = Callable[[dict[str, Any]], Connector]


@pytest.fixture
def open_(memory: KVMemory) -> Iterator[Open]:
    """``open_(config)``: a registered connector from a config, closed after the test."""
    opened: list[Connector] = []

    def build(config: dict[str, Any]) -> Connector:
        conn = create_connector(config)
        conn.register(memory.layout, memory.caches)
        opened.append(conn)
        return conn

    yield build
    for conn in opened:
        conn.close()


def disk(path: Path, algorithm: str | None = "crc32") -> dict[str, Any]:
    """A disk store behind the wrapper; the disk's own checksum is off, so what these
    tests see caught is caught by the wrapper."""
    inner = {"backend": "disk", "path": str(path), "checksum": False}
    if algorithm is None:
        return inner
    return {"backend": "checksum", "inner": inner, "algorithm": algorithm}


def statuses(conn: Connector) -> list[Status]:
    return [o.status for o in conn.load(KEYS, DST).result(timeout=5).outcomes]


@pytest.mark.parametrize("algorithm", ["crc32", "blake2b"])
def test_a_block_damaged_in_transit_ends_failed_with_the_reason(
    algorithm: str, memory: KVMemory
) -> None:
    pool = CpuPoolBackend(CpuPoolConfig(capacity_bytes=2**20))
    conn = Connector(ChecksumBackend.wrap(CorruptBytes(pool, keys=[KEYS[1]]), algorithm))
    conn.register(memory.layout, memory.caches)
    assert conn.save(KEYS, SRC).result(timeout=5).ok
    result = conn.load(KEYS, DST).result(timeout=5)
    assert [o.status for o in result.outcomes] == [Status.OK, Status.FAILED, Status.OK, Status.OK]
    assert f"checksum mismatch ({algorithm})" in (result.outcomes[1].reason or "")
    ok = [0, 2, 3]
    assert memory.blocks([DST[i] for i in ok]).equal(memory.blocks([SRC[i] for i in ok]))
    stats = conn.stats()
    assert (stats["checksum_verified"], stats["checksum_mismatches"]) == (3, 1)
    conn.close()


def test_a_refused_block_is_dropped_so_lookup_stops_counting_it(memory: KVMemory) -> None:
    pool = Connector(CpuPoolBackend(CpuPoolConfig(capacity_bytes=2**20)))
    conn = Connector(ChecksumBackend.wrap(CorruptBytes(pool.backend, keys=[KEYS[2]])))
    conn.register(memory.layout, memory.caches)
    assert conn.save(KEYS, SRC).result(timeout=5).ok
    assert conn.lookup(KEYS) == N
    assert statuses(conn) == [Status.OK, Status.OK, Status.FAILED, Status.OK]
    assert conn.lookup(KEYS) == 2
    assert pool.lookup(KEYS[2:3]) == 0  # the store itself no longer has it
    assert conn.lookup(KEYS[3:]) == 1  # the intact blocks stay
    conn.close()


def block_files(root: Path) -> dict[BlockKey, Path]:
    return {k: p for k in KEYS for p in root.rglob("*.kv") if k.digest.hex() in p.name}


def test_another_keys_intact_block_is_refused(tmp_path: Path, open_: Open) -> None:
    """The digest covers the key: a store that hands out the right bytes under the wrong
    name (here a file renamed to another key's) is caught, though the block is intact."""
    first = open_(disk(tmp_path))
    assert first.save(KEYS[:2], SRC[:2]).result(timeout=5).ok
    first.close()
    files = block_files(tmp_path)
    files[KEYS[1]].replace(files[KEYS[0]])
    conn = open_(disk(tmp_path))
    result = conn.load(KEYS[:1], DST[:1]).result(timeout=5)
    assert result.outcomes[0].status is Status.FAILED
    assert "another key's" in (result.outcomes[0].reason or "")
    assert conn.lookup(KEYS[:1]) == 0
    assert not files[KEYS[0]].exists()


def flip_a_byte_in_every_block_file(root: Path, offset_from_end: int) -> int:
    files = sorted(root.rglob("*.kv"))
    for path in files:
        data = bytearray(path.read_bytes())
        data[-offset_from_end] ^= 0xFF
        path.write_bytes(bytes(data))
    return len(files)


@pytest.mark.parametrize(
    "offset_from_end", [TRAILER_BYTES + 100, 1], ids=["damaged-data", "damaged-checksum"]
)
def test_the_checksum_is_stored_with_the_block_and_survives_a_restart(
    offset_from_end: int, tmp_path: Path, open_: Open
) -> None:
    first = open_(disk(tmp_path))
    assert first.save(KEYS, SRC).result(timeout=5).ok
    first.close()
    assert statuses(open_(disk(tmp_path))) == [Status.OK] * N  # a new instance verifies them
    assert flip_a_byte_in_every_block_file(tmp_path, offset_from_end) == N
    assert statuses(open_(disk(tmp_path))) == [Status.FAILED] * N


def test_without_a_checksum_the_same_damage_loads_ok(tmp_path: Path, open_: Open) -> None:
    plain = open_(disk(tmp_path, algorithm=None))
    assert plain.save(KEYS, SRC).result(timeout=5).ok
    flip_a_byte_in_every_block_file(tmp_path, 100)
    assert statuses(plain) == [Status.OK] * N


def test_blocks_with_and_without_checksums_never_mix(tmp_path: Path, open_: Open) -> None:
    """The trailer is part of the layout, so each variant has its own namespace."""
    crc = open_(disk(tmp_path, "crc32"))
    assert crc.save(KEYS, SRC).result(timeout=5).ok
    assert open_(disk(tmp_path, algorithm=None)).lookup(KEYS) == 0
    assert open_(disk(tmp_path, "blake2b")).lookup(KEYS) == 0
    assert crc.lookup(KEYS) == N


class Bounded(FaultWrapper):
    """A backend that holds blocks of at most 1 KiB."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.capabilities = replace(inner.capabilities, max_block_nbytes=1024)


def test_the_wrapper_declares_what_the_inner_backend_declares_less_the_trailer() -> None:
    inner = Bounded(CpuPoolBackend(CpuPoolConfig()))
    wrapped = Connector(ChecksumBackend.wrap(inner))
    assert wrapped.capabilities == replace(inner.capabilities, max_block_nbytes=1024 - 16)
    assert wrapped.config.algorithm == "crc32"
    wrapped.close()
