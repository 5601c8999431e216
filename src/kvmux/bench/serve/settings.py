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

#: 16 KiB of KV per token, bf16; a 2048-token prefill takes ~0.35 s on one core
#: here, a decode step ~13 ms: one prefill stalls a colocated decode step ~25-fold.
SERVE_MODEL: TinyModelSpec = BENCH_MODEL


class ServeSettings(BaseModel):
    """What one ``kvmux bench serve`` measures; the defaults are the full run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rates: tuple[float, ...] = Field(
        (0.5, 1.0, 2.0, 3.0, 3.5),
        min_length=1,
        description="offered loads, req/s: from below the rate where an unchunked "
        "instance's stalls reach its p99 (~1.6 with the default mix) to about where one "
        "prefill core saturates (~3.5)",
    )
    chunk_sizes: tuple[int, ...] = Field(
        (256, 512, 2048), description="colocated --max-num-batched-tokens values"
    )
    backends: tuple[Literal["shm", "tcp"], ...] = Field(("shm",), description="1P1D backends")
    duration_s: float = Field(
        40.0, gt=0, description="seconds of arrivals per rate (~1000 token gaps at 1 req/s)"
    )
    seed: int = Field(0, ge=0)
    mix: RequestMix = RequestMix()
    slo: Slo = Slo()
    crosscheck: bool = Field(True, description="replay one point with vLLM's benchmark")
    max_num_seqs: int = Field(64, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)
    step_batches: tuple[int, ...] = Field(
        (1, 2, 4, 8, 16),
        description="batch sizes of the step profile (decode step time vs batch on one core; "
        "measured when a 1P1D topology runs; empty: not measured)",
    )
    step_tokens: int = Field(64, ge=2, description="tokens each request of a step probe decodes")

    @model_validator(mode="after")
    def _something_to_compare(self) -> ServeSettings:
        if not self.chunk_sizes and not self.backends:
            raise ValueError("nothing to run: no chunk size and no backend")
        bad = [r for r in self.rates if not r > 0]
        if bad:
            raise ValueError(f"rates must be > 0 req/s, got {bad}")
        small = [b for b in self.step_batches if b < 1 or b > self.max_num_seqs]
        if small:
            raise ValueError(f"step batches must be 1 to max_num_seqs, got {small}")
        return self

    def prefill_lengths(self) -> list[int]:
        """The step profile's prompt lengths: each colocated chunk (a chunk's prefill
        is what it adds to a decode step) up to the long prompt, and the long prompt."""
        longest = self.mix.long_prompt_tokens
        return sorted({c for c in self.chunk_sizes if c < longest} | {longest})

    def topologies(self) -> list[Topology]:
        return [Topology(kind="colocated", chunk_tokens=c) for c in self.chunk_sizes] + [
            Topology(kind="pd", backend=b) for b in self.backends
        ]

    def plan_for(self, index: int, *, replay: int = 0) -> list[PlannedRequest]:
        """Rate ``index``'s requests: its own arrivals and prompts (no rate reuses
        another's prompts, or it would hit the prefix cache); ``replay`` k >= 1: the
        same arrivals and kinds with the k-th set of prompts no other run has sent."""
        if not 0 <= replay < 10:
            raise ValueError(f"replay is 0 (the run itself) to 9, got {replay}")
        prompt_seed = 1_000 * (index + 1) + 100 * replay
        return plan(
            self.mix,
            self.rates[index],
            self.duration_s,
            seed=self.seed * 100 + index,
            prompt_seed=self.seed * 100_000 + prompt_seed,
            vocab_size=SERVE_MODEL.vocab_size,
        )
