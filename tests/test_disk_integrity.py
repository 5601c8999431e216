"""``disk`` checks what it reads: damaged, misnamed and unverifiable files never load as ok.

And a full disk says so: saves fail with one reason naming the directory and
the cause, ``register`` names the path (on a real, small tmpfs).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from kvmux.backends.block_file import CHECKED_SUFFIX, HEADER_BYTES, RAW_SUFFIX
from kvmux.connector import Connector
from kvmux.errors import StorageError
from kvmux.handle import Status
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.registry import create_connector

from support import fill_up, keys, small_tmpfs


def _disk(path: Path, layout: KVLayout, caches: dict[str, torch.Tensor], **extra: object):
    c = create_connector({"backend": "disk", "path": str(path), **extra})
    c.register(layout, caches)
    return c


def _stored(
    path: Path, layout: KVLayout, caches: dict[str, torch.Tensor], n: int, **extra: object
) -> list[BlockKey]:
    """Save blocks ``0..n-1`` with an instance that is closed again: a store on disk that
    no instance has open. The keys they were saved under."""
    ks = keys(n)
    with _disk(path, layout, caches, **extra) as d:
        assert d.save(ks, list(range(n))).result().ok
    return ks


def block_file(root: Path, layout: KVLayout, key: BlockKey) -> Path:
    """The one file that holds ``key``'s block, whatever its format."""
    hits = [p for p in (root / layout.fingerprint()).iterdir() if key.digest.hex() in p.name]
    assert len(hits) == 1, hits
    return hits[0]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01  # one bit: the least damage there is
    path.write_bytes(bytes(data))


def assert_block(caches: dict[str, torch.Tensor], loaded: int, saved: int) -> None:
    for name, tensor in caches.items():
        assert torch.equal(tensor[loaded], tensor[saved]), name


@pytest.mark.parametrize(
    "offset",
    [4, HEADER_BYTES, HEADER_BYTES + 5000, -1],
    ids=["in-the-checksum", "first-data-byte", "mid-block", "last-byte"],
)
def test_a_flipped_bit_fails_its_key_and_the_file_is_removed(
    offset: int, tmp_path: Path, caches, layout
) -> None:
    ks = keys(3)
    with _disk(tmp_path, layout, caches) as d:
        assert d.save(ks, [0, 1, 2]).result().ok
        victim = block_file(tmp_path, layout, ks[1])
        assert victim.suffix == CHECKED_SUFFIX
        flip(victim, offset)
        result = d.load(ks, [10, 11, 12]).result()
        assert [o.status for o in result.outcomes] == [Status.OK, Status.FAILED, Status.OK]
        reason = result.outcomes[1].reason or ""
        assert "checksum mismatch" in reason and str(victim) in reason, reason
        assert_block(caches, 10, 0)
        assert_block(caches, 12, 2)
        assert not victim.exists()
        assert d.lookup(ks) == 1
        assert d.lookup(ks[2:]) == 1  # only the damaged block is gone
        assert d.stats()["damaged_blocks_removed"] == 1
        # The engine recomputes the block and saves it again: that copy is sound.
        assert d.save(ks[1:2], [1]).result().ok
        assert d.load(ks[1:2], [11]).result().ok
        assert_block(caches, 11, 1)


def test_damage_done_while_no_instance_runs_is_found_by_the_next(
    tmp_path: Path, caches, layout
) -> None:
    ks = _stored(tmp_path, layout, caches, 2)
    flip(block_file(tmp_path, layout, ks[0]), HEADER_BYTES + 100)
    with _disk(tmp_path, layout, caches) as d:
        assert d.lookup(ks) == 2  # not read yet: lookup is cheap, it opens no file
        statuses = [o.status for o in d.load(ks, [5, 6]).result().outcomes]
        assert statuses == [Status.FAILED, Status.OK]
        assert d.lookup(ks) == 0
    with _disk(tmp_path, layout, caches) as d:
        assert d.lookup(ks) == 0 and d.lookup(ks[1:]) == 1


def test_a_block_file_renamed_to_another_keys_name_is_refused(
    tmp_path: Path, caches, layout
) -> None:
    """The checksum covers the key: an intact block under the wrong name is not that key's."""
    ks = _stored(tmp_path, layout, caches, 2)
    first, second = (block_file(tmp_path, layout, k) for k in ks)
    second.replace(first)  # the second block, intact, now named after the first key
    with _disk(tmp_path, layout, caches) as d:
        assert d.lookup(ks[:1]) == 1
        result = d.load(ks, [5, 6]).result()
        assert [o.status for o in result.outcomes] == [Status.FAILED, Status.MISSING]
        assert "another key's block" in (result.outcomes[0].reason or "")
        assert d.lookup(ks) == 0
        assert not first.exists()


def test_a_block_file_copied_under_another_keys_name_leaves_the_original_loadable(
    tmp_path: Path, caches, layout
) -> None:
    ks = keys(2)
    with _disk(tmp_path, layout, caches) as d:
        assert d.save(ks, [0, 1]).result().ok
        first, second = (block_file(tmp_path, layout, k) for k in ks)
        shutil.copyfile(second, first)
        result = d.load(ks, [5, 6]).result()
        assert [o.status for o in result.outcomes] == [Status.FAILED, Status.OK]
        assert_block(caches, 6, 1)


