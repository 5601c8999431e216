"""``kvmux bench serve``: the workload, the metrics, the claim check and the report,
on synthetic data; the load generator against a fake streaming server.

The real-vLLM smoke run is in ``test_bench_serve_vllm.py``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from kvmux.bench.serve.crosscheck import FigureCheck, compare, timings_from_vllm
from kvmux.bench.serve.load import run_load
from kvmux.bench.serve.metrics import (
    RequestTiming,
    RunMetrics,
    Slo,
    inter_token_latencies,
    percentile,
    summarize,
)
from kvmux.bench.serve.report import (
    ServeReport,
    claim_point,
    crossover,
    markdown,
    verdicts,
    write_json,
)
from kvmux.bench.serve.settings import ServeSettings
from kvmux.bench.serve.workload import PlannedRequest, RequestMix, plan, poisson_arrivals
from kvmux.proxy import running_app

# ------------------------------------------------------------------ workload


def test_poisson_schedule_is_the_same_for_a_seed_and_another_for_another_seed() -> None:
    assert poisson_arrivals(50, 2.0, seed=7) == poisson_arrivals(50, 2.0, seed=7)
    assert poisson_arrivals(50, 2.0, seed=7) != poisson_arrivals(50, 2.0, seed=8)


def test_poisson_gaps_average_one_over_the_rate_and_only_grow() -> None:
    times = poisson_arrivals(20_000, 4.0, seed=1)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_poisson_schedule_refuses_a_rate_that_is_not_positive(rate: float) -> None:
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals(3, rate, seed=0)


def test_plan_mixes_both_kinds_with_exact_lengths_and_distinct_prompts() -> None:
    mix = RequestMix(
        long_prompt_tokens=300,
        long_output_prompt_tokens=20,
        long_output_tokens=40,
        long_prompt_share=0.5,
    )
    planned = plan(mix, rate=5.0, duration_s=40.0, seed=3, prompt_seed=9, vocab_size=512)
    assert len(planned) == 200
    kinds = [r.kind for r in planned]
    assert 0.4 < kinds.count("long-prompt") / len(kinds) < 0.6
    for r in planned:
        if r.kind == "long-prompt":
            assert (len(r.prompt), r.max_tokens) == (300, mix.long_prompt_output_tokens)
        else:
            assert (len(r.prompt), r.max_tokens) == (20, 40)
    assert len({tuple(r.prompt) for r in planned}) == len(planned)
    assert [r.arrival_s for r in planned] == poisson_arrivals(200, 5.0, seed=3)
    assert plan(mix, 5.0, 40.0, seed=3, prompt_seed=9, vocab_size=512) == planned


def test_rates_never_share_prompts_and_a_fresh_replay_keeps_the_schedule() -> None:
    settings = ServeSettings(rates=(1.0, 2.0), duration_s=10.0)
    first, second = settings.plan_for(0), settings.plan_for(1)
    assert not {tuple(r.prompt) for r in first} & {tuple(r.prompt) for r in second}
    fresh, other = settings.plan_for(0, replay=1), settings.plan_for(0, replay=2)
    for replayed in (fresh, other):
        assert [(r.arrival_s, r.kind, r.max_tokens) for r in replayed] == [
            (r.arrival_s, r.kind, r.max_tokens) for r in first
        ]
        assert not {tuple(r.prompt) for r in replayed} & {tuple(r.prompt) for r in first}
    assert not {tuple(r.prompt) for r in fresh} & {tuple(r.prompt) for r in other}


# ------------------------------------------------------------------ metrics


def test_percentile_interpolates_linearly_between_samples() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)


def test_itl_is_the_gap_between_consecutive_token_timestamps() -> None:
    assert inter_token_latencies([1.0, 1.25, 1.5, 2.5]) == [0.25, 0.25, 1.0]
    assert inter_token_latencies([3.0]) == []
    with pytest.raises(ValueError, match="backwards"):
        inter_token_latencies([1.0, 0.5])


def _timing(
    sent: float, first: float, gaps: list[float], kind: str = "long-output", tokens: int = 0
) -> RequestTiming:
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestTiming(kind, sent, tuple(times), tokens or len(times))  # type: ignore[arg-type]


def test_summary_gives_throughput_goodput_and_percentiles_of_synthetic_runs() -> None:
    slo = Slo(ttft_ms=500, itl_ms=100)
    timings = [
        _timing(0.0, 0.2, [0.05] * 9),  # good: TTFT 200 ms, gaps 50 ms
        _timing(1.0, 1.8, [0.05] * 9),  # TTFT 800 ms: misses the SLO
        _timing(2.0, 2.1, [0.05, 0.30, 0.05], kind="long-prompt"),  # one 300 ms stall
        RequestTiming("long-output", 3.0, (), 0, error="HTTP 500: boom"),
    ]
    m = summarize("t", 2.0, timings, slo)
    end = 2.1 + 0.40
    assert (m.requests, m.completed, m.failed) == (4, 3, 1)
    assert m.duration_s == pytest.approx(end)
    assert m.output_tokens == 10 + 10 + 4
    assert m.output_throughput == pytest.approx(24 / end)
    assert m.goodput == pytest.approx(1 / end)
    assert m.errors == ["HTTP 500: boom"]
    assert m.ttft is not None and m.itl is not None and m.e2e is not None
    assert m.ttft.samples == 3
    assert m.ttft.p50_ms == pytest.approx(200)
    assert m.itl.samples == 21
    assert m.itl.p50_ms == pytest.approx(50)
    assert m.itl.p99_ms == pytest.approx(percentile([0.05] * 20 + [0.30], 99) * 1e3)
    assert m.e2e.p50_ms == pytest.approx(650)
    assert m.itl_long_output is not None and m.itl_long_output.samples == 18
    assert len(m.itls_ms) == 21


def test_slo_judges_a_request_by_its_worst_gap_not_its_mean() -> None:
    slo = Slo(ttft_ms=1000, itl_ms=100)
    steady = _timing(0.0, 0.1, [0.09] * 20)
    one_stall = _timing(0.0, 0.1, [0.01] * 19 + [0.2])  # mean gap 20 ms
    assert slo.met_by(steady)
    assert not slo.met_by(one_stall)
    assert not slo.met_by(RequestTiming("long-output", 0.0, (), 0, error="x"))


# ------------------------------------------------------------------ the claim


def _run(
    topology: str, rate: float, throughput: float, p99_itl_ms: float, goodput: float
) -> RunMetrics:
    """A run whose only figures that matter are throughput, p99 ITL and goodput."""
    base = summarize(topology, rate, [_timing(0.0, 0.1, [0.01, 0.02])], Slo())
    assert base.itl is not None
    itl = base.itl.model_copy(update={"p99_ms": p99_itl_ms})
    return base.model_copy(update={"output_throughput": throughput, "itl": itl, "goodput": goodput})


def test_claim_holds_at_equal_throughput_with_at_most_half_the_p99_itl() -> None:
    pd = _run("1P1D shm", 1.0, 100.0, 40.0, 1.0)
    colocated = [_run("colocated chunk=256", 1.0, 95.0, 90.0, 0.9)]
    point = claim_point(pd, colocated)
    assert point is not None
    assert point.equal_throughput and point.itl_ratio == pytest.approx(40 / 90)
    assert point.holds
    worse = claim_point(_run("1P1D shm", 1.0, 100.0, 50.0, 1.0), colocated)
    assert worse is not None and not worse.holds  # 50/90 > 0.5


def test_claim_is_checked_against_the_colocated_run_with_the_lowest_p99_itl() -> None:
    pd = _run("1P1D shm", 1.0, 100.0, 40.0, 1.0)
    colocated = [
        _run("colocated chunk=2048", 1.0, 100.0, 300.0, 0.5),
        _run("colocated chunk=256", 1.0, 98.0, 70.0, 0.9),
        _run("colocated chunk=128", 1.0, 60.0, 30.0, 0.2),  # not at equal throughput
    ]
    point = claim_point(pd, colocated)
    assert point is not None and point.colocated == "colocated chunk=256"
    assert not point.holds  # 40/70


def test_verdict_and_crossover_over_a_rate_sweep() -> None:
    runs = [
        _run("colocated chunk=512", 1.0, 100.0, 200.0, 1.0),
        _run("1P1D shm", 1.0, 101.0, 30.0, 1.0),
        _run("colocated chunk=512", 2.0, 200.0, 250.0, 1.5),
        _run("1P1D shm", 2.0, 195.0, 40.0, 1.9),
        _run("colocated chunk=512", 4.0, 390.0, 300.0, 2.0),
        _run("1P1D shm", 4.0, 250.0, 45.0, 1.0),  # saturated
    ]
    (verdict,) = verdicts(runs)
    assert verdict.pd == "1P1D shm"
    assert [p.equal_throughput for p in verdict.points] == [True, True, False]
    assert verdict.direction_matches
    assert verdict.crossover.startswith("at 4 req/s")
    assert "below" in verdict.crossover
    assert crossover(verdict.points[:2]).startswith("none up to 2 req/s")


def test_no_equal_throughput_point_means_no_claim_confirmed() -> None:
    runs = [
        _run("colocated chunk=512", 1.0, 100.0, 200.0, 1.0),
        _run("1P1D shm", 1.0, 50.0, 30.0, 0.5),
    ]
    (verdict,) = verdicts(runs)
    assert not verdict.direction_matches
    assert verdict.crossover.startswith("already at 1 req/s")


# ------------------------------------------------------------------ the report


def _report(runs: list[RunMetrics]) -> ServeReport:
    return ServeReport(
        settings=ServeSettings().model_dump(mode="json"),
        model={"layers": 8},
        cpus=2,
        started_at="2026-12-01T00:00:00+00:00",
        wall_s=60.0,
        runs=runs,
        verdicts=verdicts(runs),
    )


def test_report_round_trips_through_json_and_summarises_in_markdown(tmp_path: Path) -> None:
    runs = [
        _run("colocated chunk=512", 1.0, 100.0, 200.0, 1.0),
        _run("1P1D shm", 1.0, 101.0, 30.0, 1.0),
    ]
    report = _report(runs)
    write_json(report, tmp_path / "results.json")
    again = ServeReport.model_validate(json.loads((tmp_path / "results.json").read_text()))
    assert again == report
    md = markdown(report, ["out/itl_cdf.png"])
    assert "| 1P1D shm | 1 | 1 / 1 | 101.0 |" in md
    assert "Direction as claimed: **yes**" in md
    assert "294.9 ms" in md
    assert "![itl_cdf](itl_cdf.png)" in md
    assert "Not run." in md


def test_summary_compares_1p1d_with_every_chunk_size_and_shows_the_step_profile() -> None:
    from kvmux.bench.serve.metrics import LatencyStats
    from kvmux.bench.serve.steps import PrefillPoint, StepPoint, StepProfile

    runs = [
        _run("colocated chunk=256", 1.0, 100.0, 50.0, 1.0),
        _run("colocated chunk=2048", 1.0, 100.0, 300.0, 1.0),
        _run("1P1D shm", 1.0, 101.0, 40.0, 1.0),
    ]
    itl = LatencyStats(samples=10, mean_ms=14.0, p50_ms=13.0, p90_ms=15.0, p99_ms=20.0)
    steps = StepProfile(
        steps=[StepPoint(path="direct", batch=4, itl=itl)],
        prefills=[PrefillPoint(prompt_tokens=256, ttft_ms=47.0)],
    )
    report = _report(runs).model_copy(update={"steps": steps})
    md = markdown(report)
    assert "| 1P1D shm | colocated chunk=256 | 1 | 101.0 / 100.0 | 40 / 50 | 0.80 | no |" in md
    assert "| 1P1D shm | colocated chunk=2048 | 1 | 101.0 / 100.0 | 40 / 300 | 0.13 | yes |" in md
    assert "Direction as claimed: **no**" in md  # the strongest opponent is chunk=256
    assert "It holds at no rate req/s and not at 1 req/s of equal throughput." in md
    assert "| 4 | 13.0 / 20.0 |" in md
    assert "| TTFT ms | 47 |" in md
    assert ServeReport.model_validate(json.loads(report.model_dump_json())) == report


def test_step_profile_settings_are_validated_and_prefill_lengths_follow_the_chunks() -> None:
    settings = ServeSettings(chunk_sizes=(256, 512, 4096), mix=RequestMix(long_prompt_tokens=2048))
    assert settings.prefill_lengths() == [256, 512, 2048]
    with pytest.raises(ValueError, match="step batches"):
        ServeSettings(step_batches=(0, 4))
    with pytest.raises(ValueError, match="step batches"):
        ServeSettings(step_batches=(128,), max_num_seqs=64)
    with pytest.raises(ValueError, match="replay"):
        ServeSettings().plan_for(0, replay=10)


def test_plots_are_written_as_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvmux.bench.serve.plots import write_plots

    runs = [
        _run("colocated chunk=512", 1.0, 100.0, 200.0, 1.0),
        _run("1P1D shm", 1.0, 101.0, 30.0, 1.0),
        _run("colocated chunk=512", 2.0, 190.0, 250.0, 1.0),
        _run("1P1D shm", 2.0, 180.0, 35.0, 1.0),
    ]
    paths = write_plots(runs, tmp_path)
    assert [p.name for p in paths] == ["itl_cdf.png", "vs_rate.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert p.stat().st_size > 10_000


# ------------------------------------------------------------------ cross-check


def test_vllm_timings_rebuild_chunk_times_and_compare_figure_by_figure() -> None:
    requests = [
        PlannedRequest(0, "long-output", [5], 3, 0.5),
        PlannedRequest(1, "long-prompt", [6], 2, 1.0),
        PlannedRequest(2, "long-output", [7], 3, 1.5),
    ]
    result = {
        "start_times": [100.5, 101.0, 101.5],
        "ttfts": [0.1, 0.3, 0.0],
        "itls": [[0.05, 0.05], [0.2], []],
        "output_lens": [3, 2, 0],
        "errors": ["", "", "connection reset"],
    }
    timings = timings_from_vllm(result, requests)
    assert timings[0].sent_s == pytest.approx(0.5)
    assert timings[0].chunk_times_s == pytest.approx((0.6, 0.65, 0.7))
    assert timings[1].chunk_times_s == pytest.approx((1.3, 1.5))
    assert not timings[2].ok and timings[2].error == "connection reset"
    ours = summarize("1P1D shm", 2.0, timings, Slo())
    assert ours.ttft is not None and ours.itl is not None
    vllm_figures = {
        "output_throughput": ours.output_throughput * 1.05,
        "mean_ttft_ms": ours.ttft.mean_ms * 1.2,
        "median_itl_ms": ours.itl.p50_ms,
        "p50_ttft_ms": ours.ttft.p50_ms,
        "p99_ttft_ms": ours.ttft.p99_ms,
        "p50_itl_ms": ours.itl.p50_ms,
        "p99_itl_ms": ours.itl.p99_ms,
    }
    clients, definitions = compare(ours, vllm_figures, ours)
    assert [c.agrees for c in clients] == [True, False, True]
    assert all(d.agrees and d.relative_difference == 0 for d in definitions)
    assert not FigureCheck(figure="x", kvmux=1.0, vllm=0.0).agrees


def test_kvmux_metrics_match_vllms_own_calculation_on_the_same_outputs() -> None:
    """Definitions, checked against vLLM's benchmark code itself (no server needed)."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    outputs = []
    for i, (ttft, gaps) in enumerate([(0.1, [0.02, 0.03]), (0.4, [0.25, 0.01, 0.01])]):
        out = RequestFuncOutput()
        out.success, out.start_time, out.ttft, out.itl = True, float(i), ttft, gaps
        out.latency, out.output_tokens, out.prompt_len = ttft + sum(gaps), len(gaps) + 1, 4
        outputs.append(out)
    samples = [SampleRequest(prompt=[1, 2, 3, 4], prompt_len=4, expected_output_len=3)] * 2
    theirs, _ = calculate_metrics(samples, outputs, 1.0, None, [50.0, 99.0], {})
    requests = [PlannedRequest(i, "long-output", [1], 3, float(i)) for i in range(2)]
    result = {
        "start_times": [o.start_time for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "errors": ["", ""],
    }
    ours = summarize("x", 1.0, timings_from_vllm(result, requests), Slo())
    assert ours.ttft is not None and ours.itl is not None and ours.e2e is not None
    assert ours.ttft.p50_ms == pytest.approx(theirs.median_ttft_ms)
    assert ours.itl.p50_ms == pytest.approx(theirs.median_itl_ms)
    assert ours.itl.p99_ms == pytest.approx(dict(theirs.percentiles_itl_ms)[99.0])
    assert ours.e2e.p50_ms == pytest.approx(theirs.median_e2el_ms)


# ------------------------------------------------------------------ the load generator


@asynccontextmanager
async def fake_server(tokens_each: int, gap_s: float) -> AsyncIterator[tuple[str, list[dict]]]:
    """A streaming /v1/completions: one chunk per token ``gap_s`` apart, usage, [DONE];
    a prompt of ``[0]`` gets HTTP 500."""
    got: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        got.append(body)
        if body["prompt"] == [0]:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(tokens_each):
            await asyncio.sleep(gap_s)
            await out.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": tokens_each}}
        await out.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    async with running_app(app) as url:
        yield url, got


def test_load_generator_sends_on_schedule_and_times_every_chunk() -> None:
    requests = [
        PlannedRequest(0, "long-output", [5, 6], 4, 0.0),
        PlannedRequest(1, "long-prompt", [7, 8], 4, 0.2),
        PlannedRequest(2, "long-output", [0], 4, 0.3),
    ]

    async def go() -> tuple[list[RequestTiming], list[dict]]:
        async with fake_server(tokens_each=4, gap_s=0.05) as (url, got):
            return await run_load(url, "m", requests, timeout_s=10), got

    timings, got = asyncio.run(asyncio.wait_for(go(), 20))
    ok, late, failed = timings
    assert ok.ok and late.ok and not failed.ok
    assert late.sent_s >= 0.2 and failed.sent_s >= 0.3
    assert late.sent_s < 0.2 + 0.15  # the first request's stream did not hold it back
    assert ok.output_tokens == 4 and len(ok.chunk_times_s) == 4
    assert all(g == pytest.approx(0.05, abs=0.04) for g in ok.itls_s)
    assert failed.error is not None and failed.error.startswith("HTTP 500")
    assert {b["stream"] for b in got} == {True}
    assert {b["ignore_eos"] for b in got} == {True}
    assert got[0]["max_tokens"] == 4 and got[0]["prompt"] == [5, 6]


def test_proxy_process_relays_every_chunk_from_its_own_process_and_stops(
    tmp_path: Path,
) -> None:
    import os

    from kvmux.bench.serve.proxy_process import ProxyProcess
    from kvmux.proxy import ProxyConfig

    requests = [PlannedRequest(0, "long-output", [5, 6], 4, 0.0)]
    proxy_cpu: list[float] = []

    async def go() -> tuple[list[RequestTiming], int | None]:
        async with fake_server(tokens_each=4, gap_s=0.05) as (url, _):
            proxy = ProxyProcess(ProxyConfig(colocated=True, decode=[url]), tmp_path / "p.log")
            try:
                front = await asyncio.to_thread(proxy.start)
                assert front != url
                timings = await run_load(front, "m", requests, timeout_s=10)
                proxy_cpu.append(proxy.cpu_seconds())
                return timings, proxy.pid
            finally:
                await asyncio.to_thread(proxy.stop)

    (timing,), pid = asyncio.run(asyncio.wait_for(go(), 60))
    assert proxy_cpu[0] > 0
    assert timing.ok and timing.output_tokens == 4 and len(timing.chunk_times_s) == 4
    assert pid is not None and pid != os.getpid()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ------------------------------------------------------------------ topologies


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_colocated_is_two_chunked_instances_one_core_each(tmp_path: Path) -> None:
    from kvmux.bench.serve.topology import ServerSettings, Topology, servers_for

    settings = ServerSettings(max_model_len=1600)
    front, servers = servers_for(
        Topology(kind="colocated", chunk_tokens=256), tmp_path, tmp_path, settings
    )
    assert front == []
    assert [s.cpus for s in servers] == [(0,), (1,)]
    for s in servers:
        assert _flag(s.args, "--max-num-batched-tokens") == "256"
        assert _flag(s.args, "--kv-transfer-config") is None
        assert s.env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_pd_is_a_prefill_core_and_a_decode_core_joined_by_kvmux(tmp_path: Path) -> None:
    from kvmux.bench.serve.topology import ServerSettings, Topology, servers_for

    settings = ServerSettings(max_model_len=1600, pool_gib=1)
    (prefill,), (decode,) = servers_for(
        Topology(kind="pd", backend="tcp"), tmp_path, tmp_path, settings
    )
    assert (prefill.cpus, decode.cpus) == ((0,), (1,))
    for server, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        kv = json.loads(_flag(server.args, "--kv-transfer-config") or "{}")
        assert kv["kv_connector"] == "kvmux" and kv["kv_role"] == role
        assert kv["kv_connector_extra_config"] == {"backend": "tcp", "capacity_bytes": 2**30}
        assert _flag(server.args, "--max-num-batched-tokens") == "1600"  # never chunked


def test_a_topology_that_cannot_start_is_reported_and_the_results_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import contextmanager

    from kvmux.bench.serve import run
    from kvmux.demo.servers import ServerError

    @contextmanager
    def broken(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        raise ServerError("vLLM server 'colocated0' exited with status 1 while starting")
        yield

    monkeypatch.setattr(run, "serving", broken)
    settings = ServeSettings(rates=(1.0,), chunk_sizes=(256,), backends=(), crosscheck=False)
    report = run.run_serve(settings, tmp_path, progress=lambda _: None)
    assert report.runs == []
    assert any("colocated chunk=256 was not measured" in n for n in report.notes)
    assert (tmp_path / "results.json").is_file()
    assert "exited with status 1" in (tmp_path / "summary.md").read_text()


def test_command_line_takes_the_mix_share_and_step_batches_with_the_settings_defaults() -> None:
    from kvmux.cli.main import build_parser

    defaults = build_parser("bench").parse_args(["bench", "serve"])
    d = ServeSettings()
    assert defaults.step_batches == d.step_batches
    assert defaults.long_prompt_share == d.mix.long_prompt_share
    args = build_parser("bench").parse_args(
        ["bench", "serve", "--step-batches", "", "--long-prompt-share", "0.5"]
    )
    assert args.step_batches == () and args.long_prompt_share == 0.5
