"""``kvmux list``: every declared backend, its owner, and whether it can load here.

With ``--check`` each backend is imported, and one that serves a TCP port (its
config has a ``port``) is marked as open to anyone who reaches that port,
unless a ``secret`` is set (or, with no ``secret`` field, at all).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvmux.registry.entries import GROUPS, BackendEntry, scan_all

OPEN_PORT_FOOTER = (
    "note: backends that serve a TCP port bind 127.0.0.1 unless `host` says otherwise; "
    "without a `secret`, anyone who reaches the port can read their blocks "
    "(`kvmux list --check` marks them)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON array")
    parser.add_argument(
        "--check",
        action="store_true",
        help="import each backend to confirm it loads (slow; the default reads metadata only)",
    )
    parser.add_argument("--group", choices=GROUPS, help="only this entry-point group")


def records(check: bool = False, group: str | None = None) -> list[dict[str, Any]]:
    out = []
    for entry in scan_all():
        if group is not None and entry.group != group:
            continue
        reason = _reason(entry, check)
        out.append(
            {
                "name": entry.name,
                "group": entry.group,
                "distribution": entry.distribution,
                "version": entry.version,
                "available": reason is None,
                "reason": reason,
                "note": _port_note(entry) if check and reason is None else None,
                "entry_point": entry.value,
                "shadowed_by": entry.shadowed_by,
            }
        )
    return out


def _port_note(entry: BackendEntry) -> str | None:
    """What a backend that listens on a port exposes (it is loaded: ``--check``)."""
    from kvmux.registry.loader import config_model_of, load_class

    fields = config_model_of(load_class(entry)).model_fields
    if "port" not in fields:
        return None
    if "secret" in fields:
        return "serves a TCP port: open to anyone who reaches it unless `secret` is set"
    return "serves a TCP port with no authentication: open to anyone who reaches it"


def _reason(entry: BackendEntry, check: bool) -> str | None:
    reason = entry.unavailable_reason()
    if not check or reason is not None:
        return reason
    from kvmux.registry.loader import load_check  # imports stevedore only when asked

    return load_check(entry)


def run(args: argparse.Namespace) -> int:
    rows = records(check=args.check, group=args.group)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(_table(rows))
    print(OPEN_PORT_FOOTER)
    return 0


def _table(rows: list[dict[str, Any]]) -> str:
    header = ("GROUP", "NAME", "DISTRIBUTION", "VERSION", "STATUS")
    lines = [
        (
            r["group"],
            r["name"],
            r["distribution"],
            r["version"],
            _status(r),
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=False)][:4]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*line) for line in [header, *lines])


def _status(row: dict[str, Any]) -> str:
    if not row["available"]:
        return f"unavailable: {row['reason']}"
    return f"available; {row['note']}" if row["note"] else "available"