def test_a_store_written_without_checksums_is_emptied_not_trusted(
    tmp_path: Path, caches, layout, caplog: pytest.LogCaptureFixture
) -> None:
    """Files without a checksum (``checksum: false``; every store written before kvmux
    checked blocks had exactly this format: the block's bytes as ``<key>.kv``) are
    never loaded by a checking instance: it removes them when it registers, says
    so once, and the blocks are recomputed."""
    ks = _stored(tmp_path, layout, caches, 3, checksum=False)
    store = tmp_path / layout.fingerprint()
    raw = sorted(store.glob(f"*{RAW_SUFFIX}"))
    assert len(raw) == 3
    assert raw[0].stat().st_size == layout.block_nbytes  # the bytes alone, as before
    with caplog.at_level(logging.WARNING, logger="kvmux"):
        checked = _disk(tmp_path, layout, caches)
    with checked as d:
        assert d.lookup(ks) == 0
        assert not any(p.exists() for p in raw)
        [line] = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
        assert "3 block files without checksums" in line and str(store) in line
        assert d.save(ks, [0, 1, 2]).result().ok
        assert d.load(ks, [7, 8, 9]).result().ok
        assert_block(caches, 8, 1)


def test_checksum_off_trusts_the_disk_and_drops_checked_files(
    tmp_path: Path, caches, layout
) -> None:
    """The other direction, and the price of turning checks off: damage loads as ok."""
    ks = _stored(tmp_path, layout, caches, 2)
    with _disk(tmp_path, layout, caches, checksum=False) as d:
        assert d.lookup(ks) == 0
        assert not list((tmp_path / layout.fingerprint()).glob(f"*{CHECKED_SUFFIX}"))
        assert d.save(ks, [0, 1]).result().ok
        flip(block_file(tmp_path, layout, ks[0]), 100)
        assert d.load(ks, [5, 6]).result().ok
        assert not torch.equal(caches["layer.0"][5], caches["layer.0"][0])


def test_a_file_that_is_not_a_kvmux_block_is_refused(tmp_path: Path, caches, layout) -> None:
    ks = keys(1)
    with _disk(tmp_path, layout, caches) as d:
        assert d.save(ks, [0]).result().ok
        victim = block_file(tmp_path, layout, ks[0])
        data = bytearray(victim.read_bytes())
        data[:4] = b"JUNK"
        victim.write_bytes(bytes(data))
        [outcome] = d.load(ks, [3]).result().outcomes
        assert outcome.status is Status.FAILED
        assert "not a kvmux block file" in (outcome.reason or "")
        assert d.lookup(ks) == 0


# ----------------------------------------------------------------- a full disk


def file_pages(layout: KVLayout) -> int:
    return -(-(layout.block_nbytes + HEADER_BYTES) // 4096)


def test_saves_on_a_full_disk_fail_with_one_reason_naming_the_directory(
    tmp_path: Path, caches, layout
) -> None:
    pages = 1 + 2 * file_pages(layout)  # layout.json and two blocks
    with small_tmpfs(tmp_path, 4 * pages) as mount, _disk(mount, layout, caches) as d:
        ks = keys(5)
        result = d.save(ks, [0, 1, 2, 3, 4]).result()
        assert [o.ok for o in result.outcomes] == [True, True, False, False, False]
        reasons = {o.reason for o in result.outcomes[2:]}
        assert len(reasons) == 1, reasons  # one cause, one reason: a caller logs it once
        [reason] = reasons
        assert str(mount / layout.fingerprint()) in (reason or "")
        assert "ENOSPC" in (reason or "")
        assert d.lookup(ks) == 2
        assert d.load(ks[:2], [10, 11]).result().ok
        assert_block(caches, 11, 1)
        leftovers = [p.name for p in (mount / layout.fingerprint()).iterdir()]
        assert not [n for n in leftovers if n.startswith(".tmp")], leftovers
        d.release(ks[:2])  # room again: saving works again
        assert d.save(ks[2:4], [2, 3]).result().ok


def test_register_on_a_full_disk_names_the_path(tmp_path: Path, caches, layout) -> None:
    with small_tmpfs(tmp_path, 64) as mount:
        fill_up(mount)
        disk: Connector = create_connector({"backend": "disk", "path": str(mount)})
        with disk, pytest.raises(StorageError) as err:
            disk.register(layout, caches)
        message = str(err.value)
        assert str(mount / layout.fingerprint()) in message and "ENOSPC" in message


def test_an_existing_store_on_a_full_disk_still_opens_and_loads(
    tmp_path: Path, caches, layout
) -> None:
    with small_tmpfs(tmp_path, 4 * (1 + 2 * file_pages(layout)) + 64) as mount:
        ks = _stored(mount, layout, caches, 2)
        fill_up(mount)
        with _disk(mount, layout, caches) as d:
            assert d.load(ks, [5, 6]).result().ok
            assert_block(caches, 6, 1)
