"""What one ``kvmux bench serve`` measures, validated before any server starts.

Kept apart from :mod:`~kvmux.bench.serve.run` so the command line can take its
defaults from here without importing the load generator (aiohttp).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmux.bench.serve.metrics import Slo
from kvmux.bench.serve.topology import Topology
from kvmux.bench.serve.workload import PlannedRequest, RequestMix, plan
from kvmux.bench.vllm import BENCH_MODEL
from kvmux.models import TinyModelSpec

#: 16 KiB of KV per token, bf16; a 1536-token prefill takes a few hundred ms on one
#: core here: long enough to stall a colocated decode step visibly.
SERVE_MODEL: TinyModelSpec = BENCH_MODEL


class ServeSettings(BaseModel):
    """What one ``kvmux bench serve`` measures; the defaults are the full run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rates: tuple[float, ...] = Field((1.0, 2.0, 3.0, 4.0), min_length=1)
    chunk_sizes: tuple[int, ...] = Field(
        (256, 512, 2048), description="colocated --max-num-batched-tokens values"
    )
    backends: tuple[Literal["shm", "tcp"], ...] = Field(("shm",), description="1P1D backends")
    duration_s: float = Field(30.0, gt=0, description="seconds of arrivals per rate")
    seed: int = Field(0, ge=0)
    mix: RequestMix = RequestMix()
    slo: Slo = Slo()
    crosscheck: bool = Field(True, description="replay one point with vLLM's benchmark")
    max_num_seqs: int = Field(64, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _something_to_compare(self) -> ServeSettings:
        if not self.chunk_sizes and not self.backends:
            raise ValueError("nothing to run: no chunk size and no backend")
        bad = [r for r in self.rates if not r > 0]
        if bad:
            raise ValueError(f"rates must be > 0 req/s, got {bad}")
        return self

    def topologies(self) -> list[Topology]:
        return [Topology(kind="colocated", chunk_tokens=c) for c in self.chunk_sizes] + [
            Topology(kind="pd", backend=b) for b in self.backends
        ]

    def plan_for(self, index: int, *, fresh_prompts: bool = False) -> list[PlannedRequest]:
        """Rate ``index``'s requests: its own arrivals and prompts (no rate reuses
        another's prompts, or it would hit the prefix cache); ``fresh_prompts``: the
        same arrivals and kinds with prompts no run has sent."""
        prompt_seed = 1_000 * (index + 1) + (500 if fresh_prompts else 0)
        return plan(
            self.mix,
            self.rates[index],
            self.duration_s,
            seed=self.seed * 100 + index,
            prompt_seed=self.seed * 100_000 + prompt_seed,
            vocab_size=SERVE_MODEL.vocab_size,
        )
