"""A consumer in its own OS process: one load from a peer, checked, as one JSON line.

Run as::

    python -m kvmux.testing.pull --config JSON --source JSON --blocks N --seed S \
        [--layout small] [--again]

It builds a connector from ``--config``, registers zeroed KV memory of
``--layout``, loads the keys a :mod:`kvmux.testing.peer` of seed ``S`` saved
(``make_keys(N)``) into blocks ``0..N-1`` from ``--source`` (the peer's
``address()``), and prints ``{"statuses": {status: count}, "ok_exact": bool,
"untouched": bool, "nbytes": int, "seconds": float, "reasons": [...]}``:
whether every block reported ``ok`` holds exactly the peer's bytes, whether
every other block is still zero, and how long the load took. For consumers
that must run where the test process cannot (another network namespace:
:mod:`kvmux.testing.netns`).

With ``--again`` it then waits for a line on its stdin (the test changed
something meanwhile, e.g. lifted a link's limit) and loads the same keys once
more, into zeroed memory and on the same connector, printing a second line:
whether a connector that saw a load fail still loads from that peer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from kvmux.connector import Connector
from kvmux.registry import create_connector
from kvmux.testing.peer import (
    LAYOUTS,
    block_bytes,
    empty_caches,
    make_caches,
    make_keys,
    make_layout,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmux.testing.pull", description=__doc__)
    parser.add_argument("--config", required=True, help="connector config as JSON")
    parser.add_argument("--source", required=True, help="the peer's address() as JSON")
    parser.add_argument("--blocks", type=int, required=True, help="blocks to load")
    parser.add_argument("--seed", type=int, required=True, help="seed of the peer's KV bytes")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="small")
    parser.add_argument("--wait-s", type=float, default=120.0, help="longest wait for the load")
    parser.add_argument(
        "--again", action="store_true", help="after a line on stdin, load once more"
    )
    args = parser.parse_args(argv)

    caches = empty_caches(args.blocks, args.layout)
    connector = create_connector(json.loads(args.config))
    try:
        connector.register(make_layout(caches), caches)
        print(json.dumps(_load(connector, caches, args)), flush=True)
        if args.again:
            sys.stdin.readline()
            for cache in caches.values():
                cache.zero_()
            print(json.dumps(_load(connector, caches, args)), flush=True)
    finally:
        connector.close()
    return 0


def _load(
    connector: Connector, caches: dict[str, torch.Tensor], args: argparse.Namespace
) -> dict[str, Any]:
    """One load of the peer's keys into blocks ``0..N-1``, checked (see the module doc)."""
    blocks = list(range(args.blocks))
    started = time.monotonic()
    result = connector.load(make_keys(args.blocks), blocks, json.loads(args.source)).result(
        timeout=args.wait_s
    )
    seconds = time.monotonic() - started
    statuses = [outcome.status.value for outcome in result.outcomes]
    ok = [i for i, status in enumerate(statuses) if status == "ok"]
    others = [i for i in blocks if i not in set(ok)]
    exact = not ok or torch.equal(
        block_bytes(caches, ok), block_bytes(make_caches(args.seed, args.blocks, args.layout), ok)
    )
    reasons = sorted({o.reason for o in result.outcomes if o.reason})
    return {
        "statuses": dict(Counter(statuses)),
        "ok_exact": bool(exact),
        "untouched": not bool(block_bytes(caches, others).any()) if others else True,
        "nbytes": result.nbytes,
        "seconds": seconds,
        "reasons": reasons[:3],
    }


if __name__ == "__main__":
    sys.exit(main())
