"""Real vLLM on a ``disk`` store whose file went bad: the tokens stay a single instance's.

The engine saves the prompts' blocks, one block file is damaged on disk,
vLLM forgets its own prefix cache, and the prompts run again: the damaged
block must fail its checksum and be recomputed. The control runs the same
damage with checksums off (what ``disk`` did before it checked blocks) and
must give *other* tokens, or the first half would prove nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvmux.backends.block_file import CHECKED_SUFFIX, RAW_SUFFIX
from kvmux.testing.vllm_engine import EngineProcess
from vllm_e2e_support import FULL_BLOCKS, MAX_TOKENS, PROMPTS, spec, tokens

pytestmark = pytest.mark.timeout(600)

DAMAGED_BYTES = 1024


def saved_block_files(store: Path, suffix: str, count: int, timeout_s: float = 60) -> list[Path]:
    """The store's block files once all ``count`` are written (saves end after the step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(store.rglob(f"*{suffix}"))
        if len(files) >= count or time.monotonic() > deadline:
            assert len(files) == count, f"{len(files)} block files in {store}, expected {count}"
            return files
        time.sleep(0.1)


def invert_middle(path: Path) -> None:
    """What a bad sector does to a block: a run of its bytes turned to garbage."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start : start + DAMAGED_BYTES] = bytes(
        b ^ 0xFF for b in data[start : start + DAMAGED_BYTES]
    )
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("checksum", [True, False], ids=["checked", "unchecked-control"])
def test_a_damaged_block_file_is_recomputed_not_served(
    tiny_model_dir: str, vllm_reference: list[list[int]], tmp_path: Path, checksum: bool
) -> None:
    store = tmp_path / "kv"
    backend = {"backend": "disk", "path": str(store), "checksum": checksum}
    with EngineProcess(spec(tiny_model_dir, backend)) as engine:
        assert tokens(engine.generate(PROMPTS, MAX_TOKENS)) == vllm_reference
        suffix = CHECKED_SUFFIX if checksum else RAW_SUFFIX
        files = saved_block_files(store, suffix, FULL_BLOCKS)
        invert_middle(files[0])
        assert engine.call("reset_prefix_cache")["ok"]  # vLLM forgets; kvmux reads the disk
        again = tokens(engine.generate(PROMPTS, MAX_TOKENS))
        stats = engine.call("stats")["stats"]
    if checksum:
        assert again == vllm_reference
        assert stats["load_blocks_failed"] == 1
        assert stats["damaged_blocks_removed"] == 1
        assert stats["load_blocks_ok"] >= FULL_BLOCKS - 1
    else:
        assert stats.get("load_blocks_failed", 0) == 0  # the damage loaded as "ok"...
        assert again != vllm_reference  # ...and became wrong tokens
