"""``kvmux bench`` measures real transfers next to baselines and reports them as records."""

from __future__ import annotations

import json
import sys

import pytest

from kvmux.bench.shapes import Shape
from kvmux.bench.transfer import (
    ONE_BLOCK_ROUNDS,
    BenchRecord,
    _save_load_seconds,
    bench_backend,
)
from kvmux.cli.bench import _runs, _table
from kvmux.cli.main import main

from support import kvmux_cli

TINY = Shape("tiny", blocks=8, layers=2, tokens=16, heads=2)


def test_socket_backends_are_measured_next_to_memcpy_and_a_raw_socket() -> None:
    records = bench_backend("tcp", TINY, repeats=1)
    assert [r.baseline for r in records] == ["memcpy", "socket"]
    for r in records:
        assert r.error is None and r.gbps is not None and r.gbps > 0
        assert r.ratio is not None and r.ratio > 0 and r.baseline_gbps > 0
    assert records[0].gbps == records[1].gbps  # one measurement, two baselines


def test_a_failing_backend_is_a_row_with_its_error_not_a_crash() -> None:
    (broken,) = bench_backend("nosuchbackend", TINY, repeats=1)
    assert broken.gbps is None and broken.ratio is None
    assert broken.error is not None and "nosuchbackend" in broken.error


