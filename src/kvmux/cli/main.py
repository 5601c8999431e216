"""``kvmux`` entry point: dispatches to one subcommand module.

Subcommand modules are imported lazily so ``kvmux list`` never pays for
torch or a backend.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvmux.errors import KvmuxError

_COMMANDS = {
    "list": ("kvmux.cli.listing", "show installed backends and whether they can load here"),
    "schema": ("kvmux.cli.schema", "print a backend's config JSON schema"),
    "bench": ("kvmux.cli.bench", "measure save+load throughput next to memcpy / raw sockets"),
    "demo": ("kvmux.cli.demo", "prefill and decode vLLM servers handing KV over through kvmux"),
    "model": ("kvmux.cli.model", "build (or find cached) a tiny random-weight model for vLLM"),
    "proxy": ("kvmux.cli.proxy", "OpenAI-compatible prefill/decode proxy in front of vLLM"),
}


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The command line; only the ``chosen`` subcommand's module is imported (to add
    its arguments). The others appear by name and help text alone, so ``kvmux
    --help`` imports no subcommand module: ``bench``'s pulls in torch (~1.5 s).
    """
    parser = argparse.ArgumentParser(
        prog="kvmux", description="Move LLM KV cache blocks through any backend, by name."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in _COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(_chosen(argv)).parse_args(argv)
    try:
        code: int = importlib.import_module(_COMMANDS[args.command][0]).run(args)
    except KvmuxError as exc:
        print(f"kvmux: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and friends
        sys.stderr.close()
        return 0
    return code


def _chosen(argv: Sequence[str] | None) -> str | None:
    """The subcommand named on the command line, if any (kvmux itself takes no options
    with values, so it is the first word that is not an option)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return next((a for a in args if not a.startswith("-")), None)


if __name__ == "__main__":
    sys.exit(main())
