"""``kvmux proxy`` against fake vLLM servers that follow vLLM's P/D convention.

Each test runs its fakes, the proxy and the client on one event loop
(``asyncio.run``; no pytest-asyncio), all on 127.0.0.1 with OS-chosen ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from kvmux.cli.main import main
from kvmux.proxy import (
    PREFILL_KV_TRANSFER_PARAMS,
    NoHealthyUpstream,
    PrefixRoutes,
    ProxyConfig,
    ProxyConfigError,
    Upstream,
    UpstreamPool,
    config_from_flags,
    create_app,
    decode_body,
    running,
    running_app,
)
from kvmux.testing import netns

TOKEN_IDS = [101, 7592, 2088, 102]
CHUNKS = 4


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop, never longer than 15 s."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 15))

    return run


@dataclass
class Got:
    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]  # case-insensitive
    peer: tuple[str, int] | None = None
    """The proxy's end of the connection the request came over."""


@dataclass
class FakeVllm:
    """A vLLM server as the proxy sees it. Asked with ``do_remote_decode`` it plays
    prefill and hands back ``kv_transfer_params``; otherwise it plays decode."""

    name: str
    prefill_status: int = 200
    returns_params: bool = True
    delay_s: float = 0.0
    healthy: bool = True
    got: list[Got] = field(default_factory=list)
    #: Set by a test when its client has read the first streamed chunk; the
    #: fake holds the rest of the stream back until then.
    first_chunk_seen: asyncio.Event | None = None
    held_back: bool | None = None
    #: Set when a request's connection closed before its answer was complete
    #: (aiohttp cancels the handler, as vLLM's server aborts the request).
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    #: When given, decode requests wait for it before answering.
    hold: asyncio.Event | None = None
    running: int = 0
    most_running: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.got.append(Got(request.path, body, request.headers.copy(), peer))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            return await self._respond(request, body)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.running -= 1

    async def _respond(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(self.delay_s)
        chat = request.path.endswith("chat/completions")
        params = body.get("kv_transfer_params")
        if params is not None and params.get("do_remote_decode"):
            if self.prefill_status != 200:
                error = {"error": {"message": "prompt too long", "type": "BadRequestError"}}
                return web.json_response(error, status=self.prefill_status)
            kv = {
                "do_remote_prefill": True,
                "remote_engine_id": self.name,
                "remote_block_ids": [0, 1],
                "prompt_token_ids": TOKEN_IDS,
            }
            return web.json_response(
                {**_answer(chat, "x"), "kv_transfer_params": kv if self.returns_params else None}
            )
        if self.hold is not None:
            await self.hold.wait()
        if not body.get("stream"):
            return web.json_response({**_answer(chat, f"from {self.name}"), "by": self.name})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(CHUNKS):
            delta = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
            await out.write(f"data: {json.dumps({'choices': [delta]})}\n\n".encode())
            if i == 0 and self.first_chunk_seen is not None:
                try:
                    await asyncio.wait_for(self.first_chunk_seen.wait(), 3)
                    self.held_back = True
                except TimeoutError:
                    self.held_back = False  # the client never saw chunk 0 on its own
            await asyncio.sleep(0.01)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _models(self, request: web.Request) -> web.Response:
        self.got.append(Got(request.path, {}, request.headers.copy()))
        return web.json_response({"object": "list", "data": [{"id": f"model-{self.name}"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)


def _answer(chat: bool, text: str) -> dict[str, Any]:
    choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"id": "cmpl-1", "choices": [{"index": 0, **choice, "finish_reason": "length"}]}


@dataclass
class Stack:
    url: str
    client: aiohttp.ClientSession
    prefill: list[FakeVllm]
    decode: list[FakeVllm]
    #: The URLs in the proxy's pools, in order.
    url_of_prefill: list[str]
    url_of_decode: list[str]

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
        status, answer, _ = await self.post_seen(path, body, **kwargs)
        return status, answer

    async def post_seen(
        self, path: str, body: Any, **kwargs: Any
    ) -> tuple[int, Any, tuple[str | None, str | None]]:
        """Status, answer and the (prefill, decode) URLs the proxy says served it."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, **kwargs) as resp:
            served = (resp.headers.get("X-Kvmux-Prefill"), resp.headers.get("X-Kvmux-Decode"))
            return resp.status, await resp.json(), served

    async def stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``GET /stats`` by role, then by URL."""
        async with self.client.get(self.url + "/stats") as resp:
            assert resp.status == 200
            report = await resp.json()
        return {role: {u["url"]: u for u in report[role]} for role in ("prefill", "decode")}

    async def in_flight(self) -> list[int]:
        stats = await self.stats()
        return [u["in_flight"] for role in stats.values() for u in role.values()]


@asynccontextmanager
async def stack(
    prefill: list[FakeVllm] | None = None,
    decode: list[FakeVllm] | None = None,
    *,
    dead_prefill: bool = False,
    dead_decode: bool = False,
    timeout_s: float = 10.0,
    first_prefill: Sequence[str] = (),
    colocated: bool = False,
    **config: Any,
) -> AsyncIterator[Stack]:
    """Fakes, the proxy in front of them and a client session; all closed on exit.
    ``first_prefill`` URLs come before the fakes' in the prefill pool; ``config``
    goes to :class:`ProxyConfig`. ``colocated``: no prefill fakes, the proxy sends
    requests whole to ``decode``."""
    prefill = [] if colocated else [FakeVllm("p0")] if prefill is None else prefill
    decode = [FakeVllm("d0")] if decode is None else decode
    async with AsyncExitStack() as running_now:
        p_urls = [await running_now.enter_async_context(running_app(f.app())) for f in prefill]
        d_urls = [await running_now.enter_async_context(running_app(f.app())) for f in decode]
        proxy_config = ProxyConfig(
            colocated=colocated,
            prefill=[closed_port_url()] if dead_prefill else [*first_prefill, *p_urls],
            decode=[closed_port_url()] if dead_decode else d_urls,
            port=0,
            timeout_s=timeout_s,
            **config,
        )
        url = await running_now.enter_async_context(running(proxy_config))
        client = await running_now.enter_async_context(aiohttp.ClientSession())
        yield Stack(url, client, prefill, decode, proxy_config.prefill, proxy_config.decode)


def closed_port_url() -> str:
    """A URL nothing listens on: a port the OS just handed out and took back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def read_events(resp: aiohttp.ClientResponse, on_first: Callable[[], None]) -> list[str]:
    """The ``data:`` payloads of an SSE response, calling ``on_first`` on the first one."""
    events: list[str] = []
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            events.append(event.decode().removeprefix("data: "))
            if len(events) == 1:
                on_first()
    return events


# -- completions -------------------------------------------------------------------


@in_loop
async def test_completion_is_prefilled_remotely_then_decoded_from_the_token_ids() -> None:
    async with stack() as s:
        body = {
            "model": "m",
            "prompt": "hello world",
            "max_tokens": 16,
            "n": 2,
            "min_tokens": 4,
            "stream_options": {"include_usage": True},
        }
        status, answer = await s.post(
            "/v1/completions", body, headers={"Authorization": "Bearer sk-1"}
        )
    assert status == 200
    assert answer["by"] == "d0"
    (prefill,) = s.prefill[0].got
    assert prefill.path == "/v1/completions"
    assert prefill.body["prompt"] == "hello world"
    assert prefill.body["max_tokens"] == 1
    assert prefill.body["stream"] is False
    assert prefill.body["n"] == 1
    assert "stream_options" not in prefill.body
    assert "min_tokens" not in prefill.body
    assert prefill.body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert prefill.body["kv_transfer_params"]["do_remote_decode"] is True
    (decode,) = s.decode[0].got
    assert decode.body["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert decode.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode.body["prompt"] == TOKEN_IDS
    assert {k: decode.body[k] for k in ("max_tokens", "n", "min_tokens")} == {
        "max_tokens": 16,
        "n": 2,
        "min_tokens": 4,
    }
    for got in (prefill, decode):
        assert got.headers["Authorization"] == "Bearer sk-1"
    request_id = prefill.headers["X-Request-Id"]
    assert request_id and decode.headers["X-Request-Id"] == request_id


@in_loop
async def test_an_idle_upstream_connection_is_dropped_before_the_upstream_drops_it() -> None:
    """vLLM closes a connection idle 5 s; aiohttp reuses one idle up to 15 s, and a
    request sent as the server closes it failed as 'Server disconnected' (a 502, and
    the upstream out of rotation). The proxy reuses a connection only while it has
    been idle less than ``upstream_keepalive_s``."""
    async with stack(upstream_keepalive_s=0.3) as s:
        for pause in (0.0, 0.05, 0.6):
            await asyncio.sleep(pause)
            status, _ = await s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 200
    first, soon_after, after_idling = (got.peer for got in s.prefill[0].got)
    assert soon_after == first, "a connection idle 0.05 s is reused"
    assert after_idling != soon_after, "a connection idle 0.6 s is not"


@in_loop
async def test_client_request_id_is_sent_to_both_upstreams_and_back() -> None:
    async with (
        stack() as s,
        s.client.post(
            s.url + "/v1/completions",
            json={"prompt": "hi"},
            headers={"X-Request-Id": "req-42"},
        ) as resp,
    ):
        assert resp.headers["X-Request-Id"] == "req-42"
    assert [g.headers["X-Request-Id"] for g in s.prefill[0].got + s.decode[0].got] == [
        "req-42",
        "req-42",
    ]


@in_loop
async def test_streamed_completion_reaches_the_client_chunk_by_chunk() -> None:
    decode = FakeVllm("d0", first_chunk_seen=asyncio.Event())
    async with stack(decode=[decode]) as s:
        body = {"prompt": "hello", "max_tokens": 8, "stream": True}
        async with s.client.post(s.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.content_type == "text/event-stream"
            assert decode.first_chunk_seen is not None
            events = await read_events(resp, decode.first_chunk_seen.set)
    assert decode.held_back is True, "the first chunk only reached the client with the last"
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2", "t3"]
    assert s.prefill[0].got[0].body["stream"] is False
    assert s.decode[0].got[0].body["stream"] is True
    assert s.decode[0].got[0].body["prompt"] == TOKEN_IDS


# -- chat --------------------------------------------------------------------------


@in_loop
async def test_chat_completion_keeps_its_messages_and_caps_max_completion_tokens() -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with stack() as s:
        body = {"model": "m", "messages": messages, "max_completion_tokens": 32}
        status, answer = await s.post("/v1/chat/completions", body)
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == "from d0"
    (prefill,) = s.prefill[0].got
    assert prefill.path == "/v1/chat/completions"
    assert (prefill.body["max_tokens"], prefill.body["max_completion_tokens"]) == (1, 1)
    assert prefill.body["kv_transfer_params"]["do_remote_decode"] is True
    (decode,) = s.decode[0].got
    assert decode.body["messages"] == messages
    assert "prompt" not in decode.body
    assert decode.body["max_completion_tokens"] == 32
    assert decode.body["kv_transfer_params"]["remote_engine_id"] == "p0"


@in_loop
async def test_streamed_chat_completion_reaches_the_client_chunk_by_chunk() -> None:
    decode = FakeVllm("d0", first_chunk_seen=asyncio.Event())
    async with stack(decode=[decode]) as s:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with s.client.post(s.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert decode.first_chunk_seen is not None
            events = await read_events(resp, decode.first_chunk_seen.set)
    assert decode.held_back is True
    contents = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert contents == ["t0", "t1", "t2", "t3"]
    assert events[-1] == "[DONE]"
    assert s.decode[0].got[0].body["messages"] == body["messages"]


# -- routing -----------------------------------------------------------------------


@in_loop
async def test_equal_loads_spread_requests_in_turn_over_prefill_and_decode_servers() -> None:
    prefill = [FakeVllm("p0"), FakeVllm("p1")]
    decode = [FakeVllm("d0"), FakeVllm("d1")]
    async with stack(prefill, decode) as s:
        answers = [(await s.post("/v1/completions", {"prompt": "hi"}))[1] for _ in range(4)]
    assert [a["by"] for a in answers] == ["d0", "d1", "d0", "d1"]
    assert [len(f.got) for f in prefill + decode] == [2, 2, 2, 2]
    for fake in decode:  # each decode got the params of the prefill it was paired with
        engines = [g.body["kv_transfer_params"]["remote_engine_id"] for g in fake.got]
        assert engines == ["p" + fake.name[1]] * 2


@in_loop
async def test_colocated_sends_each_request_whole_to_the_least_loaded_server_in_turn() -> None:
    servers = [FakeVllm("s0"), FakeVllm("s1")]
    async with stack(decode=servers, colocated=True) as s:
        body = {"model": "m", "prompt": "hi", "max_tokens": 7}
        answers = [(await s.post("/v1/completions", body))[1] for _ in range(4)]
        async with s.client.post(s.url + "/v1/completions", json={**body, "stream": True}) as resp:
            events = await read_events(resp, lambda: None)
        async with s.client.get(s.url + "/health") as resp:
            status, health = resp.status, await resp.json()
    assert [a["by"] for a in answers] == ["s0", "s1", "s0", "s1"]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2", "t3"]
    got = [g for server in servers for g in server.got if g.path == "/v1/completions"]
    assert len(got) == 5
    for g in got:  # untouched: no prefill cut, no hand-off params
        assert g.body["max_tokens"] == 7
        assert "kv_transfer_params" not in g.body
    assert status == 200
    # The colocated servers are the decode pool: they decode (and prefill) whole requests.
    assert [u["role"] for u in health["upstreams"]] == ["decode", "decode"]


def test_config_refuses_prefill_servers_when_colocated() -> None:
    with pytest.raises(ProxyConfigError, match=r"--prefill.*no prefill stage"):
        config_from_flags(
            colocated=True, prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"]
        )


# -- failures ----------------------------------------------------------------------


@in_loop
async def test_unreachable_prefill_is_a_quick_502_naming_it() -> None:
    async with stack(dead_prefill=True, timeout_s=30) as s:
        start = time.monotonic()
        status, answer = await s.post("/v1/completions", {"prompt": "hi"})
        took = time.monotonic() - start
    assert status == 502
    assert took < 5
    assert "prefill upstream http://127.0.0.1:" in answer["error"]["message"]
    assert answer["error"]["type"] == "upstream_error"
    assert s.decode[0].got == []


@in_loop
async def test_unreachable_decode_is_a_502_naming_it() -> None:
    async with stack(dead_decode=True) as s:
        status, answer = await s.post("/v1/completions", {"prompt": "hi", "stream": True})
    assert status == 502
    assert "decode upstream http://127.0.0.1:" in answer["error"]["message"]


@in_loop
async def test_prefill_error_status_and_body_reach_the_client_unchanged() -> None:
    async with stack(prefill=[FakeVllm("p0", prefill_status=400)]) as s:
        status, answer = await s.post("/v1/completions", {"prompt": "hi"})
    assert status == 400
    assert answer == {"error": {"message": "prompt too long", "type": "BadRequestError"}}
    assert s.decode[0].got == []


@in_loop
async def test_slow_prefill_is_a_504_at_the_deadline_not_a_hang() -> None:
    async with stack(prefill=[FakeVllm("p0", delay_s=1.0)], timeout_s=0.2) as s:
        start = time.monotonic()
        status, answer = await s.post("/v1/completions", {"prompt": "hi"})
        took = time.monotonic() - start
    assert status == 504
    assert took < 0.9
    assert "prefill upstream" in answer["error"]["message"]


@in_loop
async def test_prefill_without_a_connector_still_decodes_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmux.proxy")
    async with stack(prefill=[FakeVllm("p0", returns_params=False)]) as s:
        for _ in range(2):
            status, answer = await s.post("/v1/completions", {"prompt": "hi"})
            assert (status, answer["by"]) == (200, "d0")
    assert [g.body.get("kv_transfer_params", "absent") for g in s.decode[0].got] == [
        "absent",
        "absent",
    ]
    assert all(g.body["prompt"] == "hi" for g in s.decode[0].got)
    warnings = [r for r in caplog.records if "no kv_transfer_params" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"prompt": "hi", "stream": "yes"}', "'stream' must be true or false"),
    ],
)
@in_loop
async def test_malformed_client_body_is_a_400_in_openai_shape(raw: bytes, says: str) -> None:
    async with stack() as s:
        status, answer = await s.post("/v1/completions", raw)
    assert status == 400
    assert says in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    assert s.prefill[0].got == []


# -- clients that go away -------------------------------------------------------------


async def send_then_leave(url: str, path: str, body: dict[str, Any], leave_after_s: float) -> None:
    """A client that sends one request, reads nothing and disconnects after ``leave_after_s``."""
    parts = urlsplit(url)
    _, writer = await asyncio.open_connection(parts.hostname, parts.port)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    await asyncio.sleep(leave_after_s)
    writer.close()
    await writer.wait_closed()


@in_loop
async def test_a_client_gone_during_a_whole_decode_closes_the_decode_request() -> None:
    decode = FakeVllm("d0", delay_s=10)
    async with stack(decode=[decode]) as s:
        await send_then_leave(s.url, "/v1/completions", {"prompt": "hi"}, leave_after_s=0.5)
        left = time.monotonic()
        await asyncio.wait_for(decode.cancelled.wait(), 3)
        noticed = time.monotonic() - left
    assert len(decode.got) == 1
    assert noticed < 1.0, f"decode was closed {noticed:.2f} s after the client left"


@in_loop
async def test_a_client_gone_during_prefill_closes_it_and_never_reaches_decode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvmux.proxy")
    prefill = FakeVllm("p0", delay_s=1.0)
    async with stack(prefill=[prefill]) as s:
        await send_then_leave(s.url, "/v1/completions", {"prompt": "hi"}, leave_after_s=0.3)
        await asyncio.wait_for(prefill.cancelled.wait(), 3)
        await asyncio.sleep(1.0)  # past the moment prefill would have answered
    assert len(prefill.got) == 1
    assert s.decode[0].got == []
    assert any(
        "cancelled" in r.getMessage() and "prefill upstream" in r.getMessage()
        for r in caplog.records
    )


@in_loop
async def test_a_client_gone_mid_stream_closes_the_decode_stream() -> None:
    decode = FakeVllm("d0", first_chunk_seen=asyncio.Event())  # holds chunk 1 back for 3 s
    async with stack(decode=[decode]) as s:
        body = {"prompt": "hello", "max_tokens": 8, "stream": True}
        async with s.client.post(s.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
            resp.close()  # the client leaves with the stream half read
        await asyncio.wait_for(decode.cancelled.wait(), 2)
    assert decode.held_back is None, "decode went on streaming after the client left"


@in_loop
async def test_served_without_handler_cancellation_decode_is_still_never_started_for_a_gone_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A runner that does not cancel handlers: prefill runs to its end, then the proxy
    sees its client has gone and does not ask decode."""
    caplog.set_level(logging.INFO, logger="kvmux.proxy")
    prefill, decode = FakeVllm("p0", delay_s=0.6), FakeVllm("d0")
    async with AsyncExitStack() as running_now:
        p_url = await running_now.enter_async_context(running_app(prefill.app()))
        d_url = await running_now.enter_async_context(running_app(decode.app()))
        config = ProxyConfig(prefill=[p_url], decode=[d_url], port=0)
        runner = web.AppRunner(create_app(config))  # aiohttp's default: no cancellation
        await runner.setup()
        running_now.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        await send_then_leave(url, "/v1/completions", {"prompt": "hi"}, leave_after_s=0.2)
        deadline = time.monotonic() + 5
        while not any("not asked" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the proxy never noticed its client had gone"
            await asyncio.sleep(0.05)
    assert len(prefill.got) == 1
    assert decode.got == []
    (note,) = [r.getMessage() for r in caplog.records if "not asked" in r.getMessage()]
    assert "client went away; decode upstream" in note


# -- load-aware choice, taking out and putting back -------------------------------------


async def wait_until(check: Callable[[], bool], timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@in_loop
async def test_the_next_requests_go_to_the_decode_with_fewer_in_flight() -> None:
    busy = FakeVllm("d0", hold=asyncio.Event())
    async with stack([FakeVllm("p0"), FakeVllm("p1")], [busy, FakeVllm("d1")]) as s:
        first = asyncio.create_task(s.post("/v1/completions", {"prompt": "long"}))
        await wait_until(lambda: len(busy.got) == 1)
        others = [(await s.post("/v1/completions", {"prompt": "hi"}))[1] for _ in range(3)]
        stats = await s.stats()
        assert busy.hold is not None
        busy.hold.set()
        status, answer = await first
        after = await s.in_flight()
    assert (status, answer["by"]) == (200, "d0")
    assert [a["by"] for a in others] == ["d1", "d1", "d1"], "turns would have sent one to d0"
    assert [u["in_flight"] for u in stats["decode"].values()] == [1, 0]
    assert [u["sent"] for u in stats["decode"].values()] == [1, 3]
    assert [u["sent"] for u in stats["prefill"].values()] == [2, 2]  # equal loads: in turn
    assert after == [0, 0, 0, 0]


@in_loop
async def test_concurrent_requests_are_spread_by_what_each_server_has_in_flight() -> None:
    decode = [FakeVllm(f"d{i}", delay_s=1.0) for i in range(3)]  # all six overlap
    async with stack(decode=decode) as s:
        answers = await asyncio.gather(
            *(s.post("/v1/completions", {"prompt": f"q{i}"}) for i in range(6))
        )
        after = await s.in_flight()
    assert all(status == 200 for status, _ in answers)
    assert [len(f.got) for f in decode] == [2, 2, 2]
    assert [f.most_running for f in decode] == [2, 2, 2]
    assert after == [0, 0, 0, 0]


@in_loop
async def test_an_unreachable_prefill_is_taken_out_and_its_request_served_by_another(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmux.proxy")
    dead = closed_port_url()
    async with stack([FakeVllm("p1")], first_prefill=[dead]) as s:
        answers = [await s.post_seen("/v1/completions", {"prompt": "hi"}) for _ in range(3)]
        stats = await s.stats()
    assert [(status, seen[0]) for status, _, seen in answers] == [(200, s.url_of_prefill[1])] * 3
    assert len(s.prefill[0].got) == 3
    down = stats["prefill"][dead]
    assert (down["in_rotation"], down["sent"], down["taken_out"]) == (False, 1, 1)
    assert "Connect" in down["last_problem"] or "refused" in down["last_problem"]
    (note,) = [r.getMessage() for r in caplog.records if "taken out" in r.getMessage()]
    assert f"prefill upstream {dead} taken out of rotation" in note


@contextlib.contextmanager
def silent_listener() -> Iterator[str]:
    """A URL whose connects get no answer, as to a host whose cable was pulled: a
    listener with a full accept queue, whose kernel drops further SYNs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(0)
        queued = []
        try:
            for _ in range(3):  # more than the queue holds: the rest wait unanswered
                client = socket.socket()
                client.setblocking(False)
                client.connect_ex(sock.getsockname())
                queued.append(client)
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            for client in queued:
                client.close()


@in_loop
async def test_a_prefill_whose_connect_goes_unanswered_is_taken_out_in_unreachable_after_s() -> (
    None
):
    with silent_listener() as silent:
        async with stack([FakeVllm("p1")], first_prefill=[silent], unreachable_after_s=0.5) as s:
            started = time.monotonic()
            status, _, seen = await s.post_seen("/v1/completions", {"prompt": "hi"})
            took = time.monotonic() - started
            stats = await s.stats()
    assert (status, seen[0]) == (200, s.url_of_prefill[1])
    assert took < 3, "the connect was given unreachable_after_s, not the request's deadline"
    down = stats["prefill"][silent]
    assert (down["in_rotation"], down["sent"], down["taken_out"]) == (False, 1, 1)
    assert "timeout" in down["last_problem"].lower(), down["last_problem"]


@in_loop
async def test_a_prefill_host_cut_off_mid_prefill_is_taken_out_and_another_serves_it() -> None:
    """Each server on a host of its own; p0's link is cut while its prefill is under
    way: the kernel's keepalive gives up on it after ``unreachable_after_s``, p0 is
    taken out and the prefill retried on p1, long before the request's deadline;
    once the link is up, p0's ``/health`` answers and it is back in rotation."""
    if netns.unavailable() is not None:
        pytest.skip(str(netns.unavailable()))
    cut, other, decode = FakeVllm("p0", delay_s=1.0), FakeVllm("p1"), FakeVllm("d0")
    with netns.topology("proxy", "p0", "p1", "d0") as net, net["proxy"].entered():
        async with AsyncExitStack() as running_now:
            urls = []
            for name, fake in (("p0", cut), ("p1", other), ("d0", decode)):
                with net[name].entered():  # its listening socket is that host's
                    app = running_app(fake.app(), net[name].address, 8100)
                    urls.append(await running_now.enter_async_context(app))
            config = ProxyConfig(
                prefill=urls[:2],
                decode=urls[2:],
                host=net["proxy"].address,
                port=0,
                timeout_s=30,
                unreachable_after_s=1.0,
                probe_interval_s=0.1,
            )
            url = await running_now.enter_async_context(running(config))
            client = await running_now.enter_async_context(aiohttp.ClientSession())
            s = Stack(url, client, [cut, other], [decode], urls[:2], urls[2:])
            await _until_healthy(client, url)  # a new switch may take a moment to pass packets
            started = time.monotonic()
            asked = asyncio.create_task(s.post_seen("/v1/completions", {"prompt": "a"}))
            await wait_until(lambda: len(cut.got) == 1)
            net["p0"].link_down()
            status, _, seen = await asked
            took = time.monotonic() - started
            down = (await s.stats())["prefill"][urls[0]]
            net["p0"].link_up()
            start = time.monotonic()
            while not (await s.stats())["prefill"][urls[0]]["in_rotation"]:
                assert time.monotonic() - start < 15, "never put back"
                await asyncio.sleep(0.1)
    assert (status, seen[0]) == (200, urls[1])
    assert took < 10, f"{took:.1f} s: waited for the deadline (30 s), not for the kernel"
    assert (down["in_rotation"], down["taken_out"]) == (False, 1), down
    assert len(other.got) == 1 and len(decode.got) == 1


async def _until_healthy(client: aiohttp.ClientSession, url: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        async with client.get(url + "/health") as resp:
            if resp.status == 200:
                return
        assert time.monotonic() < deadline, f"{url}/health: {await resp.text()}"
        await asyncio.sleep(0.2)


@in_loop
async def test_a_server_that_comes_back_is_put_back_after_its_health_probe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmux.proxy")
    flaky = FakeVllm("p0")
    port = int(urlsplit(closed_port_url()).port or 0)
    flaky_url = f"http://127.0.0.1:{port}"
    async with stack([FakeVllm("p1")], first_prefill=[flaky_url], probe_interval_s=0.1) as s:
        async with running_app(flaky.app(), "127.0.0.1", port):
            status, _, seen = await s.post_seen("/v1/completions", {"prompt": "a"})
            assert (status, seen[0]) == (200, flaky_url)
        # flaky is gone: its next turn fails to connect, is taken out, and p1 answers
        status, _, seen = await s.post_seen("/v1/completions", {"prompt": "b"})
        assert (status, seen[0]) == (200, s.url_of_prefill[1])
        status, _, seen = await s.post_seen("/v1/completions", {"prompt": "c"})
        assert (status, seen[0]) == (200, s.url_of_prefill[1])
        assert (await s.stats())["prefill"][flaky_url]["in_rotation"] is False
        async with running_app(flaky.app(), "127.0.0.1", port):
            start = time.monotonic()
            while not (await s.stats())["prefill"][flaky_url]["in_rotation"]:
                assert time.monotonic() - start < 5, "never put back"
                await asyncio.sleep(0.05)
            seen_now = {(await s.post_seen("/v1/completions", {"prompt": p}))[2][0] for p in "de"}
        stats = await s.stats()
    assert seen_now == {flaky_url, s.url_of_prefill[1]}
    assert stats["prefill"][flaky_url]["taken_out"] == 1
    assert [r.getMessage() for r in caplog.records if "back in rotation" in r.getMessage()] == [
        f"prefill upstream {flaky_url} is healthy again and back in rotation"
    ]


@in_loop
async def test_with_no_healthy_decode_the_answer_is_a_503_naming_it_and_prefill_is_spared() -> None:
    async with stack(dead_decode=True) as s:
        first, _ = await s.post("/v1/completions", {"prompt": "hi"})
        status, answer = await s.post("/v1/completions", {"prompt": "hi"})
        stats = await s.stats()
    assert first == 502
    assert status == 503
    assert answer["error"]["type"] == "no_healthy_upstream"
    (dead,) = stats["decode"]
    assert answer["error"]["message"].startswith(f"no healthy decode upstream: {dead} (")
    assert "probing their /health every 2 s" in answer["error"]["message"]
    assert len(s.prefill[0].got) == 1, "prefill was asked for a request no decode could take"
    assert stats["decode"][dead]["in_flight"] == 0


@in_loop
async def test_an_upstream_that_answers_with_an_error_stays_in_rotation() -> None:
    async with stack(prefill=[FakeVllm("p0", prefill_status=400)]) as s:
        statuses = [(await s.post("/v1/completions", {"prompt": "hi"}))[0] for _ in range(2)]
        stats = await s.stats()
    assert statuses == [400, 400]
    (state,) = stats["prefill"].values()
    assert (state["in_rotation"], state["taken_out"], state["sent"]) == (True, 0, 2)


@in_loop
async def test_in_flight_counts_return_to_zero_after_errors_timeouts_and_clients_that_left() -> (
    None
):
    prefill, decode = FakeVllm("p0"), FakeVllm("d0")
    async with stack([prefill], [decode], timeout_s=1.5) as s:
        prefill.prefill_status = 400
        assert (await s.post("/v1/completions", {"prompt": "refused"}))[0] == 400
        assert await s.in_flight() == [0, 0]
        prefill.prefill_status, decode.delay_s = 200, 5.0
        assert (await s.post("/v1/completions", {"prompt": "too slow"}))[0] == 504
        assert await s.in_flight() == [0, 0]
        await send_then_leave(s.url, "/v1/completions", {"prompt": "bye"}, leave_after_s=0.5)
        await asyncio.wait_for(decode.cancelled.wait(), 3)
        decode.cancelled.clear()
        await wait_until(lambda: decode.running == 0)
        assert await s.in_flight() == [0, 0]
        decode.delay_s = 0.0
        decode.first_chunk_seen = asyncio.Event()  # holds the stream after chunk 0
        body = {"prompt": "stream", "stream": True}
        async with s.client.post(s.url + "/v1/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            assert await s.in_flight() == [0, 1]
            resp.close()
        await asyncio.wait_for(decode.cancelled.wait(), 3)
        await wait_until(lambda: decode.running == 0)
        after = await s.in_flight()
    assert after == [0, 0]


@in_loop
async def test_health_reports_each_upstream_and_puts_it_in_or_out_of_rotation() -> None:
    async with stack([FakeVllm("p0"), FakeVllm("p1", healthy=False)]) as s:
        async with s.client.get(s.url + "/health") as resp:
            report = await resp.json()
        out = (await s.stats())["prefill"]
        s.prefill[1].healthy = True
        async with s.client.get(s.url + "/health") as resp:
            assert resp.status == 200
        back = (await s.stats())["prefill"]
    assert [(u["role"], u["in_rotation"], u["in_flight"]) for u in report["upstreams"]] == [
        ("prefill", True, 0),
        ("prefill", False, 0),
        ("decode", True, 0),
    ]
    assert [u["in_rotation"] for u in out.values()] == [True, False]
    assert list(out.values())[1]["last_problem"] == "/health: HTTP 503"
    assert [u["in_rotation"] for u in back.values()] == [True, True]


# -- prefix-aware routing ----------------------------------------------------------------

LONG = "the quick brown fox jumps over the lazy dog " * 12  # two 256-character chunks


@in_loop
async def test_a_repeated_prompt_prefix_goes_back_to_the_servers_that_served_it() -> None:
    two = ([FakeVllm("p0"), FakeVllm("p1")], [FakeVllm("d0"), FakeVllm("d1")])
    async with stack(*two) as s:
        seen = [
            (await s.post_seen("/v1/completions", {"prompt": prompt}))[2]
            for prompt in (LONG, LONG + "and then some", "short", LONG)
        ]
    p0, p1 = s.url_of_prefill
    d0, d1 = s.url_of_decode
    assert seen == [(p0, d0), (p0, d0), (p1, d1), (p0, d0)]


@in_loop
async def test_without_prefix_routes_a_repeated_prompt_goes_in_turn() -> None:
    two = ([FakeVllm("p0"), FakeVllm("p1")], [FakeVllm("d0"), FakeVllm("d1")])
    async with stack(*two, prefix_routes=0) as s:
        seen = [(await s.post_seen("/v1/completions", {"prompt": LONG}))[2] for _ in range(2)]
        report = await (await s.client.get(s.url + "/stats")).json()
    assert [p for p, _ in seen] == s.url_of_prefill
    assert report["prefix_routes"] is None


def test_a_preferred_upstream_wins_unless_it_is_clearly_busier() -> None:
    pool = UpstreamPool("decode", ["http://a:1", "http://b:1"], prefer_slack=1)
    with pool.acquire() as busy:
        assert busy.url == "http://a:1"
        assert pool.choose(prefer="http://a:1").url == "http://a:1"  # one more: still worth it
        with pool.acquire(prefer="http://a:1"):
            assert pool.choose(prefer="http://a:1").url == "http://b:1"  # two more: not
    pool.take_out(Upstream("decode", "http://a:1"), "refused")
    assert pool.choose(prefer="http://a:1").url == "http://b:1"


def test_pool_counts_in_flight_back_on_errors_and_cancellation() -> None:
    pool = UpstreamPool("prefill", ["http://a:1", "http://b:1"])

    async def held(event: asyncio.Event) -> None:
        with pool.acquire():
            await event.wait()

    async def scenario() -> list[int]:
        task = asyncio.create_task(held(asyncio.Event()))
        await asyncio.sleep(0)
        assert [u["in_flight"] for u in pool.report()] == [1, 0]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(RuntimeError), pool.acquire():
            raise RuntimeError("upstream failed")
        return [u["in_flight"] for u in pool.report()]

    assert asyncio.run(scenario()) == [0, 0]
    assert [u["sent"] for u in pool.report()] == [1, 1]


def test_a_pool_with_every_upstream_out_names_them_and_why() -> None:
    pool = UpstreamPool("decode", ["http://a:1", "http://b:1"])
    pool.take_out(Upstream("decode", "http://a:1"), "refused")
    with pytest.raises(NoHealthyUpstream) as info:
        pool.choose(exclude=["http://b:1"])
    assert str(info.value) == (
        "no healthy decode upstream: http://a:1 (refused); failed for this request: http://b:1"
    )


def test_prefix_keys_stand_for_whole_chunks_of_what_the_client_sent() -> None:
    routes = PrefixRoutes(capacity=3, chunk_tokens=2, chunk_chars=4)
    tokens = routes.keys("/v1/completions", {"model": "m", "prompt": [1, 2, 3, 4, 5]})
    assert len(tokens) == 2  # [1, 2], [3, 4]; the lone 5 is not a whole chunk
    longer = routes.keys("/v1/completions", {"model": "m", "prompt": [1, 2, 3, 4, 9, 9]})
    assert longer[:2] == tokens
    assert routes.keys("/v1/completions", {"model": "other", "prompt": [1, 2]}) != tokens[:1]
    assert routes.keys("/v1/completions", {"prompt": ["a", "b"]}) == []  # a batch
    chat = routes.keys("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat and chat != routes.keys("/v1/completions", {"prompt": "hi"})
    routes.record(longer, "decode", "http://d:1")
    assert routes.holder(tokens, "decode") == "http://d:1"
    assert routes.holder(tokens, "prefill") is None
    routes.record(routes.keys("/v1/completions", {"prompt": "abcdefgh"}), "prefill", "http://p:1")
    assert len(routes) == 3  # capacity: the oldest key went
    assert routes.holder(longer[:1], "decode") is None
    assert routes.holder(longer, "decode") == "http://d:1"


# -- other endpoints -----------------------------------------------------------------


@in_loop
async def test_models_come_from_a_decode_server() -> None:
    async with stack() as s, s.client.get(s.url + "/v1/models") as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == "model-d0"
    assert s.prefill[0].got == []


@in_loop
async def test_health_is_ok_only_when_every_upstream_is() -> None:
    async with stack([FakeVllm("p0"), FakeVllm("p1", healthy=False)]) as s:
        async with s.client.get(s.url + "/health") as resp:
            assert resp.status == 503
            report = await resp.json()
        s.prefill[1].healthy = True
        async with s.client.get(s.url + "/health") as resp:
            assert resp.status == 200
    assert report["status"] == "unhealthy"
    assert [u["ok"] for u in report["upstreams"]] == [True, False, True]
    assert "prefill upstream" in report["error"]["message"]
    assert "HTTP 503" in report["error"]["message"]


@in_loop
async def test_health_names_an_unreachable_upstream() -> None:
    async with stack(dead_decode=True) as s, s.client.get(s.url + "/health") as resp:
        assert resp.status == 503
        assert "decode upstream http://127.0.0.1:" in (await resp.json())["error"]["message"]


# -- the request bodies ----------------------------------------------------------------


def test_only_a_single_string_completion_prompt_is_replaced_by_token_ids() -> None:
    params = {"remote_engine_id": "p0", "prompt_token_ids": TOKEN_IDS}
    batch = {"prompt": ["a", "b"]}
    assert decode_body(batch, "completions", params)["prompt"] == ["a", "b"]
    assert decode_body({"prompt": "a"}, "completions", params)["prompt"] == TOKEN_IDS
    no_ids = {"remote_engine_id": "p0"}
    assert decode_body({"prompt": "a"}, "completions", no_ids)["prompt"] == "a"
    chat = decode_body({"messages": []}, "chat", params)
    assert chat == {"messages": [], "kv_transfer_params": params}


# -- config and command line ---------------------------------------------------------------


@pytest.mark.parametrize("bad", ["ftp://host:1", "127.0.0.1:8100", "http://", "http://h:99999"])
def test_config_refuses_a_bad_url_naming_its_flag(bad: str) -> None:
    with pytest.raises(ProxyConfigError, match="--decode") as info:
        config_from_flags(prefill=["http://127.0.0.1:8100/"], decode=[bad])
    assert repr(bad) in str(info.value)


def test_config_needs_an_upstream_of_each_role_and_drops_trailing_slashes() -> None:
    with pytest.raises(ProxyConfigError, match="--prefill"):
        config_from_flags(prefill=[], decode=["http://127.0.0.1:1"])
    config = ProxyConfig(prefill=["https://p.example/base/"], decode=["http://127.0.0.1:1"])
    assert config.prefill == ["https://p.example/base"]
    assert config.host == "127.0.0.1"


def test_config_refuses_an_upstream_listed_twice() -> None:
    url = "http://127.0.0.1:8100"
    with pytest.raises(ProxyConfigError, match="prefill URLs listed more than once") as info:
        config_from_flags(prefill=[url, url + "/"], decode=["http://127.0.0.1:1"])
    assert url in str(info.value)


def test_cli_reports_a_bad_probe_interval_with_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    url = "http://127.0.0.1:1"
    code = main(["proxy", "--prefill", url, "--decode", url, "--probe-interval-s", "0"])
    assert code == 2
    assert "--probe-interval-s 0.0" in capsys.readouterr().err


def test_cli_reports_a_bad_url_with_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["proxy", "--prefill", "localhost:8100", "--decode", "http://127.0.0.1:1"])
    assert code == 2
    assert "--prefill 'localhost:8100'" in capsys.readouterr().err


@in_loop
async def test_cli_serves_until_terminated() -> None:
    async with AsyncExitStack() as running_now:
        prefill, decode = FakeVllm("p0"), FakeVllm("d0")
        p_url = await running_now.enter_async_context(running_app(prefill.app()))
        d_url = await running_now.enter_async_context(running_app(decode.app()))
        argv = ["proxy", "--port", "0", "--prefill", p_url, "--decode", d_url]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvmux.cli.main",
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
            assert line.startswith("kvmux proxy listening on http://127.0.0.1:"), line
            url = line.split()[-1]
            assert not url.endswith(":0")
            async with (
                aiohttp.ClientSession() as client,
                client.post(url + "/v1/completions", json={"prompt": "hi"}) as resp,
            ):
                assert resp.status == 200
                assert (await resp.json())["by"] == "d0"
            assert decode.got[0].body["kv_transfer_params"]["remote_engine_id"] == "p0"
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 5) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
