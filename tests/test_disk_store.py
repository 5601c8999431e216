"""The disk store: atomic files, persistence, a capacity bound, errors at creation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmux.backends.block_file import CHECKED_SUFFIX
from kvmux.errors import ConfigError
from kvmux.handle import Status
from kvmux.layout import KVLayout
from kvmux.registry import create_connector

from support import keys, make_caches


def _disk(path: Path, layout: KVLayout, caches: dict[str, torch.Tensor], **extra: object):
    c = create_connector({"backend": "disk", "path": str(path), **extra})
    c.register(layout, caches)
    return c


def test_blocks_survive_a_restart(tmp_path: Path, caches, layout) -> None:
    ks = keys(4)
    with _disk(tmp_path, layout, caches) as d:
        assert d.save(ks, [0, 1, 2, 3]).result().ok
    fresh = make_caches(seed=99)
    with _disk(tmp_path, layout, fresh) as d:
        assert d.lookup(ks) == 4
        assert d.load(ks, [4, 5, 6, 7]).result().ok
    for name in caches:
        assert torch.equal(fresh[name][4:8], caches[name][0:4])


def test_unfinished_write_is_never_readable_and_is_cleaned_up(
    tmp_path: Path, caches, layout
) -> None:
    with _disk(tmp_path, layout, caches) as d:
        d.save(keys(1), [0]).result()
    block_dir = tmp_path / layout.fingerprint()
    leftover = block_dir / ".tmp-crashed"
    leftover.write_bytes(b"half a block")
    with _disk(tmp_path, layout, caches) as d:
        assert not leftover.exists()
        assert d.stats()["blocks_stored"] == 1


def test_registering_keeps_a_write_still_in_progress_in_another_process(
    tmp_path: Path, caches, layout
) -> None:
    """A decode instance starting on a store a prefill is writing must not delete
    the prefill's temporary files (CI saw its layout write fail with ENOENT)."""
    with _disk(tmp_path, layout, caches) as d:
        d.save(keys(1), [0]).result()
    block_dir = tmp_path / layout.fingerprint()
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        in_progress = block_dir / f".tmp-{writer.pid}-abc"
        abandoned = block_dir / f".tmp-{gone.pid}-abc"
        in_progress.write_bytes(b"half a block")
        abandoned.write_bytes(b"half a block")
        with _disk(tmp_path, layout, caches) as d:
            assert in_progress.exists()
            assert not abandoned.exists()
            assert d.stats()["blocks_stored"] == 1
    finally:
        writer.kill()
        writer.wait()


def test_truncated_block_file_fails_that_key_instead_of_loading_garbage(
    tmp_path: Path, caches, layout
) -> None:
    ks = keys(2)
    with _disk(tmp_path, layout, caches) as d:
        d.save(ks, [0, 1]).result()
        victim = next(
            p for p in (tmp_path / layout.fingerprint()).iterdir() if ks[1].digest.hex() in p.name
        )
        with open(victim, "r+b") as f:
            f.truncate(100)
        result = d.load(ks, [5, 6]).result()
        assert result.outcomes[0].ok
        assert result.outcomes[1].status is Status.FAILED
        assert "wrong size" in (result.outcomes[1].reason or "")
        assert d.lookup(ks) == 1


def test_capacity_bound_evicts_least_recently_used_files(tmp_path: Path, caches, layout) -> None:
    ks = keys(6)
    with _disk(tmp_path, layout, caches, capacity_bytes=3 * layout.block_nbytes) as d:
        for i in range(6):
            d.save([ks[i]], [i]).result()
        store = tmp_path / layout.fingerprint()
        files = [p for p in store.iterdir() if p.suffix == CHECKED_SUFFIX]
        assert len(files) == 3
        assert d.lookup(ks[3:]) == 3 and d.lookup(ks[:3]) == 0


def test_layouts_do_not_share_blocks(tmp_path: Path, caches, layout) -> None:
    ks = keys(2)
    with _disk(tmp_path, layout, caches) as d:
        d.save(ks, [0, 1]).result()
    other = make_caches(dtype=torch.bfloat16)
    with _disk(tmp_path, KVLayout.from_caches(other, 16), other) as d:
        assert d.lookup(ks) == 0


def test_unwritable_path_is_an_error_at_creation(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    target = locked / "blocks"
    if os.access(locked, os.W_OK):  # root ignores permissions: use a path under a file
        target = tmp_path / "a-file" / "blocks"
        (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError) as err:
        create_connector({"backend": "disk", "path": str(target)})
    assert err.value.backend == "disk"
    assert err.value.problems[0][0] == "path"
