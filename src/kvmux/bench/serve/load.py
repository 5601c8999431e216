"""The load generator: sends planned requests on their schedule and times every chunk.

Each request is a streamed ``/v1/completions`` call with token-id prompts,
greedy, ``ignore_eos`` (so every request generates exactly its
``max_tokens``), usage in the last chunk. Requests are sent at their planned
arrival times whether or not earlier ones have finished (an open loop, as a
Poisson arrival process must be): a server that falls behind shows it in
TTFT, never by slowing the arrivals down.

Times are ``time.perf_counter()`` on one clock, relative to the run's start.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvmux.bench.serve.metrics import RequestTiming
from kvmux.bench.serve.workload import PlannedRequest


def request_body(model: str, request: PlannedRequest) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_load(
    url: str, model: str, requests: Sequence[PlannedRequest], timeout_s: float
) -> list[RequestTiming]:
    """Every request sent at its ``arrival_s`` to ``url`` (a base URL); their timings
    in the order planned. A request that fails is timed with its error, never raised."""
    connector = aiohttp.TCPConnector(limit=0)  # an open loop: no client-side queue
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, model, request, start)))
        return list(await asyncio.gather(*tasks))


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, request: PlannedRequest, start: float
) -> RequestTiming:
    chunks: list[float] = []
    tokens = 0
    sent = time.perf_counter() - start
    error: str | None = None
    try:
        async with session.post(url + "/v1/completions", json=request_body(model, request)) as resp:
            if resp.status != 200:
                detail = (await resp.read())[:300].decode(errors="replace")
                error = f"HTTP {resp.status}: {detail}"
            else:
                tokens, error = await _read_events(resp, chunks, start)
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return RequestTiming(request.kind, sent, tuple(chunks), tokens, error)


async def _read_events(
    resp: aiohttp.ClientResponse, chunks: list[float], start: float
) -> tuple[int, str | None]:
    """Server-sent events until ``[DONE]``: a timestamp per chunk with a choice, the
    token count from the usage chunk (else one token per chunk)."""
    usage_tokens: int | None = None
    async for raw in resp.content:  # one line at a time
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            return 0, f"in-stream error: {event['error']}"
        if event.get("choices"):
            chunks.append(time.perf_counter() - start)
        elif isinstance(event.get("usage"), dict):
            usage_tokens = int(event["usage"].get("completion_tokens") or 0)
    if not chunks:
        return 0, "the stream ended without a token"
    return (usage_tokens if usage_tokens is not None else len(chunks)), None
