"""The aiohttp application: one client request in, a prefill then a decode request out.

The proxy adds no protocol of its own (see :mod:`kvmux.proxy.handoff`), so it
works in front of any vLLM KV connector that follows vLLM's P/D convention.
Configured ``colocated``, it has no prefill stage and sends each request whole
to the next server: the same front end for colocated serving, so the two can
be compared with nothing else changed (``kvmux bench serve`` does).
It must never be the reason a client hangs or waits longer than it has to:

* every client request has one deadline (``timeout_s``) shared by its prefill
  and decode calls; past it the client gets 504, naming the upstream;
* an upstream that cannot be reached is a 502 naming it; an upstream that
  answers with an error has its status and body passed through unchanged;
* a streamed answer is relayed chunk by chunk as decode produces it, never
  buffered, and a client that goes away closes the decode request with it.

One ``aiohttp.ClientSession`` (one connection pool) serves the whole app; it
is opened when the app starts and closed when it is cleaned up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from kvmux.proxy.config import ProxyConfig
from kvmux.proxy.handoff import (
    BadClientRequest,
    Endpoint,
    decode_body,
    kv_params_from,
    parse_client_body,
    prefill_body,
    wants_stream,
)
from kvmux.proxy.upstreams import Upstream, UpstreamPool

log = logging.getLogger("kvmux.proxy")

PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REQUEST_ID = "X-Request-Id"
#: Client headers passed on to both upstreams (with X-Request-Id); the rest describe
#: the hop to the proxy, not the request.
FORWARDED_HEADERS = ("Authorization",)


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """An OpenAI-style error, the shape vLLM and its clients expect."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(
    status: int, message: str, kind: str, request_id: str | None = None
) -> web.Response:
    headers = {REQUEST_ID: request_id} if request_id else None
    return web.json_response(error_body(status, message, kind), status=status, headers=headers)


