"""``kvmux bench serve`` on real vLLM servers: the smallest run that goes through it all.

One 1P1D topology over ``shm`` (two pinned servers and the proxy), one rate,
a few seconds of arrivals of short prompts, a two-batch step profile and the
cross-check with vLLM's own serving benchmark: about two minutes on two
cores. The colocated topology differs only in its servers' flags and the
proxy's mode, each tested on its own (``test_proxy.py``, ``test_bench_serve.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmux.bench.serve.metrics import Slo
from kvmux.bench.serve.report import ServeReport
from kvmux.bench.serve.run import run_serve
from kvmux.bench.serve.settings import ServeSettings
from kvmux.bench.serve.workload import RequestMix

pytestmark = pytest.mark.timeout(400)


def test_smallest_serve_run_measures_pd_loads_kv_and_agrees_with_vllms_definitions(
    tmp_path: Path,
) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("aiohttp")
    settings = ServeSettings(
        rates=(2.0,),
        chunk_sizes=(),
        backends=("shm",),
        duration_s=3.0,
        mix=RequestMix(
            long_prompt_tokens=400,
            long_prompt_output_tokens=4,
            long_output_prompt_tokens=32,
            long_output_tokens=24,
        ),
        slo=Slo(ttft_ms=60_000, itl_ms=60_000),  # a busy test machine: every request is good
        request_timeout_s=120.0,
        step_batches=(1, 2),
        step_tokens=8,
    )
    report = run_serve(settings, tmp_path, progress=print)

    (run,) = report.runs
    assert run.topology == "1P1D shm"
    assert run.completed == run.requests == 6, run.errors
    assert run.itl is not None and run.itl.samples > 0
    assert run.output_tokens == sum(r.max_tokens for r in settings.plan_for(0))
    assert run.goodput == pytest.approx(run.request_throughput)
    kv = report.kv_loaded["1P1D shm"]
    assert kv["load_blocks_ok"] > 0, kv  # decode loaded KV, it did not recompute
    assert kv["load_blocks_failed"] == kv["load_blocks_missing"] == 0
    check = report.crosscheck
    assert check is not None, report.crosscheck_error
    assert all(d.agrees for d in check.definitions), check.definitions
    saved = ServeReport.model_validate(json.loads((tmp_path / "results.json").read_text()))
    assert saved.runs == report.runs
    assert report.steps is not None, report.notes
    assert [(s.path, s.batch) for s in report.steps.steps][:3] == [
        ("direct", 1),
        ("via proxy", 1),
        ("kvmux decode server", 1),
    ]
    assert [p.prompt_tokens for p in report.steps.prefills] == [400]
    summary = (tmp_path / "summary.md").read_text()
    assert "| 1P1D shm | 2 | 6 / 6 |" in summary
    assert "Cross-check with vLLM's serving benchmark" in summary
    assert "## The mechanism, measured on one core" in summary
