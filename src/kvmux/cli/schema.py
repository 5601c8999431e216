"""``kvmux schema [NAME]``: the JSON schema of a backend's config (all, without NAME)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvmux.errors import BackendUnavailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", nargs="?", help="backend name (buffers:NAME or pipes:NAME for a buffer or pipe)"
    )


def schema_for(name: str) -> dict[str, Any]:
    from kvmux.registry.loader import config_model_for

    return config_model_for(name).model_json_schema()


def run(args: argparse.Namespace) -> int:
    if args.name:
        print(json.dumps(schema_for(args.name), indent=2))
        return 0
    from kvmux.registry.entries import CONNECTOR_GROUPS, scan
    from kvmux.registry.loader import config_name

    out: dict[str, Any] = {}
    for group in CONNECTOR_GROUPS:
        for entry in scan(group):
            if entry.shadowed_by is not None:
                continue
            key = config_name(entry)
            try:
                out[key] = schema_for(entry.qualified_name)
            except BackendUnavailableError as exc:
                out[key] = {"unavailable": exc.reason}
    print(json.dumps(out, indent=2))
    return 0
