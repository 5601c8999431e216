"""``kvmux bench multi`` measures what it says, on a shape small enough for a test."""

from __future__ import annotations

from kvmux.bench.multi import bench_multi, table
from kvmux.bench.shapes import Shape


def test_multi_bench_reports_each_scenario_beside_its_reference():
    shape = Shape("tiny", blocks=8, layers=2, tokens=4, heads=2, head_dim=8)
    records = bench_multi(shape, repeats=1)
    assert [r.scenario for r in records] == [
        "multi[fallback: cpu]",
        "half lost",
        "first child hangs",
    ]
    assert all(r.seconds > 0 and r.reference_seconds > 0 for r in records)
    assert "timeout 0.2s" in table(records)
