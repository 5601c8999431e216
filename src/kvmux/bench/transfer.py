"""Save+load throughput of one backend, next to its baseline, in one run."""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from kvmux.bench.baselines import (
    memcpy_seconds,
    process_cpu_seconds,
    round_trip_seconds,
    socket_seconds,
)
from kvmux.bench.shapes import Shape
from kvmux.blocks import BlockCopier
from kvmux.config import invent_paths
from kvmux.connector import Connector
from kvmux.handle import Handle
from kvmux.keys import BlockKey, chain_keys
from kvmux.registry.loader import config_model_for


class BenchRecord(BaseModel):
    """One line of ``kvmux bench --json``."""

    backend: str
    shape: str
    blocks: int
    block_nbytes: int
    gbps: float | None
    save_gbps: float | None = None
    load_gbps: float | None = None
    baseline: str
    baseline_gbps: float
    ratio: float | None
    baseline_load_gbps: float | None = None
    """The baseline's load part alone, where it has one (raw NIXL or Mooncake: its READ)."""
    copy_gbps: float | None = None
    """The same blocks moved by kvmux's copy kernel alone, in the same rounds: out of
    the engine's scattered blocks into packed rows, then back into other scattered
    blocks (:class:`~kvmux.blocks.BlockCopier`, with no keys, slots, lanes or
    handles). memcpy copies one contiguous buffer; this is what the blocks' scatter
    leaves of it, so ``gbps / copy_gbps`` is kvmux's own share of the gap."""
    lookup_ms_10k: float | None = None
    """One lookup of 10,000 present keys (measured once per backend)."""
    added_us: float | None = None
    """Median save+load time minus the baseline's, in microseconds: what kvmux adds
    per batch (the figure that matters for the one-block shape)."""
    load_us_other_process: float | None = None
    """One-block shape, P2P backends: median microseconds of a one-block load from a
    producer in another process (:func:`load_from_another_process`)."""
    load_cpu_us_other_process: float | None = None
    """The same loads' CPU time, consumer's and producer's processes together, in
    microseconds per load: kvmux's own work, which a machine slow to wake a
    sleeping process hides in the wall-clock figure."""
    round_trip_us: float | None = None
    """The floor under the wall-clock figure: median microseconds of a 64-byte
    ping-pong over loopback TCP between two processes, measured right after."""
    config: dict[str, Any] | None = None
    """Config fields given beyond the backend's defaults (``kvmux bench --config``)."""
    error: str | None = None


BASELINES: dict[str, Callable[[int], float]] = {
    "memcpy": memcpy_seconds,
    "socket": socket_seconds,
}
SOCKET_BACKENDS = {"tcp", "pipes:tcp"}
"""Backends whose bytes cross a socket: measured next to a raw loopback socket as
well as next to memcpy."""


NIXL_BACKENDS = {"nixl"}
"""Backends measured next to raw NIXL (:mod:`kvmux.bench.nixl_baseline`) as well."""
MOONCAKE_BACKENDS = {"mooncake"}
"""Backends measured next to raw Mooncake TE (:mod:`kvmux.bench.mooncake_baseline`) as well."""
RAW_BASELINES = ("nixl", "mooncake")
"""Baselines with a load part of their own (reported as ``baseline_load_gbps``)."""


def baselines_for(name: str) -> list[str]:
    extra = ["socket"] if name in SOCKET_BACKENDS else ["nixl"] if name in NIXL_BACKENDS else []
    if name in MOONCAKE_BACKENDS:
        extra = ["mooncake"]
    return ["memcpy", *extra]


def bench_backend(
    name: str, shape: Shape, repeats: int = 5, config: Mapping[str, Any] | None = None
) -> list[BenchRecord]:
    """Median save+load time of ``shape``'s blocks through ``name`` (its defaults, with
    ``config``'s fields over them), one record per baseline. Each baseline runs on
    the same byte count in every round, right before the backend, so all of them
    see the same machine."""
    baselines = baselines_for(name)
    base_times: dict[str, list[float]] = {b: [] for b in baselines}
    load_times: list[float] = []
    copy_times: list[float] = []

    with ExitStack() as stack:
        measures: dict[str, Callable[[], float]] = {
            b: functools.partial(BASELINES[b], shape.nbytes) for b in baselines if b in BASELINES
        }
        for b in RAW_BASELINES:
            if b in baselines:
                measures[b] = _raw_measure(stack.enter_context(_raw_reader(b, shape)), load_times)

        kernel = _CopyKernel(shape)

        def measure_baselines(src: list[int], dst: list[int]) -> None:
            for b in baselines:
                base_times[b].append(measures[b]())
            copy_times.append(kernel.seconds(src, dst))

        return _bench_records(
            name,
            shape,
            repeats,
            dict(config or {}),
            baselines,
            base_times,
            load_times,
            copy_times,
            measure_baselines,
        )


