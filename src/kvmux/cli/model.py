"""``kvmux model``: build (or find cached) a tiny random-weight model; print its path.

Only the path goes to stdout, so shell scripts can write
``vllm serve "$(kvmux model)"``; anything the build libraries print goes to
stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from pydantic import ValidationError

from kvmux.errors import ConfigError
from kvmux.problems import problems_of

#: CLI option -> TinyModelSpec field. Options default to None so that the
#: spec's own defaults stay the single source of truth.
_INT_OPTIONS = {
    "--layers": ("layers", "decoder layers"),
    "--hidden": ("hidden_size", "hidden size"),
    "--intermediate": ("intermediate_size", "MLP width (default: 2 x hidden)"),
    "--heads": ("num_heads", "attention heads"),
    "--kv-heads": ("num_kv_heads", "key/value heads"),
    "--head-dim": ("head_dim", "size of one head (default: hidden / heads)"),
    "--vocab": ("vocab_size", "vocabulary size"),
    "--max-positions": ("max_position_embeddings", "longest sequence"),
    "--seed": ("seed", "seed for the random weights"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for option, (field, help_text) in _INT_OPTIONS.items():
        parser.add_argument(option, dest=field, type=int, metavar="N", help=help_text)
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype (float32)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="where models are cached (default: $KVMUX_CACHE_DIR/models or ~/.cache/kvmux/models)",
    )


def run(args: argparse.Namespace) -> int:
    from kvmux.models import TinyModelSpec, tiny_model

    fields = [field for field, _ in _INT_OPTIONS.values()] + ["dtype"]
    given = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    try:
        spec = TinyModelSpec(**given)
    except ValidationError as exc:
        raise ConfigError(None, problems_of(exc)) from None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            path = tiny_model(spec, args.cache_dir)
    except ImportError as exc:
        print(f"kvmux: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
