"""``kvmux bench vllm``: what kvmux costs and saves inside real vLLM engines, side by side.

Every figure is a median over rounds measured in one run, inside each engine
process (``EngineProcess`` reports ``generate``'s wall time), on the same
prompts:

* **recompute** - a full prefill, no connector (what a cache miss costs);
* **prefix-cache floor** - the same prompts again from vLLM's own prefix cache:
  no connector load can beat moving zero bytes;
* **save/load** - a stored prefix reloaded after vLLM forgot it: kvmux ``cpu``
  and ``disk`` beside vLLM's in-tree ``ExampleConnector`` (safetensors files);
* **P/D decode** - a decode instance fed by a prefill instance: kvmux ``shm``,
  ``tcp`` and ``nixl`` beside vLLM's in-tree ``NixlConnector`` (host buffers);
* **idle overhead** - decode steps that move nothing, with and without kvmux.

Decode-side time is ``generate`` of the whole answer on the engine that loads;
TTFT is ``generate`` of one token there.
"""

from __future__ import annotations

import importlib.util
import socket
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvmux.models import TinyModelSpec, random_prompts, tiny_model
from kvmux.net.nixl_agent import skip_ucx_ib_without_devices
from kvmux.registry import resolve
from kvmux.testing.vllm_engine import EngineProcess, EngineSpec

BENCH_MODEL = TinyModelSpec(
    layers=8, hidden_size=512, num_heads=8, num_kv_heads=8, head_dim=64, dtype="bfloat16"
)
"""16 KiB of KV per token (shared/NOTES.md's reference model): transfers show in timings."""


class VllmBenchRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    scenario: str
    connector: str
    seconds: float
    """Median decode-side ``generate`` time for all prompts."""
    ttft_s: float | None = None
    """Median ``generate`` time of one token for all prompts."""
    vs_floor: float | None = None
    overhead_vs_example: float | None = None
    """(this - floor) / (ExampleConnector - floor), save/load rows only."""
    note: str = ""


class VllmBenchConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompts: int = 4
    prompt_tokens: int = 2000
    new_tokens: int = 16
    repeats: int = 3
    backends: tuple[str, ...] = ("cpu", "disk", "shm", "tcp", "nixl")


def run_bench(
    cfg: VllmBenchConfig, progress: Callable[[str], None] = print
) -> list[VllmBenchRecord]:
    model = str(tiny_model(BENCH_MODEL))
    prompts = random_prompts(cfg.prompts, cfg.prompt_tokens, seed=1)
    warm = random_prompts(1, cfg.prompt_tokens, seed=99)
    # One prefill per prompt: ExampleConnector mis-saves chunked prefills (NOTES.md).
    base = EngineSpec(
        model=model,
        dtype="bfloat16",
        max_model_len=cfg.prompt_tokens + cfg.new_tokens + 8,
        max_num_seqs=cfg.prompts,
        max_num_batched_tokens=cfg.prompts * (cfg.prompt_tokens + 8),
    )
    records: list[VllmBenchRecord] = []
    with tempfile.TemporaryDirectory(prefix="kvmux-bench-vllm-") as tmp:
        progress("plain engine: recompute, prefix-cache floor, idle steps")
        with _engine(base) as plain:
            plain.generate(warm, 1)
            recompute = _median(cfg.repeats, lambda: _cold(plain, prompts, cfg.new_tokens))
            floor = _median(cfg.repeats, lambda: _timed(plain, prompts, cfg.new_tokens))
            floor_ttft = _median(cfg.repeats, lambda: _timed(plain, prompts, 1))
            idle_plain = _idle_step_s(plain, cfg)
        records.append(VllmBenchRecord(scenario="recompute", connector="none", seconds=recompute))
        records.append(
            VllmBenchRecord(
                scenario="prefix-cache floor", connector="vllm", seconds=floor, ttft_s=floor_ttft
            )
        )
        example = _save_load(
            "ExampleConnector",
            _with(base, "ExampleConnector", {"shared_storage_path": f"{tmp}/example"}),
            prompts,
            warm,
            cfg,
        )
        records.append(example.model_copy(update={"vs_floor": example.seconds / floor}))
        for backend in cfg.backends:
            reason = resolve(backend).unavailable_reason()
            if reason is not None:
                progress(f"kvmux {backend}: skipped ({reason})")
                continue
            progress(f"kvmux {backend}")
            if backend in ("cpu", "disk"):
                extra: dict[str, Any] = {"backend": backend}
                if backend == "disk":
                    extra["path"] = f"{tmp}/disk"
                if backend == "cpu":
                    extra["capacity_bytes"] = 2 * 2**30
                rec = _save_load(
                    f"kvmux {backend}", _with(base, "kvmux", extra), prompts, warm, cfg
                )
                gap = example.seconds - floor
                ratio = (rec.seconds - floor) / gap if gap > 0 else None
                records.append(
                    rec.model_copy(
                        update={"vs_floor": rec.seconds / floor, "overhead_vs_example": ratio}
                    )
                )
            else:
                producer, consumer = _kvmux_pd(backend, base)
                rec = _pd(f"kvmux {backend}", producer, consumer, prompts, warm, cfg)
                records.append(rec.model_copy(update={"vs_floor": rec.seconds / floor}))
        if importlib.util.find_spec("nixl") is not None:
            progress("vLLM NixlConnector")
            producer, consumer = _vllm_nixl_pd(base)
            rec = _pd("vLLM NixlConnector", producer, consumer, prompts, warm, cfg)
            records.append(rec.model_copy(update={"vs_floor": rec.seconds / floor}))
        progress("kvmux idle steps")
        with _engine(_with(base, "kvmux", {"backend": "cpu"})) as idle:
            idle_kvmux = _idle_step_s(idle, cfg)
        records.append(
            VllmBenchRecord(
                scenario="idle decode step",
                connector="kvmux cpu",
                seconds=idle_kvmux,
                note=f"{(idle_kvmux - idle_plain) * 1e6:+.0f} us/step vs no connector "
                f"({idle_plain * 1e6:.0f} us/step)",
            )
        )
    return records