class _CopyKernel:
    """kvmux's copy kernel alone on caches of its own, shaped as the backend's: the
    backend's blocks are left to the backend, so its bytes are checked unhelped."""

    def __init__(self, shape: Shape) -> None:
        caches = shape.caches(2 * shape.blocks, seed=2)
        self._copier = BlockCopier(shape.layout(caches), caches)
        self._rows = torch.zeros((shape.blocks, shape.block_nbytes), dtype=torch.uint8)

    def seconds(self, src: list[int], dst: list[int]) -> float:
        """Blocks ``src`` out to the rows, then the rows into blocks ``dst``."""
        start = time.perf_counter()
        self._copier.copy_out(src, self._rows)
        self._copier.copy_in(dst, self._rows)
        return time.perf_counter() - start


def _raw_reader(baseline: str, shape: Shape) -> Any:
    """The raw library's own transfer of ``shape`` (imported only when measured)."""
    if baseline == "nixl":
        from kvmux.bench.nixl_baseline import RawNixlRead

        return RawNixlRead(shape)
    from kvmux.bench.mooncake_baseline import RawMooncakeRead

    return RawMooncakeRead(shape)


def _raw_measure(raw: Any, load_times: list[float]) -> Callable[[], float]:
    """One raw save+load in seconds, keeping its load part for ``baseline_load_gbps``."""

    def measure() -> float:
        save_s, load_s = raw.save_load_seconds()
        load_times.append(load_s)
        return float(save_s + load_s)

    return measure


def _bench_records(
    name: str,
    shape: Shape,
    repeats: int,
    config: dict[str, Any],
    baselines: list[str],
    base_times: dict[str, list[float]],
    load_times: list[float],
    copy_times: list[float],
    measure_baselines: Callable[[list[int], list[int]], None],
) -> list[BenchRecord]:
    common: dict[str, Any] = dict(
        backend=name,
        shape=shape.name,
        blocks=shape.blocks,
        block_nbytes=shape.block_nbytes,
        config=config or None,
    )
    try:
        save_s, load_s, p2p = _save_load_seconds(name, shape, repeats, config, measure_baselines)
        other_process = None
        if p2p and shape.blocks == 1:
            other_process = load_from_another_process(name, shape, config)
    except Exception as exc:  # a broken backend is a row, not a crash
        if not base_times[baselines[0]]:
            measure_baselines(list(range(shape.blocks)), list(range(shape.blocks)))
        return [
            BenchRecord(
                **common,
                baseline=b,
                baseline_gbps=round(shape.nbytes / statistics.median(base_times[b]) / 1e9, 3),
                gbps=None,
                ratio=None,
                error=f"{type(exc).__name__}: {exc}",
            )
            for b in baselines
        ]
    gbps = shape.nbytes / (save_s + load_s) / 1e9
    copy_gbps = round(shape.nbytes / statistics.median(copy_times) / 1e9, 3)
    records = []
    for b in baselines:
        base_gbps = shape.nbytes / statistics.median(base_times[b]) / 1e9
        base_load = None
        if b in RAW_BASELINES and load_times:
            base_load = round(shape.nbytes / statistics.median(load_times) / 1e9, 3)
        records.append(
            BenchRecord(
                **common,
                baseline=b,
                baseline_gbps=round(base_gbps, 3),
                baseline_load_gbps=base_load,
                copy_gbps=copy_gbps,
                gbps=round(gbps, 3),
                save_gbps=round(shape.nbytes / save_s / 1e9, 3),
                load_gbps=round(shape.nbytes / load_s / 1e9, 3),
                ratio=round(gbps / base_gbps, 3),
                added_us=round((save_s + load_s - statistics.median(base_times[b])) * 1e6, 1),
                **(other_process.fields() if other_process is not None else {}),
            )
        )
    return records


