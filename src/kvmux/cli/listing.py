"""``kvmux list``: every declared backend, its owner, and whether it can load here.

The listing never claims more than it has seen. Without ``--check`` it reads
package metadata only (fast, imports nothing), which can prove a backend
*cannot* load (a missing extra or package) but never that it *can*: a plugin
whose import raises looks installed. So each row's ``available`` is

* ``true``: imported in this run (``--check``);
* ``false``: cannot load here; ``reason`` says why and what to install;
* ``null``: installed, nothing known against it, not imported (the table
  says ``installed (not checked)``).

With ``--check``, a backend that serves a TCP port (its config has a
``port``) gets a ``note``: open to anyone who reaches that port unless a
``secret`` is set (or, with no ``secret`` field, at all).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvmux.registry.entries import GROUPS, BackendEntry, scan_all

NOT_CHECKED = "installed (not checked)"
OPEN_PORT_FOOTER = (
    "note: backends that serve a TCP port bind 127.0.0.1 unless `host` says otherwise; "
    "without a `secret`, anyone who reaches the port can read their blocks "
    "(`kvmux list --check` marks them)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help='print a JSON array; "available" is true (imported), false (cannot load: see '
        '"reason") or null (installed, not checked); "note" marks open ports (--check)',
    )
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
        available, reason = _availability(entry, check)
        out.append(
            {
                "name": entry.name,
                "group": entry.group,
                "distribution": entry.distribution,
                "version": entry.version,
                "available": available,
                "reason": reason,
                "note": _port_note(entry) if available else None,
                "entry_point": entry.value,
                "shadowed_by": entry.shadowed_by,
            }
        )
    return out


def _availability(entry: BackendEntry, check: bool) -> tuple[bool | None, str | None]:
    """``(available, reason)`` as the module docstring defines them."""
    reason = entry.unavailable_reason()
    if reason is not None:
        return False, reason
    if not check:
        return None, None
    from kvmux.registry.loader import load_check  # imports pydantic only when asked

    reason = load_check(entry)
    return reason is None, reason


def _port_note(entry: BackendEntry) -> str | None:
    """What a backend that listens on a port exposes (it is loaded: ``--check``)."""
    from kvmux.registry.loader import config_model_of, load_class

    fields = config_model_of(load_class(entry)).model_fields
    if "port" not in fields:
        return None
    if "secret" in fields:
        return "serves a TCP port: open to anyone who reaches it unless `secret` is set"
    return "serves a TCP port with no authentication: open to anyone who reaches it"


def run(args: argparse.Namespace) -> int:
    rows = records(check=args.check, group=args.group)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(_table(rows))
    if any(r["available"] is None for r in rows):
        print(
            f"\n{NOT_CHECKED}: metadata only; `kvmux list --check` imports each to confirm it loads"
        )
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
    if row["available"] is None:
        return NOT_CHECKED
    if not row["available"]:
        return f"unavailable: {row['reason']}"
    return f"available; {row['note']}" if row["note"] else "available"
