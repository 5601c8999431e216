"""The load: Poisson arrivals of a mix of long-prompt and long-output requests.

The mix is the point. A long prompt's prefill is one big compute burst; on an
engine that also decodes other requests, that burst lands between two of their
decode steps (chunked prefill only cuts it into smaller bursts). Long outputs
are the requests whose inter-token latency shows it. So the workload has both,
in a fixed share, arriving as a Poisson process at a given rate.

Everything is a pure function of its arguments (seeded ``random.Random``, never
the global generator): every topology gets the very same schedule and prompts
for a rate, and a rerun gets them again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmux.models import random_prompts

RequestKind = Literal["long-prompt", "long-output"]


class RequestMix(BaseModel):
    """The two request shapes and how often each arrives.

    The defaults are chosen so that the stalls the claim is about reach the p99
    of colocated ITL while both topologies still sustain the load. A prefill
    stalls each decode running beside it once per chunk, so the share of token
    gaps that are stalled is about (long prompts per second per instance) x
    (chunks per prompt) x (one decode step). With half the requests 1536-token
    prompts (the seed's mix), that was 0.25/s x 1 x 16 ms = 0.4% at 1 req/s
    for an unchunked instance: below 1%, so its p99 never saw a stall and the
    comparison measured something else (the decode batch). Here 80% of the
    requests are 2048-token prompts: an unchunked instance's stalls pass 1% of
    gaps from ~1.6 req/s (0.64/s x 1 x 16 ms), a 256-token chunk's (8 per
    prompt) from ~0.2 req/s. The long prompts generate 4 tokens and the long
    outputs 128, so the 1P1D decode server, which holds every decode, keeps a
    small batch (on a CPU a decode step grows with the batch, unlike on a GPU:
    ``kvmux bench serve`` measures it, :mod:`~kvmux.bench.serve.steps`), and a
    run's drain stays short. One prefill server saturates at about one 2048-token
    prefill per ~0.35 s on one core (~3.5 req/s of this mix), two colocated
    instances later: where 1P1D's throughput falls behind is the crossover.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    long_prompt_tokens: int = Field(2048, ge=1, description="prompt of a long-prompt request")
    long_prompt_output_tokens: int = Field(
        4, ge=1, description="tokens a long-prompt request generates"
    )
    long_output_prompt_tokens: int = Field(64, ge=1, description="prompt of a long-output request")
    long_output_tokens: int = Field(128, ge=2, description="tokens a long-output request generates")
    long_prompt_share: float = Field(
        0.8, ge=0.0, le=1.0, description="fraction of requests that are long-prompt"
    )

    @model_validator(mode="after")
    def _has_decodes(self) -> RequestMix:
        if self.long_prompt_share == 1.0 and self.long_prompt_output_tokens < 2:
            raise ValueError("every request would produce one token: no inter-token latency")
        return self

    @property
    def longest_sequence(self) -> int:
        """Prompt plus output of the longest request (the servers' --max-model-len)."""
        return max(
            self.long_prompt_tokens + self.long_prompt_output_tokens,
            self.long_output_prompt_tokens + self.long_output_tokens,
        )

    def mean_output_tokens(self) -> float:
        share = self.long_prompt_share
        return share * self.long_prompt_output_tokens + (1 - share) * self.long_output_tokens


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a run: what to send and when (seconds after the run starts)."""

    index: int
    kind: RequestKind
    prompt: list[int]
    max_tokens: int
    arrival_s: float


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (s) of a Poisson process of ``rate`` requests/s, the first
    one at its own exponential gap after 0. Same arguments, same times."""
    if n < 0:
        raise ValueError(f"need n >= 0 requests, got {n}")
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    times: list[float] = []
    now = 0.0
    for _ in range(n):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def plan(
    mix: RequestMix,
    rate: float,
    duration_s: float,
    *,
    seed: int,
    prompt_seed: int,
    vocab_size: int,
) -> list[PlannedRequest]:
    """``rate * duration_s`` requests (at least one) with Poisson arrivals and kinds
    drawn from ``seed``, prompts from ``prompt_seed``.

    The two seeds are separate so a second pass over the same schedule (the
    cross-check with vLLM's benchmark) can use fresh prompts: the same prompts
    again would be prefix-cache hits and skip the very prefills under test.
    """
    if not duration_s > 0:
        raise ValueError(f"the arrival window must be > 0 s, got {duration_s}")
    n = max(1, round(rate * duration_s))
    arrivals = poisson_arrivals(n, rate, seed)
    draw = random.Random(seed + 1)
    kinds: list[RequestKind] = [
        "long-prompt" if draw.random() < mix.long_prompt_share else "long-output" for _ in range(n)
    ]
    n_long = kinds.count("long-prompt")
    long_prompts = iter(random_prompts(n_long, mix.long_prompt_tokens, prompt_seed, vocab_size))
    short_prompts = iter(
        random_prompts(n - n_long, mix.long_output_prompt_tokens, prompt_seed + 1, vocab_size)
    )
    out = []
    for i, (kind, arrival) in enumerate(zip(kinds, arrivals, strict=True)):
        if kind == "long-prompt":
            prompt, tokens = next(long_prompts), mix.long_prompt_output_tokens
        else:
            prompt, tokens = next(short_prompts), mix.long_output_tokens
        out.append(PlannedRequest(i, kind, prompt, tokens, arrival))
    return out