ONE_BLOCK_WARMUP, ONE_BLOCK_ROUNDS = 30, 200
"""Rounds of the one-block shape, untimed then timed. Its figure is a ~100 µs time
added per batch, which the first few dozen rounds of a new pair overstate several
times over (threads and links still being made): with the five rounds of the
other shapes the same build read cpu 95-135 µs, shm 669-831; with these, 39 and
325."""


def _save_load_seconds(
    name: str,
    shape: Shape,
    repeats: int,
    config: Mapping[str, Any],
    baseline: Callable[[list[int], list[int]], None],
) -> tuple[float, float, bool]:
    """Median save and load seconds, and whether the backend is P2P (the load went
    from a producer to a consumer). ``baseline(src, dst)`` runs before each timed
    round, told the round's blocks. A one-block batch gets at least
    :data:`ONE_BLOCK_ROUNDS` rounds after :data:`ONE_BLOCK_WARMUP`."""
    warmup, rounds = 1, repeats
    if shape.blocks == 1:
        warmup, rounds = ONE_BLOCK_WARMUP, max(repeats, ONE_BLOCK_ROUNDS)
    with ExitStack() as stack:
        producer, consumer, source = stack.enter_context(_pair(name, shape, config))
        gen = torch.Generator().manual_seed(1)
        saves, loads = [], []
        for rep in range(warmup + rounds):
            timed = rep >= warmup
            src = torch.randperm(shape.blocks, generator=gen).tolist()
            dst = torch.randperm(shape.blocks, generator=gen).add(shape.blocks).tolist()
            keys = chain_keys(range(shape.blocks * shape.tokens), shape.tokens, f"bench{rep}")
            if timed:
                baseline(src, dst)
            t0 = time.perf_counter()
            save = producer.save(keys, src)
            saved = save.saved()
            t1 = time.perf_counter()
            loaded = consumer.load(keys, dst, source).result()
            t2 = time.perf_counter()
            if not (saved.ok and loaded.ok):
                bad = (saved.not_ok + loaded.not_ok)[0]
                raise RuntimeError(f"transfer incomplete: {bad[1].status} {bad[1].reason}")
            if producer.capabilities.borrows_blocks and rep < warmup + rounds - 1:
                _give_back(producer, keys, save)
            if timed:
                saves.append(t1 - t0)
                loads.append(t2 - t1)
        _check_last_batch(producer, consumer, src, dst)
        return statistics.median(saves), statistics.median(loads), source is not None


def _give_back(producer: Connector, keys: list[BlockKey], save: Handle) -> None:
    """Untimed, as the engine does it outside the consumer's wait: release the lent
    blocks and wait until they are back (the next round lends them again)."""
    producer.release(keys)
    if not save.wait(producer.config.timeout_s):
        raise RuntimeError("lent blocks did not come back within timeout_s")


