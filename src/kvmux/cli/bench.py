"""``kvmux bench``: each backend's save+load throughput beside its baseline, same run.

``kvmux bench vllm`` measures inside real vLLM engines instead (:mod:`kvmux.bench.vllm`);
``kvmux bench serve`` compares colocated serving with 1P1D under load
(:mod:`kvmux.bench.serve`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmux.bench.shapes import SHAPES
from kvmux.errors import KvmuxError

if TYPE_CHECKING:
    from kvmux.bench.transfer import BenchRecord


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "suite",
        nargs="?",
        choices=("transfer", "multi", "vllm", "serve"),
        default="transfer",
        help="transfer: backends beside memcpy/sockets (default); multi: compositions "
        "beside their children; vllm: inside vLLM engines; serve: colocated vs 1P1D "
        "vLLM serving under Poisson load (TTFT, ITL, goodput; ~20 min with the defaults)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="vllm: prompts per round")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="vllm: tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="vllm: tokens generated")
    parser.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="backend to measure (repeatable; default: every available connector; "
        "serve: the 1P1D backend, shm or tcp, default shm)",
    )
    parser.add_argument(
        "--shape",
        action="append",
        choices=sorted(SHAPES),
        help="block shape (repeatable; default: all)",
    )
    parser.add_argument(
        "--config",
        type=_config_object,
        default={},
        metavar="JSON",
        help="transfer: config fields over each backend's defaults, e.g. '{\"checksum\": false}'",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per figure (median)")
    parser.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    _add_serve_arguments(parser)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",")) if text else ()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve``'s own flags, defaults from :class:`~kvmux.bench.serve.settings.ServeSettings`;
    its 1P1D backends come from ``--backend`` (default shm)."""
    from kvmux.bench.serve.settings import ServeSettings

    d = ServeSettings()
    serve = parser.add_argument_group("serve")
    serve.add_argument(
        "--rates",
        type=_floats,
        default=d.rates,
        help=f"serve: offered loads, req/s (default {_listed(d.rates)})",
    )
    serve.add_argument(
        "--chunk-sizes",
        type=_ints,
        default=d.chunk_sizes,
        help="serve: colocated prefill chunks, --max-num-batched-tokens "
        f"(default {_listed(d.chunk_sizes)}; empty: no colocated runs)",
    )
    serve.add_argument(
        "--step-batches",
        type=_ints,
        default=d.step_batches,
        help="serve: batch sizes of the step profile, decode step time vs batch on one core "
        f"(default {_listed(d.step_batches)}; empty: no profile)",
    )
    mix, slo = d.mix, d.slo
    numbers: list[tuple[str, type[float] | type[int], float, str]] = [
        ("--duration-s", float, d.duration_s, "seconds of Poisson arrivals per rate"),
        ("--long-prompt-tokens", int, mix.long_prompt_tokens, "prompt of the long-prompt requests"),
        ("--long-output-tokens", int, mix.long_output_tokens, "output of the long-output requests"),
        ("--long-prompt-share", float, mix.long_prompt_share, "fraction of long-prompt requests"),
        ("--slo-ttft-ms", float, slo.ttft_ms, "goodput's bound on TTFT"),
        ("--slo-itl-ms", float, slo.itl_ms, "goodput's bound on every token gap"),
    ]
    for flag, kind, default, what in numbers:
        serve.add_argument(
            flag, type=kind, default=default, help=f"serve: {what} (default {default:g})"
        )
    serve.add_argument("--seed", type=int, default=d.seed, help="serve: arrivals and prompts")
    serve.add_argument(
        "--no-crosscheck",
        action="store_true",
        help="serve: skip replaying one point with vLLM's serving benchmark",
    )
    serve.add_argument(
        "--out", default="bench-serve", help="serve: output directory (default bench-serve/)"
    )