class _Answer(Exception):
    """Ends a hand-off early with the response the client gets."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class Proxy:
    """The request handlers and what they share: the config, the pools, the session."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        #: None when colocated: no prefill stage, requests go whole to ``decode``'s servers.
        self.prefill = UpstreamPool("prefill", config.prefill) if config.prefill else None
        self.decode = UpstreamPool("colocated" if config.colocated else "decode", config.decode)
        self._session: aiohttp.ClientSession | None = None
        self._warned_no_params = False

    # -- lifecycle -----------------------------------------------------------------

    async def client_session(self, app: web.Application) -> AsyncIterator[None]:
        """``cleanup_ctx`` hook: the app's one ClientSession lives as long as the app."""
        # No pool limit: vLLM queues requests itself, and a proxy-side cap would
        # make long streams starve short requests without the client knowing why.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            self._session = session
            try:
                yield
            finally:
                self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's ClientSession is opened when the app starts")
        return self._session

    # -- handlers ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handoff(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handoff(request, "chat")

    async def models(self, request: web.Request) -> web.StreamResponse:
        """Any decode server serves the same model(s); ask the next one."""
        upstream = self.decode.next()
        request_id = request.headers.get(REQUEST_ID) or _new_request_id()
        headers = self._headers(request, request_id)
        try:
            return await self._exchange(
                "GET", upstream, "/v1/models", None, headers, self._deadline(), request_id
            )
        except _Answer as answer:
            return answer.response

    async def health(self, request: web.Request) -> web.Response:
        """200 when every upstream's ``/health`` answers 2xx, else 503 naming the others."""
        upstreams = [*(self.prefill.all() if self.prefill else ()), *self.decode.all()]
        problems = await asyncio.gather(*(self._check(u) for u in upstreams))
        report = [
            {"role": u.role, "url": u.url, "ok": problem is None, "detail": problem or "ok"}
            for u, problem in zip(upstreams, problems, strict=True)
        ]
        failed = [f"{u} ({p})" for u, p in zip(upstreams, problems, strict=True) if p]
        body: dict[str, Any] = {"status": "unhealthy" if failed else "ok", "upstreams": report}
        if failed:
            message = "unhealthy: " + "; ".join(failed)
            body.update(error_body(503, message, "upstream_unhealthy"))
        return web.json_response(body, status=503 if failed else 200)

    # -- the hand-off --------------------------------------------------------------

    async def _handoff(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID) or _new_request_id()
        try:
            body = parse_client_body(await request.read())
        except BadClientRequest as exc:
            return error_response(400, str(exc), "invalid_request_error", request_id)
        deadline = self._deadline()
        headers = self._headers(request, request_id)
        prefill = self.prefill.next() if self.prefill else None
        decode = self.decode.next()
        path = PATHS[endpoint]
        try:
            out = body
            if prefill is not None:
                payload = await self._exchange(
                    "POST", prefill, path, prefill_body(body), headers, deadline, request_id
                )
                params = kv_params_from(_json_or_none(payload.body))
                if params is None:
                    self._warn_no_params(prefill)
                out = decode_body(body, endpoint, params)
            if wants_stream(body):
                return await self._relay_stream(request, decode, path, out, headers, deadline)
            return await self._exchange("POST", decode, path, out, headers, deadline, request_id)
        except _Answer as answer:
            return answer.response

    async def _exchange(
        self,
        method: str,
        upstream: Upstream,
        path: str,
        body: Mapping[str, Any] | None,
        headers: Mapping[str, str],
        deadline: float,
        request_id: str,
    ) -> web.Response:
        """One whole request/response with an upstream. A 2xx is returned; anything
        else raises :class:`_Answer` with what the client should get."""
        try:
            timeout = self._timeout(upstream, deadline, request_id)
            async with self.session.request(
                method, upstream.url + path, json=body, headers=headers, timeout=timeout
            ) as resp:
                relayed = _relay(resp.status, resp.headers, await resp.read(), request_id)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Answer(_upstream_failed(upstream, exc, request_id)) from None
        if not 200 <= relayed.status < 300:
            log.info("%s answered %s %s with HTTP %d", upstream, method, path, relayed.status)
            raise _Answer(relayed)
        return relayed

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: Upstream,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        deadline: float,
    ) -> web.StreamResponse:
        """Decode's server-sent events, passed on as each chunk arrives."""
        request_id = headers[REQUEST_ID]
        timeout = self._timeout(upstream, deadline, request_id)
        try:
            resp = await self.session.post(
                upstream.url + path, json=body, headers=headers, timeout=timeout
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Answer(_upstream_failed(upstream, exc, request_id)) from None
        try:
            if not 200 <= resp.status < 300:
                try:
                    payload = await resp.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise _Answer(_upstream_failed(upstream, exc, request_id)) from None
                raise _Answer(_relay(resp.status, resp.headers, payload, request_id))
            out = web.StreamResponse(
                status=resp.status,
                headers={
                    "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                    "Cache-Control": "no-cache",
                    REQUEST_ID: request_id,
                },
            )
            await out.prepare(request)
            while True:
                try:
                    chunk = await resp.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # Headers are sent: report in-band, the way vLLM reports stream errors.
                    status, message, kind = _failure(upstream, exc)
                    log.warning("request %s: %s", request_id, message)
                    event = json.dumps(error_body(status, message, kind)).encode()
                    chunk = b"data: " + event + b"\n\n"
                    if not await _write(out, chunk):
                        return out
                    break
                if not chunk:
                    break
                if not await _write(out, chunk):
                    log.info("client went away while streaming request %s", request_id)
                    return out  # releasing resp closes the decode request too
            with contextlib.suppress(ConnectionResetError):  # client left after [DONE]
                await out.write_eof()
            return out
        finally:
            resp.release()

    # -- helpers -------------------------------------------------------------------

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.config.timeout_s

    def _timeout(
        self, upstream: Upstream, deadline: float, request_id: str
    ) -> aiohttp.ClientTimeout:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise _Answer(_upstream_failed(upstream, TimeoutError(), request_id))
        return aiohttp.ClientTimeout(total=left)

    @staticmethod
    def _headers(request: web.Request, request_id: str) -> dict[str, str]:
        headers = {
            name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers
        }
        headers[REQUEST_ID] = request_id  # the same id on both engines ties their logs
        return headers

    async def _check(self, upstream: Upstream) -> str | None:
        """Why ``upstream`` is unhealthy, or None."""
        timeout = aiohttp.ClientTimeout(
            total=min(self.config.health_timeout_s, self.config.timeout_s)
        )
        try:
            async with self.session.get(upstream.url + "/health", timeout=timeout) as resp:
                return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
        except TimeoutError:
            return f"no answer within {timeout.total:g} s"
        except aiohttp.ClientError as exc:
            return str(exc) or type(exc).__name__

    def _warn_no_params(self, upstream: Upstream) -> None:
        if self._warned_no_params:
            return
        self._warned_no_params = True
        log.warning(
            "%s returned no kv_transfer_params: decode will recompute the prompt. Is a KV "
            "connector (kv_role kv_producer or kv_both) configured on it? (warned once)",
            upstream,
        )


#: Where an app built here keeps its :class:`Proxy` (``app[PROXY_KEY].config`` ...).
PROXY_KEY = web.AppKey("kvmux_proxy", Proxy)


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (serve it with :func:`kvmux.proxy.running`)."""
    proxy = Proxy(config)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[PROXY_KEY] = proxy
    app.cleanup_ctx.append(proxy.client_session)
    app.router.add_post(PATHS["completions"], proxy.completions)
    app.router.add_post(PATHS["chat"], proxy.chat_completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    return app


def build_app(
    prefill: Sequence[str], decode: Sequence[str], timeout_s: float = 600.0
) -> web.Application:
    """:func:`create_app` from upstream URLs (validated: http(s), at least one of each)."""
    return create_app(ProxyConfig(prefill=list(prefill), decode=list(decode), timeout_s=timeout_s))


def _new_request_id() -> str:
    return f"kvmux-{uuid.uuid4().hex}"


def _json_or_none(body: Any) -> Any:
    if not isinstance(body, bytes):
        return None
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def _relay(
    status: int, headers: Mapping[str, str], payload: bytes, request_id: str
) -> web.Response:
    """An upstream's answer, status and body unchanged."""
    content_type = headers.get("Content-Type", "application/json")
    return web.Response(
        status=status, body=payload, headers={"Content-Type": content_type, REQUEST_ID: request_id}
    )


def _failure(upstream: Upstream, exc: BaseException) -> tuple[int, str, str]:
    """Status, message and error type for an upstream that could not be used."""
    if isinstance(exc, TimeoutError):
        return 504, f"{upstream} did not answer in time", "upstream_timeout"
    return 502, f"{upstream} failed: {str(exc) or type(exc).__name__}", "upstream_error"


def _upstream_failed(upstream: Upstream, exc: BaseException, request_id: str) -> web.Response:
    return error_response(*_failure(upstream, exc), request_id)


async def _write(out: web.StreamResponse, chunk: bytes) -> bool:
    """Send ``chunk`` to the client; False when the client has gone away."""
    try:
        await out.write(chunk)
    except ConnectionResetError:
        return False
    return True
