"""``kvmux bench multi``: what composing costs, measured beside the child alone.

In the same rounds, on the same blocks:

* ``cpu`` alone vs ``multi[fallback: cpu]`` - the multi's own overhead, save+load;
* fallback with a first child that lost half the blocks (reports them missing)
  vs each child loading, alone, the half it holds;
* fallback with a first child that hangs until its ``timeout_s`` vs that
  timeout plus the second child loading everything - the target's bound (once
  the breaker has opened, the hung child is skipped and rounds cost less).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvmux.bench.shapes import Shape
from kvmux.connector import Connector
from kvmux.keys import BlockKey, chain_keys
from kvmux.multi.backend import MultiBackend
from kvmux.registry import create_connector
from kvmux.testing.faults import Die, DropKeys

HANG_TIMEOUT_S = 0.2


class MultiBenchRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    shape: str
    scenario: str
    seconds: float
    reference: str
    reference_seconds: float
    ratio: float


def bench_multi(shape: Shape, repeats: int = 5) -> list[MultiBenchRecord]:
    caches = shape.caches(2 * shape.blocks)
    layout = shape.layout(caches)
    capacity = 4 * shape.nbytes

    def cpu(**extra: Any) -> Connector:
        c = create_connector({"backend": "cpu", "capacity_bytes": capacity, **extra})
        return c

    alone = cpu()
    one_child = Connector(MultiBackend.of("fallback", [cpu().backend]))
    lossy_first, second = cpu(), cpu()
    dropper = DropKeys(lossy_first.backend, rate=0.5)
    half_lost = Connector(MultiBackend.of("fallback", [dropper, second.backend]))
    hung_first, backup = cpu(timeout_s=HANG_TIMEOUT_S), cpu()
    hung = Die(hung_first.backend, mode="hang", deadline_s=HANG_TIMEOUT_S)
    hanging = Connector(MultiBackend.of("fallback", [hung, backup.backend]))
    connectors = [alone, one_child, half_lost, hanging]
    for c in connectors:
        c.register(layout, caches)
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    src = list(range(shape.blocks))
    dst = list(range(shape.blocks, 2 * shape.blocks))
    try:
        for rep in range(repeats + 1):
            keys = chain_keys(range(shape.blocks * shape.tokens), shape.tokens, f"multi{rep}")
            timed("cpu", partial(_round_trip, alone, keys, src, dst))
            timed("multi[fallback: cpu]", partial(_round_trip, one_child, keys, src, dst))
            _ok(half_lost.save(keys, src).result())
            kept = [i for i, k in enumerate(keys) if k not in dropper.choice]
            lost = [i for i, k in enumerate(keys) if k in dropper.choice]
            timed("half lost", partial(_load, half_lost, keys, dst))
            halves = partial(_halves, lossy_first, second, keys, dst, kept, lost)
            timed("each half from its child", halves)
            _ok(hanging.save(keys, src).result())
            timed("first child hangs", partial(_load, hanging, keys, dst))
            timed("backup child alone", partial(_load, backup, keys, dst))
            if rep == 0:  # warm-up round
                times.clear()
    finally:
        for c in connectors:
            c.close()
    med = {k: statistics.median(v) for k, v in times.items()}

    def rec(scenario: str, reference: str, ref_s: float) -> MultiBenchRecord:
        return MultiBenchRecord(
            shape=shape.name,
            scenario=scenario,
            seconds=round(med[scenario], 5),
            reference=reference,
            reference_seconds=round(ref_s, 5),
            ratio=round(med[scenario] / ref_s, 3),
        )

    return [
        rec("multi[fallback: cpu]", "cpu", med["cpu"]),
        rec("half lost", "each half from its child", med["each half from its child"]),
        rec(
            "first child hangs",
            f"timeout {HANG_TIMEOUT_S}s + backup child alone",
            HANG_TIMEOUT_S + med["backup child alone"],
        ),
    ]


def _load(conn: Connector, keys: list[BlockKey], dst: list[int]) -> None:
    _ok(conn.load(keys, dst).result())


def _halves(
    first: Connector,
    second: Connector,
    keys: list[BlockKey],
    dst: list[int],
    kept: list[int],
    lost: list[int],
) -> None:
    """The floor of a half-lost load: each child moving only the half it holds."""
    _ok(first.load([keys[i] for i in kept], [dst[i] for i in kept]).result())
    _ok(second.load([keys[i] for i in lost], [dst[i] for i in lost]).result())


def _round_trip(conn: Connector, keys: list[BlockKey], src: list[int], dst: list[int]) -> None:
    _ok(conn.save(keys, src).result())
    _ok(conn.load(keys, dst).result())


def _ok(result: Any) -> None:
    if not result.ok:
        key, outcome = result.not_ok[0]
        raise RuntimeError(f"{key!r}: {outcome.status} {outcome.reason}")


def table(records: list[MultiBenchRecord]) -> str:
    head = f"{'shape':<11} {'scenario':<22} {'s':>8}  {'reference':<38} {'s':>8} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{r.shape:<11} {r.scenario:<22} {r.seconds:>8.4f}  {r.reference:<38} "
            f"{r.reference_seconds:>8.4f} {r.ratio:>6.2f}"
        )
    return "\n".join(lines)
