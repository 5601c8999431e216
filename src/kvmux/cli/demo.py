"""``kvmux demo``: prefill on one vLLM server, decode on another, KV moved by kvmux.

``kvmux demo`` runs :mod:`kvmux.demo.run` (needs the ``vllm`` extra);
``kvmux demo --transfer-only`` runs :mod:`kvmux.demo.transfer`, the hand-off
between two plain processes, which needs neither vLLM nor aiohttp. Only
argparse is imported here: ``kvmux --help`` builds these arguments everywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
import threading
from pathlib import Path

from kvmux.errors import KvmuxError

BACKENDS = ("shm", "tcp")
MODELS = ("tiny", "medium", "large")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transfer-only",
        action="store_true",
        help="no vLLM: hand blocks between two processes with each backend, byte-checked",
    )
    parser.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        help="kvmux backend (default shm; --transfer-only: shm and tcp, repeatable)",
    )
    parser.add_argument(
        "--model", choices=MODELS, default="medium", help="tiny model size (default medium)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        nargs="+",
        metavar="N",
        default=[300, 520, 760, 1000],
        help="one prompt of each length, in tokens (default 300 520 760 1000)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a new temp dir)")
    parser.add_argument(
        "--blocks",
        type=int,
        default=256,
        help="--transfer-only: blocks to hand off (256 KiB each)",
    )


def run(args: argparse.Namespace) -> int:
    if args.transfer_only:
        from kvmux.demo.transfer import run_transfer

        return run_transfer(args.blocks, args.backend)
    if args.backend and len(set(args.backend)) > 1:
        raise KvmuxError("the vLLM demo uses one backend: give --backend once")
    missing = [m for m in ("vllm", "aiohttp") if importlib.util.find_spec(m) is None]
    if missing:
        raise KvmuxError(
            f"kvmux demo needs {' and '.join(missing)}: pip install 'kvmux[vllm]' "
            "(or run `kvmux demo --transfer-only`, which needs neither)"
        )
    from pydantic import ValidationError

    from kvmux.demo.run import DemoSettings, run_demo

    try:
        settings = DemoSettings(
            backend=args.backend[0] if args.backend else "shm",
            model=args.model,
            prompt_tokens=tuple(args.prompt_tokens),
            max_tokens=args.max_tokens,
            log_dir=args.log_dir,
        )
    except ValidationError as exc:
        problems = "; ".join(err["msg"] for err in exc.errors())
        raise KvmuxError(f"invalid demo settings: {problems}") from None
    _stop_on_sigterm()
    try:
        return run_demo(settings)
    except KeyboardInterrupt:
        print("kvmux demo: interrupted; every server it started is stopped", file=sys.stderr)
        return 130


def _stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the demo's ``finally`` stops every server it started."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
