"""``kvmux schema [NAME]``: the JSON schema of a backend's config (all, without NAME)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvmux.errors import BackendUnavailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="backend name (group:name to qualify)")


def schema_for(name: str) -> dict[str, Any]:
    from kvmux.registry.loader import config_model_for

    return config_model_for(name).model_json_schema()


def run(args: argparse.Namespace) -> int:
    if args.name:
        print(json.dumps(schema_for(args.name), indent=2))
        return 0
    from kvmux.registry.entries import scan

    out: dict[str, Any] = {}
    for group in ("connectors", "buffers", "pipes"):
        for entry in scan(group):
            if entry.shadowed_by is not None:
                continue
            key = entry.name if group == "connectors" else entry.qualified_name
            try:
                out[key] = schema_for(entry.qualified_name)
            except BackendUnavailableError as exc:
                out[key] = {"unavailable": exc.reason}
    print(json.dumps(out, indent=2))
    return 0