def _check_last_batch(
    producer: Connector, consumer: Connector, src: list[int], dst: list[int]
) -> None:
    """A benchmark of wrong bytes is worthless: compare a few blocks."""
    for i in (0, len(src) // 2, len(src) - 1):
        if not torch.equal(producer.copier.gather([src[i]]), consumer.copier.gather([dst[i]])):
            raise RuntimeError(f"block {src[i]} arrived corrupted")


ONE_BLOCK_LOADS = 300
"""Timed one-block loads from a producer in another process (after 30 to warm up)."""


@dataclass(frozen=True)
class OtherProcessLoad:
    """One-block loads from a producer in another process, and the floor under them."""

    wall_us: float
    cpu_us: float
    round_trip_us: float

    def fields(self) -> dict[str, float]:
        return {
            "load_us_other_process": round(self.wall_us, 1),
            "load_cpu_us_other_process": round(self.cpu_us, 1),
            "round_trip_us": round(self.round_trip_us, 1),
        }


def load_from_another_process(
    name: str, shape: Shape, given: Mapping[str, Any], loads: int = ONE_BLOCK_LOADS
) -> OtherProcessLoad:
    """Median microseconds of a one-block load of ``shape``'s block (eight 32 KiB
    layers) from a producer in another process (:mod:`kvmux.testing.peer`), over a
    warm connection, the bytes checked; the CPU both processes spent per load; and a
    loopback round trip between two processes (:func:`round_trip_seconds`).

    What a decode instance waits per one-block batch in P/D, where producer and
    consumer never share a process. The main figures run both in this process, where
    each message is also a hand-over of the GIL between two threads (a loopback
    round trip between threads costs several times one between processes)."""
    from kvmux.registry.factory import create_connector
    from kvmux.testing.peer import block_bytes, empty_caches, make_caches, make_layout, spawn_peer

    layout, seed, blocks = "eight_layers", 7, 2
    with tempfile.TemporaryDirectory(prefix="kvmux-bench-") as tmp:
        config = _config_for(name, shape, Path(tmp), given)
        with spawn_peer(config, blocks, seed, layout) as peer:
            caches = empty_caches(blocks, layout)
            consumer = create_connector(config)
            try:
                consumer.register(make_layout(caches), caches)
                times, cpu_start = [], 0.0
                for i in range(30 + loads):
                    if i == 30:
                        cpu_start = time.process_time() + process_cpu_seconds(peer.pid)
                    key = i % blocks
                    start = time.perf_counter()
                    result = consumer.load(peer.keys[key : key + 1], [key], peer.address).result()
                    times.append(time.perf_counter() - start)
                    if not result.ok:
                        raise RuntimeError(f"one-block load failed: {result.outcomes[0].reason}")
                cpu = time.process_time() + process_cpu_seconds(peer.pid) - cpu_start
            finally:
                consumer.close()
    if not torch.equal(
        block_bytes(caches, range(blocks)),
        block_bytes(make_caches(seed, blocks, layout), range(blocks)),
    ):
        raise RuntimeError("a block from the other process arrived corrupted")
    return OtherProcessLoad(
        wall_us=statistics.median(times[30:]) * 1e6,
        cpu_us=cpu / loads * 1e6,
        round_trip_us=round_trip_seconds() * 1e6,
    )


@contextmanager
def _pair(
    name: str, shape: Shape, given: Mapping[str, Any]
) -> Iterator[tuple[Connector, Connector, dict[str, Any] | None]]:
    """Producer and consumer (one instance unless the backend is P2P), registered
    with room for the batch twice over."""
    from kvmux.registry.factory import create_connector

    with tempfile.TemporaryDirectory(prefix="kvmux-bench-") as tmp:
        config = _config_for(name, shape, Path(tmp), given)
        caches = shape.caches(2 * shape.blocks)
        producer = create_connector(config)
        try:
            producer.register(shape.layout(caches), caches)
            if not producer.capabilities.p2p:
                yield producer, producer, None
                return
            other = shape.caches(2 * shape.blocks, seed=1)
            consumer = create_connector(config)
            try:
                consumer.register(shape.layout(other), other)
                yield producer, consumer, producer.address()
            finally:
                consumer.close()
        finally:
            producer.close()


def _config_for(name: str, shape: Shape, tmp: Path, given: Mapping[str, Any]) -> dict[str, Any]:
    """The backend's defaults, plus room for the batch and a directory where wanted,
    then the fields ``given``."""
    model = config_model_for(name)
    config: dict[str, Any] = {"backend": name}
    if "capacity_bytes" in model.model_fields:
        config["capacity_bytes"] = 2 * shape.nbytes
    config.update(given)
    return {**invent_paths(model, config, tmp), **config}


def lookup_ms(name: str, n: int = 10_000, config: Mapping[str, Any] | None = None) -> float:
    """Milliseconds for one ``lookup`` of ``n`` keys that are all present (tiny blocks)."""
    shape = Shape("lookup", blocks=n, layers=1, tokens=1, heads=1, head_dim=8)
    with _pair(name, shape, config or {}) as (producer, consumer, source):
        keys = chain_keys(range(n), 1, "lookup")
        if not producer.save(keys, list(range(n))).saved().ok:
            raise RuntimeError("saving the lookup keys failed")
        times = []
        for _ in range(5):
            start = time.perf_counter()
            found = consumer.lookup(keys, source)
            times.append(time.perf_counter() - start)
        if found != n:
            raise RuntimeError(f"lookup found {found} of {n} keys")
        return statistics.median(times) * 1e3
