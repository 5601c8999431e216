"""A failed save under vLLM is logged once per cause: never silently, never per block."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvmux.adapters.vllm.save_failures import MAX_CAUSES, SaveFailureLog
from kvmux.handle import OK, Handle, failed
from kvmux.keys import chain_keys

from support import small_tmpfs

pytestmark = pytest.mark.timeout(120)

KEYS = chain_keys(list(range(4 * 8)), 8, "save-failures")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_each_cause_is_logged_once_with_the_request_it_first_hit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watcher = SaveFailureLog("disk")
    full = failed("cannot write blocks in /kv/abc: ENOSPC (No space left on device)")
    broken = failed("read-only file system")
    with caplog.at_level(logging.WARNING, logger="kvmux"):
        watcher.watch("req-1", Handle.completed(KEYS, [OK, full, full, full]))
        watcher.watch("req-2", Handle.completed(KEYS, [full, full, broken, OK]))
        watcher.watch("req-3", Handle.completed(KEYS, [full] * 4))
        watcher.watch("req-4", Handle.completed(KEYS, [OK] * 4))
    lines = warnings(caplog)
    assert len(lines) == 2, lines
    assert "ENOSPC" in lines[0] and "/kv/abc" in lines[0]
    assert "3 of 4 blocks of request req-1" in lines[0]
    assert "read-only file system" in lines[1] and "request req-2" in lines[1]


def test_past_the_cap_on_causes_one_line_says_the_rest_go_unlogged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watcher = SaveFailureLog("tcp")
    with caplog.at_level(logging.WARNING, logger="kvmux"):
        for i in range(MAX_CAUSES + 10):
            watcher.watch(f"r{i}", Handle.completed(KEYS[:1], [failed(f"cause {i}")]))
    lines = warnings(caplog)
    assert len(lines) == MAX_CAUSES + 1
    assert "further causes are not logged" in lines[-1]


def test_a_full_disk_under_vllms_scheduler_logs_once_and_requests_still_finish(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("vllm")
    from kvmux.models import tiny_model
    from vllm_harness import BLOCK, FakeEngine

    # layout.json and two 2 KiB blocks (one page each) fit; the third block does not.
    with small_tmpfs(tmp_path, 12) as mount:
        engine = FakeEngine(tiny_model(), {"backend": "disk", "path": str(mount)})
        try:
            with caplog.at_level(logging.WARNING, logger="kvmux"):
                reqs = [
                    engine.add([3 + (s * 17 + i * 5) % 250 for i in range(4 * BLOCK)], 2)
                    for s in range(3)
                ]
                engine.run()
            assert all(engine.finished(r) for r in reqs)
            assert engine.kv_errors == []
            stats = engine.worker.worker_side.stats()
            assert stats["save_blocks_ok"] == 2
            assert stats["save_blocks_failed"] >= 8
            lines = [m for m in warnings(caplog) if "saves to backend" in m]
            assert len(lines) == 1, lines
            assert "ENOSPC" in lines[0] and str(mount) in lines[0], lines[0]
        finally:
            engine.close()
