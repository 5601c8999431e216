"""kvmux on a real vLLM API server's ``/metrics``: counters as counters, levels as gauges."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvmux.demo.run import (
    BLOCK_SIZE,
    complete,
    kv_transfer_config,
    request_body,
    server_args,
)
from kvmux.demo.servers import VllmServer
from kvmux.models import random_prompts, tiny_model
from kvmux.stats import is_level

pytestmark = pytest.mark.timeout(400)

PROMPTS = 2
FULL_BLOCKS = 2
"""Full blocks per prompt: each is saved once (``cpu`` keeps every block: no eviction)."""
SAMPLE = re.compile(r'^(vllm:kvmux_\w+)\{[^}]*stat="([^"]+)"[^}]*\} (\S+)$')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    args = server_args(kv_transfer_config("kv_both", "cpu"))
    with VllmServer(
        "metrics", tiny_model(), args, log_dir=tmp_path_factory.mktemp("vllm-metrics")
    ) as running:
        yield running


def scrape(server: VllmServer) -> tuple[str, dict[tuple[str, str], float]]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if match := SAMPLE.match(line):
            values[(match[1], match[2])] = float(match[3])
    return text, values


def test_a_real_servers_metrics_show_kvmux_levels_as_gauges_and_counters_as_counters(
    server: VllmServer, tmp_path: Path
) -> None:
    prompts = random_prompts(PROMPTS, FULL_BLOCKS * BLOCK_SIZE + 7, seed=11)
    for prompt in prompts:
        complete(server.url, "/v1/completions", request_body(prompt, 2, stream=False), 120)
    saved = ("vllm:kvmux_stat_total", "save_blocks_ok")
    stored = ("vllm:kvmux_level", "blocks_stored")
    deadline = time.monotonic() + 60
    text, values = scrape(server)
    # Saves end after the step that started them; a short request drives one more step.
    while values.get(stored) != PROMPTS * FULL_BLOCKS and time.monotonic() < deadline:
        complete(server.url, "/v1/completions", request_body([5, 6, 7], 1, stream=False), 60)
        time.sleep(0.5)
        text, values = scrape(server)
    (tmp_path / "metrics.txt").write_text(text)  # for a reader of a failed run
    assert "# TYPE vllm:kvmux_level gauge" in text
    assert "# TYPE vllm:kvmux_stat_total counter" in text
    assert values.get(stored) == PROMPTS * FULL_BLOCKS, sorted(values.items())
    assert values.get(saved) == PROMPTS * FULL_BLOCKS
    assert values[("vllm:kvmux_level", "capacity_blocks")] >= PROMPTS * FULL_BLOCKS
    counters = {stat for metric, stat in values if metric == "vllm:kvmux_stat_total"}
    levels = {stat for metric, stat in values if metric == "vllm:kvmux_level"}
    assert not {stat for stat in counters if is_level(stat)}
    assert levels and all(is_level(stat) for stat in levels)