def _with(base: EngineSpec, connector: str, extra: dict[str, Any], role: str = "kv_both") -> Any:
    transfer = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    return base.model_copy(update={"kv_transfer_config": transfer})


@contextmanager
def _engine(spec: EngineSpec) -> Iterator[EngineProcess]:
    with EngineProcess(spec) as engine:
        yield engine


def _timed(
    engine: EngineProcess, prompts: Sequence[Sequence[int]], tokens: int, **kw: Any
) -> float:
    seconds: float = engine.call(
        "generate", prompts=[list(p) for p in prompts], max_tokens=tokens, **kw
    )["seconds"]
    return seconds


def _cold(engine: EngineProcess, prompts: Sequence[Sequence[int]], tokens: int) -> float:
    engine.call("reset_prefix_cache")
    return _timed(engine, prompts, tokens)


def _median(repeats: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeats))


def _save_load(
    label: str, spec: EngineSpec, prompts: list[list[int]], warm: list[list[int]], cfg: Any
) -> VllmBenchRecord:
    """Save once, then (forget in vLLM, reload through the connector) per round."""
    with _engine(spec) as engine:
        engine.generate(warm, 1)
        _timed(engine, prompts, cfg.new_tokens)  # saves
        seconds = _median(cfg.repeats, lambda: _cold(engine, prompts, cfg.new_tokens))
        ttft = _median(cfg.repeats, lambda: _cold(engine, prompts, 1))
    return VllmBenchRecord(scenario="save/load", connector=label, seconds=seconds, ttft_s=ttft)


def _pd(
    label: str,
    producer_spec: EngineSpec,
    consumer_spec: EngineSpec,
    prompts: list[list[int]],
    warm: list[list[int]],
    cfg: Any,
) -> VllmBenchRecord:
    """Decode-side time of a P/D pair; every round prefills afresh (a pulled request's
    blocks are gone from a NIXL producer) and makes the decode forget the prompts."""
    producer = EngineProcess(producer_spec, wait=False)
    consumer = EngineProcess(consumer_spec, wait=False)
    handoff = [{"do_remote_decode": True}] * len(prompts)
    try:
        producer.wait_ready()
        consumer.wait_ready()
        consumer.generate(warm, 1)

        def decode(tokens: int) -> float:
            params = [o["kv_transfer_params"] for o in producer.generate(prompts, 1, handoff)]
            consumer.call("reset_prefix_cache")
            return _timed(consumer, prompts, tokens, kv_transfer_params=params)

        seconds = _median(cfg.repeats, lambda: decode(cfg.new_tokens))
        ttft = _median(cfg.repeats, lambda: decode(1))
        stats = consumer.call("stats")["stats"]
    finally:
        producer.stop()
        consumer.stop()
    note = ""
    if stats:
        failed = stats.get("load_blocks_failed", 0) + stats.get("load_blocks_missing", 0)
        note = f"{stats.get('load_bytes', 0) / 2**20:.0f} MiB loaded"
        if failed:
            note += f", {failed:.0f} blocks FAILED"
    return VllmBenchRecord(
        scenario="P/D decode", connector=label, seconds=seconds, ttft_s=ttft, note=note
    )


def _kvmux_pd(backend: str, base: EngineSpec) -> tuple[EngineSpec, EngineSpec]:
    extra = {"backend": backend, "capacity_bytes": 2 * 2**30}
    return _with(base, "kvmux", extra, "kv_producer"), _with(base, "kvmux", extra, "kv_consumer")


def _vllm_nixl_pd(base: EngineSpec) -> tuple[EngineSpec, EngineSpec]:
    """vLLM's in-tree NixlConnector on host buffers (shared/NOTES.md), one side channel each."""

    skip_ucx_ib_without_devices()  # inherited by the engines (see the function)

    def side(role: str) -> EngineSpec:
        transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
            "UCX_NET_DEVICES": "lo",
        }
        return base.model_copy(update={"kv_transfer_config": transfer, "env": env})

    return side("kv_producer"), side("kv_consumer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _idle_step_s(engine: EngineProcess, cfg: Any) -> float:
    """Seconds per decode step when no block fills: short prompts, fewer tokens than a block."""
    short = random_prompts(cfg.prompts, 8, seed=5)
    steps = 100

    def one() -> float:
        engine.call("reset_prefix_cache")
        return _timed(engine, short, steps) / steps

    return _median(cfg.repeats, one)


def table(records: Sequence[VllmBenchRecord]) -> str:
    head = (
        f"{'scenario':<20} {'connector':<18} {'decode s':>9} {'TTFT s':>8} "
        f"{'x floor':>8} {'ovh/Example':>11}  note"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        ttft = f"{r.ttft_s:.3f}" if r.ttft_s is not None else "-"
        floor = f"{r.vs_floor:.2f}" if r.vs_floor is not None else "-"
        ovh = f"{r.overhead_vs_example:.2f}" if r.overhead_vs_example is not None else "-"
        lines.append(
            f"{r.scenario:<20} {r.connector:<18} {r.seconds:>9.4f} {ttft:>8} {floor:>8} "
            f"{ovh:>11}  {r.note}"
        )
    return "\n".join(lines)