def test_cli_json_records_carry_the_documented_fields() -> None:
    proc = kvmux_cli(
        "bench", "--backend", "cpu", "--shape", "256x256KiB", "--repeats", "1", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    (record,) = json.loads(proc.stdout)
    for field in ("backend", "shape", "gbps", "baseline", "baseline_gbps", "ratio"):
        assert record[field] is not None, field
    assert record["backend"] == "cpu" and record["shape"] == "256x256KiB"
    assert record["lookup_ms_10k"] > 0
    assert "kvmux bench" in proc.stderr  # the progress bar goes to stderr


def test_config_fields_reach_the_backend_and_are_recorded() -> None:
    (plain,) = bench_backend("disk", TINY, repeats=1, config={"checksum": False})
    assert plain.error is None and plain.config == {"checksum": False}
    (typo,) = bench_backend("disk", TINY, repeats=1, config={"chekcsum": False})
    assert typo.error is not None and "chekcsum" in typo.error


def test_cli_config_must_be_a_json_object() -> None:
    proc = kvmux_cli("bench", "--backend", "disk", "--config", "[1]")
    assert proc.returncode == 2
    assert "--config: must be a JSON object" in proc.stderr


def test_without_tqdm_the_bench_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` fail
    assert main(["bench", "--backend", "cpu", "--repeats", "1"]) == 2
    assert "kvmux bench needs tqdm: pip install 'kvmux[bench]'" in capsys.readouterr().err


def test_a_p2p_one_block_load_is_also_timed_from_another_process() -> None:
    one = Shape("1x256KiB", blocks=1, layers=8, tokens=16, heads=8)
    records = bench_backend("tcp", one, repeats=1)
    assert {r.baseline for r in records} == {"memcpy", "socket"}
    assert all(r.error is None for r in records), records
    # one figure for the backend, on each of its rows
    (other,) = {r.load_us_other_process for r in records}
    assert other is not None and 0 < other < 1e6
    (cpu,) = {r.load_cpu_us_other_process for r in records}
    assert cpu is not None and 0 < cpu < 1e6
    (floor,) = {r.round_trip_us for r in records}
    assert floor is not None and 0 < floor < other  # a load is one round trip and more
    (local,) = bench_backend("cpu", one, repeats=1)
    assert local.load_us_other_process is None  # no peer to load from
    assert local.load_cpu_us_other_process is None and local.round_trip_us is None


def test_the_table_sets_a_p2p_load_beside_the_raw_librarys_read_alone() -> None:
    """A raw-library row's ratio includes kvmux's save copy; the table also shows the
    transport alone: the backend's load beside the raw library's read."""
    memcpy = _memcpy_row("nixl", "256x256KiB", gbps=2.0, save_gbps=10.0, load_gbps=3.0)
    memcpy = memcpy.model_copy(update=dict(baseline_gbps=8.0, ratio=0.25))
    raw = memcpy.model_copy(
        update=dict(baseline="nixl", baseline_gbps=3.2, ratio=0.62, baseline_load_gbps=4.0)
    )
    rows = [memcpy, raw]
    lines = _table(rows).splitlines()
    assert (
        "nixl 256x256KiB: its load alone 3.00 GB/s, raw nixl's read alone 4.00 GB/s (0.75x)"
        in lines
    )
    assert not any("read alone" in line for line in _table(rows[:1]).splitlines())


def test_every_row_carries_the_copy_kernel_alone_on_the_same_blocks() -> None:
    """memcpy copies one contiguous buffer; the kernel figure says how much of the gap
    is the blocks' scatter and how much is kvmux's bookkeeping."""
    (local,) = bench_backend("cpu", TINY, repeats=1)
    assert local.error is None and local.copy_gbps is not None and local.copy_gbps > 0
    records = bench_backend("tcp", TINY, repeats=1)
    (kernel,) = {r.copy_gbps for r in records}  # one figure for the backend, on each row
    assert kernel is not None and kernel > 0
    (broken,) = bench_backend("nosuchbackend", TINY, repeats=1)
    assert broken.copy_gbps is None  # nothing moved, nothing to set beside it


def test_the_table_sets_a_row_beside_the_copy_kernel_alone() -> None:
    row = _memcpy_row("cpu", "4096x16KiB", gbps=3.0, save_gbps=6.0, load_gbps=6.0)
    row = row.model_copy(update=dict(copy_gbps=4.0))
    lines = _table([row, row.model_copy(update=dict(baseline="socket"))]).splitlines()
    expected = (
        "cpu 4096x16KiB: the same scattered blocks through kvmux's copy kernel alone "
        "4.00 GB/s (0.67x memcpy); cpu 0.75x the kernel"
    )
    assert [line for line in lines if "copy kernel" in line] == [expected]
    one = _memcpy_row("cpu", "1x256KiB", gbps=2.0, save_gbps=4.0, load_gbps=4.0)
    one = one.model_copy(update=dict(copy_gbps=4.0))
    assert not any("copy kernel" in line for line in _table([one]).splitlines())


def test_a_one_block_batch_is_timed_over_many_rounds_after_a_warm_up() -> None:
    """Its figure is a time added per batch of ~100 µs, which a handful of rounds of a
    new pair overstates: threads and links are still being made."""
    rounds: list[tuple[list[int], list[int]]] = []
    one = Shape("1x256KiB", blocks=1, layers=8, tokens=16, heads=8)
    _save_load_seconds("cpu", one, 1, {}, lambda src, dst: rounds.append((src, dst)))
    assert len(rounds) == ONE_BLOCK_ROUNDS  # timed rounds only, each told its blocks
    assert all(len(src) == len(dst) == 1 for src, dst in rounds)
    rounds.clear()
    _save_load_seconds("cpu", TINY, 3, {}, lambda src, dst: rounds.append((src, dst)))
    assert len(rounds) == 3
    assert all(sorted(src) == list(range(TINY.blocks)) for src, _ in rounds)


def _memcpy_row(backend: str, shape: str, **figures: float) -> BenchRecord:
    """A table row against memcpy at 6 GB/s, with the backend's ``figures``."""
    gbps = figures["gbps"]
    blocks, nbytes = {"256x256KiB": (256, 262144), "4096x16KiB": (4096, 16384)}.get(
        shape, (1, 262144)
    )
    return BenchRecord(
        backend=backend,
        shape=shape,
        blocks=blocks,
        block_nbytes=nbytes,
        baseline="memcpy",
        baseline_gbps=6.0,
        ratio=gbps / 6.0,
        **figures,
    )


def test_backends_that_can_borrow_blocks_are_measured_both_ways_by_default() -> None:
    borrow = {"save_mode": "borrow"}
    assert _runs(["cpu", "shm", "tcp"], {}) == [
        ("cpu", {}),
        ("shm", {}),
        ("tcp", {}),
        ("tcp", borrow),
    ]
    assert _runs(["tcp"], {"timeout_s": 5}) == [("tcp", {"timeout_s": 5})]


def test_a_borrowing_run_is_timed_with_its_blocks_given_back_between_rounds() -> None:
    records = bench_backend("tcp", TINY, repeats=2, config={"save_mode": "borrow"})
    assert all(r.error is None and r.ratio for r in records), records
    assert "tcp borrow" in _table(records)
