"""``kvmux proxy`` against fake vLLM servers that follow vLLM's P/D convention.

Each test runs its fakes, the proxy and the client on one event loop
(``asyncio.run``; no pytest-asyncio), all on 127.0.0.1 with OS-chosen ports.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvmux.cli.main import main
from kvmux.proxy import (
    PREFILL_KV_TRANSFER_PARAMS,
    ProxyConfig,
    ProxyConfigError,
    config_from_flags,
    decode_body,
    running,
    running_app,
)

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

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.got.append(Got(request.path, body, request.headers.copy()))
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

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, **kwargs) as resp:
            return resp.status, await resp.json()


@asynccontextmanager
async def stack(
    prefill: list[FakeVllm] | None = None,
    decode: list[FakeVllm] | None = None,
    *,
    dead_prefill: bool = False,
    dead_decode: bool = False,
    timeout_s: float = 10.0,
    colocated: bool = False,
) -> AsyncIterator[Stack]:
    """Fakes, the proxy in front of them and a client session; all closed on exit.
    ``colocated``: no prefill fakes, the proxy sends requests whole to ``decode``."""
    prefill = [] if colocated else [FakeVllm("p0")] if prefill is None else prefill
    decode = [FakeVllm("d0")] if decode is None else decode
    async with AsyncExitStack() as running_now:
        p_urls = [await running_now.enter_async_context(running_app(f.app())) for f in prefill]
        d_urls = [await running_now.enter_async_context(running_app(f.app())) for f in decode]
        config = ProxyConfig(
            colocated=colocated,
            prefill=[closed_port_url()] if dead_prefill else p_urls,
            decode=[closed_port_url()] if dead_decode else d_urls,
            port=0,
            timeout_s=timeout_s,
        )
        url = await running_now.enter_async_context(running(config))
        client = await running_now.enter_async_context(aiohttp.ClientSession())
        yield Stack(url, client, prefill, decode)


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
async def test_round_robin_spreads_requests_over_prefill_and_decode_servers() -> None:
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
async def test_colocated_sends_each_request_whole_to_the_next_server_in_turn() -> None:
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
    assert [u["role"] for u in health["upstreams"]] == ["colocated", "colocated"]


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