def _listed(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


def _progress_bar() -> Any:
    """tqdm's bar class; it is the bench extra's, not a core requirement."""
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise KvmuxError(f"kvmux bench needs tqdm: pip install 'kvmux[bench]' ({exc})") from exc
    return tqdm


def run(args: argparse.Namespace) -> int:
    if args.suite == "serve":
        return _run_serve(args)
    if args.suite == "vllm":
        return _run_vllm(args)
    if args.suite == "multi":
        return _run_multi(args)
    tqdm = _progress_bar()
    from kvmux.bench.transfer import bench_backend, lookup_ms

    runs = _runs(args.backend or _available_connectors(), args.config)
    shapes = [SHAPES[name] for name in (args.shape or SHAPES)]
    records: list[BenchRecord] = []
    with tqdm(total=len(runs) * (len(shapes) + 1), desc="kvmux bench", file=sys.stderr) as bar:
        for backend, config in runs:
            label = _label(backend, config)
            bar.set_postfix_str(f"{label} lookup")
            try:
                lookup: float | None = round(lookup_ms(backend, config=config), 3)
            except Exception:
                lookup = None
            bar.update()
            for shape in shapes:
                bar.set_postfix_str(f"{label} {shape.name}")
                records += [
                    r.model_copy(update={"lookup_ms_10k": lookup})
                    for r in bench_backend(backend, shape, args.repeats, config)
                ]
                bar.update()
    if args.json:
        print(json.dumps([r.model_dump() for r in records], indent=2))
    else:
        print(_table(records))
    return 1 if any(r.error for r in records) else 0


BORROW = {"save_mode": "borrow"}


def _runs(backends: Sequence[str], config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each backend with ``config``; with none given, a backend that can borrow the
    engine's blocks (``save_mode: borrow``) is measured both ways, side by side."""
    if config:
        return [(backend, config) for backend in backends]
    return [run for backend in backends for run in [(backend, {}), *_borrowing(backend)]]


def _borrowing(backend: str) -> list[tuple[str, dict[str, Any]]]:
    from kvmux.registry.loader import config_model_for

    try:
        config_model_for(backend).model_validate({"backend": backend, **BORROW})
    except (KvmuxError, ValueError):
        return []
    return [(backend, dict(BORROW))]


def _label(backend: str, config: dict[str, Any] | None) -> str:
    """The row's name: the backend, marked where it borrows blocks."""
    return f"{backend} borrow" if (config or {}).get("save_mode") == "borrow" else backend


def _run_multi(args: argparse.Namespace) -> int:
    from kvmux.bench.multi import bench_multi, table

    records = [
        r for name in (args.shape or SHAPES) for r in bench_multi(SHAPES[name], args.repeats)
    ]
    if args.json:
        print(json.dumps([r.model_dump() for r in records], indent=2))
    else:
        print(table(records))
    return 0


def _run_vllm(args: argparse.Namespace) -> int:
    from kvmux.bench.vllm import VllmBenchConfig, run_bench, table

    cfg = VllmBenchConfig(
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        repeats=args.repeats if args.repeats != 5 else 3,
        backends=tuple(args.backend) if args.backend else VllmBenchConfig().backends,
    )
    records = run_bench(cfg, progress=lambda msg: print(f"... {msg}", file=sys.stderr))
    if args.json:
        print(json.dumps([r.model_dump() for r in records], indent=2))
    else:
        print(table(records))
    return 0


def _config_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _run_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pydantic import ValidationError

    from kvmux.bench.serve.metrics import Slo
    from kvmux.bench.serve.run import run_serve
    from kvmux.bench.serve.settings import ServeSettings
    from kvmux.bench.serve.workload import RequestMix

    try:
        settings = ServeSettings(
            rates=args.rates,
            chunk_sizes=args.chunk_sizes,
            backends=tuple(args.backend) if args.backend else ("shm",),
            duration_s=args.duration_s,
            seed=args.seed,
            mix=RequestMix(
                long_prompt_tokens=args.long_prompt_tokens,
                long_output_tokens=args.long_output_tokens,
                long_prompt_share=args.long_prompt_share,
            ),
            step_batches=args.step_batches,
            slo=Slo(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms),
            crosscheck=not args.no_crosscheck,
        )
    except ValidationError as exc:
        raise KvmuxError(f"invalid kvmux bench serve settings: {exc}") from None
    out = Path(args.out)
    report = run_serve(settings, out, progress=lambda msg: print(f"... {msg}", file=sys.stderr))
    print((out / "summary.md").read_text())
    print(f"results: {out / 'results.json'}, summary: {out / 'summary.md'}")
    return 0 if report.runs else 1


def _available_connectors() -> list[str]:
    """Loadable connectors that work from their defaults (plus an invented scratch path);
    compositions such as ``multi`` or ``checksum`` need children and are left out."""
    import tempfile
    from pathlib import Path

    from kvmux.config import invent_paths
    from kvmux.registry.entries import scan
    from kvmux.registry.loader import config_model_for

    names = []
    for entry in scan("backends"):
        if entry.unavailable_reason() is not None:
            continue
        try:
            model = config_model_for(entry.name)
            config = {"backend": entry.name}
            model.model_validate(
                {**invent_paths(model, config, Path(tempfile.gettempdir())), **config}
            )
        except (KvmuxError, ValueError):
            continue
        names.append(entry.name)
    return names


def _table(records: Sequence[BenchRecord]) -> str:
    head = (
        f"{'backend':<15} {'shape':<11} {'GB/s':>6} {'save':>6} {'load':>6}  "
        f"{'baseline':<8} {'GB/s':>6} {'ratio':>6} {'added':>10} {'lookup10k':>10}"
    )
    lines = [head, "-" * len(head)]
    for rec in records:
        name = _label(rec.backend, rec.config)
        if rec.error:
            lines.append(f"{name:<15} {rec.shape:<11} error: {rec.error}")
            continue
        lookup = f"{rec.lookup_ms_10k:.2f} ms" if rec.lookup_ms_10k is not None else "-"
        added = f"{rec.added_us:.0f} us" if rec.added_us is not None else "-"
        lines.append(
            f"{name:<15} {rec.shape:<11} {rec.gbps:>6.2f} {rec.save_gbps:>6.2f} "
            f"{rec.load_gbps:>6.2f}  {rec.baseline:<8} {rec.baseline_gbps:>6.2f} {rec.ratio:>6.2f} "
            f"{added:>10} {lookup:>10}"
        )
    configs = {json.dumps(r.config) for r in records if r.config}
    lines += [f"config over the defaults: {c}" for c in sorted(configs)]
    lines.append("GB/s = batch bytes / (save + load time); ratio = GB/s / baseline GB/s")
    lines.append("added = median save+load time minus the baseline's, per batch")
    for rec in records:  # how much of the gap to memcpy is the blocks' scatter
        # (not for one block: its figure is the time added, and a 256 KiB copy's
        # time is mostly a thread's wake-up)
        many = rec.blocks > 1 and rec.baseline == "memcpy"
        if many and rec.copy_gbps and rec.gbps is not None:
            name = _label(rec.backend, rec.config)
            lines.append(
                f"{name} {rec.shape}: the same scattered blocks through kvmux's copy "
                f"kernel alone {rec.copy_gbps:.2f} GB/s ({rec.copy_gbps / rec.baseline_gbps:.2f}x "
                f"memcpy); {name} {rec.gbps / rec.copy_gbps:.2f}x the kernel"
            )
    other = [r for r in records if r.load_us_other_process is not None and r.baseline == "memcpy"]
    for rec in other:
        lines.append(
            f"{_label(rec.backend, rec.config)}: a one-block load from a producer in "
            "another process takes "
            f"{rec.load_us_other_process:.0f} us (median), "
            f"{rec.load_cpu_us_other_process:.0f} us of CPU in the two processes; "
            f"a loopback round trip between two processes, {rec.round_trip_us:.0f} us"
        )
    for rec in records:  # the transport alone, without the save's copy into the pool
        if rec.baseline_load_gbps and rec.load_gbps is not None:
            lines.append(
                f"{_label(rec.backend, rec.config)} {rec.shape}: its load alone "
                f"{rec.load_gbps:.2f} GB/s, raw "
                f"{rec.baseline}'s read alone {rec.baseline_load_gbps:.2f} GB/s "
                f"({rec.load_gbps / rec.baseline_load_gbps:.2f}x)"
            )
    return "\n".join(lines)
