"""The two ways of serving on the same cores, each behind the same ``kvmux proxy``.

* **colocated** - two vLLM instances, one core each, every one prefilling and
  decoding its own requests with chunked prefill (``--max-num-batched-tokens``
  = the chunk); the proxy (``colocated`` mode) sends requests to them in turn.
* **1P1D** - a prefill instance on one core and a decode instance on the
  other, joined by a kvmux backend (``shm`` or ``tcp``); the proxy prefills on
  one and decodes on the other.

Each server is pinned with ``taskset`` (its OpenMP threads too), so both
topologies use the same total cores and neither instance borrows the other's.
The proxy and the load generator are not pinned; they are the same in both, each
in a process of its own (:mod:`~kvmux.bench.serve.proxy_process`).
"""

from __future__ import annotations

import contextlib
import re
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmux.demo.run import BLOCK_SIZE, kv_transfer_config, stop_all
from kvmux.demo.run import server_args as demo_server_args
from kvmux.demo.servers import VllmServer

if TYPE_CHECKING:  # the proxy (aiohttp) is imported only when servers start
    from kvmux.bench.serve.proxy_process import ProxyProcess
    from kvmux.proxy import ProxyConfig

#: One name on every server, so one request body fits each.
SERVED_MODEL = "kvmux-bench-serve"


class Topology(BaseModel):
    """One way of serving: ``colocated`` with a chunk size, or ``pd`` over a backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["colocated", "pd"]
    chunk_tokens: int | None = Field(
        None, ge=BLOCK_SIZE, description="colocated: --max-num-batched-tokens (the prefill chunk)"
    )
    backend: Literal["shm", "tcp"] = Field("shm", description="pd: the kvmux backend")

    @property
    def name(self) -> str:
        if self.kind == "colocated":
            return f"colocated chunk={self.chunk_tokens}"
        return f"1P1D {self.backend}"


class ServerSettings(BaseModel):
    """What every server of a run shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_model_len: int = Field(ge=1)
    max_num_seqs: int = Field(64, ge=1)
    dtype: str = "bfloat16"
    kv_cache_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE per server")
    pool_gib: int = Field(1, ge=1, description="1P1D: the kvmux pool of each server")
    start_timeout_s: float = Field(300.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)


def server_args(
    settings: ServerSettings, batched_tokens: int, kv_transfer: dict[str, Any] | None
) -> list[str]:
    return demo_server_args(
        kv_transfer,
        served_model_name=SERVED_MODEL,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=batched_tokens,
    )


def servers_for(
    topology: Topology, model_dir: Path, log_dir: Path, settings: ServerSettings
) -> tuple[list[VllmServer], list[VllmServer]]:
    """(servers that get whole requests or prefills, decode servers) for ``topology``;
    started by :func:`serving`. Core 0 and core 1 either way."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib)}

    def server(name: str, cpu: int, batched: int, kv: dict[str, Any] | None) -> VllmServer:
        args = server_args(settings, batched, kv)
        return VllmServer(name, model_dir, args, log_dir=log_dir, env=env, cpus=(cpu,))

    if topology.kind == "colocated":
        if topology.chunk_tokens is None:
            raise ValueError("a colocated topology needs chunk_tokens")
        chunk = topology.chunk_tokens
        return [], [server(f"colocated{i}", i, chunk, None) for i in (0, 1)]
    # The prefill takes a whole prompt in one step (it has nothing else to do);
    # the decode prefills only what its KV load did not bring.
    whole = settings.max_model_len
    prefill = server("prefill", 0, whole, pd_transfer_config("kv_producer", topology, settings))
    decode = server("decode", 1, whole, pd_transfer_config("kv_consumer", topology, settings))
    return [prefill], [decode]


def pd_transfer_config(role: str, topology: Topology, settings: ServerSettings) -> dict[str, Any]:
    """The demo's kvmux config (recompute on a failed load), with a pool big enough that
    no prompt is evicted before decode reads it: an evicted prompt would be recomputed
    on the decode server, which is colocated serving again, not P/D."""
    config = kv_transfer_config(role, topology.backend)
    config["kv_connector_extra_config"]["capacity_bytes"] = settings.pool_gib * 2**30
    return config


@dataclass(frozen=True)
class Serving:
    """A running topology: where clients go, and its decode servers (whose kvmux
    counters say whether KV was loaded or the prompts recomputed)."""

    url: str
    decode_urls: list[str]
    proxy_cpu_seconds: Callable[[], float]
    """CPU time the proxy process has used so far."""


@contextlib.contextmanager
def serving(
    topology: Topology, model_dir: Path, log_dir: Path, settings: ServerSettings
) -> Iterator[Serving]:
    """``topology``'s servers and the proxy in front of them, for the ``with`` block.
    Every server is stopped on exit, whatever happened."""
    from kvmux.proxy import ProxyConfig

    logs = log_dir / _slug(topology.name)
    prefill, decode = servers_for(topology, model_dir, logs, settings)
    config = ProxyConfig(
        colocated=topology.kind == "colocated",
        prefill=[s.url for s in prefill],
        decode=[s.url for s in decode],
        port=0,
        timeout_s=settings.request_timeout_s,
    )
    with fronted([*prefill, *decode], config, logs / "proxy.log", settings) as proxy:
        decode_urls = [] if topology.kind == "colocated" else [s.url for s in decode]
        yield Serving(proxy.url, decode_urls, proxy.cpu_seconds)


@contextlib.contextmanager
def fronted(
    servers: Sequence[VllmServer], config: ProxyConfig, log_path: Path, settings: ServerSettings
) -> Iterator[ProxyProcess]:
    """``servers`` started and ready, with ``config``'s proxy process in front, for the
    ``with`` block; the proxy and every server stopped on exit, whatever happened."""
    from kvmux.bench.serve.proxy_process import ProxyProcess

    proxy: ProxyProcess | None = None
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(settings.start_timeout_s)
        proxy = ProxyProcess(config, log_path)
        proxy.start()
        yield proxy
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(servers)


_COUNTER = re.compile(r'^vllm:kvmux_stat_total\{[^}]*stat="([^"]+)"[^}]*\}\s+(\S+)$', re.MULTILINE)


def kvmux_counters(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """A vLLM server's kvmux counters from its Prometheus ``/metrics`` (summed over
    engines); empty when it has no kvmux connector."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode(errors="replace")
    totals: dict[str, float] = {}
    for stat, value in _COUNTER.findall(text):
        totals[stat] = totals.get(stat, 0.0) + float(value)
    return totals


def _slug(name: str) -> str:
    return name.replace(" ", "-").replace("=", "")
