"""``kvmux bench``: each backend's save+load throughput beside its baseline, same run.

``kvmux bench vllm`` measures inside real vLLM engines instead (:mod:`kvmux.bench.vllm`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmux.bench.shapes import SHAPES

if TYPE_CHECKING:
    from kvmux.bench.transfer import BenchRecord


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "suite",
        nargs="?",
        choices=("transfer", "multi", "vllm"),
        default="transfer",
        help="transfer: backends beside memcpy/sockets (default); multi: compositions "
        "beside their children; vllm: inside vLLM engines",
    )
    parser.add_argument("--prompts", type=int, default=4, help="vllm: prompts per round")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="vllm: tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="vllm: tokens generated")
    parser.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="backend to measure (repeatable; default: every available connector)",
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


def run(args: argparse.Namespace) -> int:
    if args.suite == "vllm":
        return _run_vllm(args)
    if args.suite == "multi":
        return _run_multi(args)
    from tqdm import tqdm

    from kvmux.bench.transfer import bench_backend, lookup_ms

    backends = args.backend or _available_connectors()
    shapes = [SHAPES[name] for name in (args.shape or SHAPES)]
    records: list[BenchRecord] = []
    with tqdm(total=len(backends) * (len(shapes) + 1), desc="kvmux bench", file=sys.stderr) as bar:
        for backend in backends:
            bar.set_postfix_str(f"{backend} lookup")
            try:
                lookup: float | None = round(lookup_ms(backend, config=args.config), 3)
            except Exception:
                lookup = None
            bar.update()
            for shape in shapes:
                bar.set_postfix_str(f"{backend} {shape.name}")
                records += [
                    r.model_copy(update={"lookup_ms_10k": lookup})
                    for r in bench_backend(backend, shape, args.repeats, args.config)
                ]
                bar.update()
    if args.json:
        print(json.dumps([r.model_dump() for r in records], indent=2))
    else:
        print(_table(records))
    return 1 if any(r.error for r in records) else 0


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


def _available_connectors() -> list[str]:
    """Loadable connectors that work from their defaults (plus an invented scratch path);
    compositions such as ``multi`` or ``checksum`` need children and are left out."""
    import tempfile
    from pathlib import Path

    from kvmux.config import invent_paths
    from kvmux.errors import KvmuxError
    from kvmux.registry.entries import scan
    from kvmux.registry.loader import config_model_for

    names = []
    for entry in scan("connectors"):
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
        f"{'backend':<10} {'shape':<11} {'GB/s':>6} {'save':>6} {'load':>6}  "
        f"{'baseline':<8} {'GB/s':>6} {'ratio':>6} {'added':>10} {'lookup10k':>10}"
    )
    lines = [head, "-" * len(head)]
    for rec in records:
        if rec.error:
            lines.append(f"{rec.backend:<10} {rec.shape:<11} error: {rec.error}")
            continue
        lookup = f"{rec.lookup_ms_10k:.2f} ms" if rec.lookup_ms_10k is not None else "-"
        added = f"{rec.added_us:.0f} us" if rec.added_us is not None else "-"
        lines.append(
            f"{rec.backend:<10} {rec.shape:<11} {rec.gbps:>6.2f} {rec.save_gbps:>6.2f} "
            f"{rec.load_gbps:>6.2f}  {rec.baseline:<8} {rec.baseline_gbps:>6.2f} {rec.ratio:>6.2f} "
            f"{added:>10} {lookup:>10}"
        )
    configs = {json.dumps(r.config) for r in records if r.config}
    lines += [f"config over the defaults: {c}" for c in sorted(configs)]
    lines.append("GB/s = batch bytes / (save + load time); ratio = GB/s / baseline GB/s")
    lines.append("added = median save+load time minus the baseline's, per batch")
    return "\n".join(lines)
