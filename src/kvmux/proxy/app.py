"""The aiohttp application: one client request in, a prefill then a decode request out.

The proxy adds no protocol of its own (see :mod:`kvmux.proxy.handoff`), so it
works in front of any vLLM KV connector that follows vLLM's P/D convention.
Configured ``colocated``, it has no prefill stage and sends each request whole
to the next server: the same front end for colocated serving, so the two can
be compared with nothing else changed (``kvmux bench serve`` does).
It must never be the reason a client hangs or waits longer than it has to:

* every client request has one deadline (``timeout_s``) shared by its prefill
  and decode calls; past it the client gets 504, naming the upstream;
* each call goes to the least loaded healthy upstream of its role
  (:mod:`kvmux.proxy.upstreams`), preferring one that already holds the
  prompt's prefix (:mod:`kvmux.proxy.prefix`);
* an upstream that cannot be reached (refused, or its host silent for
  ``unreachable_after_s``: :mod:`kvmux.proxy.liveness`) is taken out of rotation and its
  ``/health`` probed every ``probe_interval_s`` until it answers; a request
  that could not connect to it (or whose prefill it dropped) is tried on
  another one of the role, and only when none is left the client gets 502
  naming it, then 503 naming the role while none is healthy; an upstream that
  answers with an error has its status and body passed through unchanged;
* the answer says which servers served it (``X-Kvmux-Prefill``,
  ``X-Kvmux-Decode``), and ``GET /stats`` shows each upstream's state;
* a streamed answer is relayed chunk by chunk as decode produces it, never
  buffered;
* a client that goes away, streamed or not, takes its upstream request with
  it: the proxy closes that connection (which is how vLLM's server notices and
  aborts the request) and never starts decode for a client that has gone.

The last point needs aiohttp to cancel a handler whose client disconnects
(``handler_cancellation=True`` on the runner, which
:func:`kvmux.proxy.running_app` sets): otherwise a handler cannot notice
while it awaits a whole, non-streamed answer. Without it the proxy still
checks before each upstream request that its client is there.

One ``aiohttp.ClientSession`` (one connection pool) serves the whole app; it
is opened when the app starts and closed when it is cleaned up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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
from kvmux.proxy.liveness import never_connected, silent_host_detecting
from kvmux.proxy.prefix import PrefixRoutes
from kvmux.proxy.upstreams import NoHealthyUpstream, Role, Upstream, UpstreamPool

log = logging.getLogger("kvmux.proxy")

PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REQUEST_ID = "X-Request-Id"
#: Client headers passed on to both upstreams (with X-Request-Id); the rest describe
#: the hop to the proxy, not the request.
FORWARDED_HEADERS = ("Authorization",)
#: Response headers naming the upstreams that served a request.
SERVED_BY: dict[Role, str] = {"prefill": "X-Kvmux-Prefill", "decode": "X-Kvmux-Decode"}

_T = TypeVar("_T")


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """An OpenAI-style error, the shape vLLM and its clients expect."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(
    status: int, message: str, kind: str, request_id: str | None = None
) -> web.Response:
    headers = {REQUEST_ID: request_id} if request_id else None
    return web.json_response(error_body(status, message, kind), status=status, headers=headers)


class _Answer(Exception):
    """Ends a hand-off early with the response the client gets, unless ``retry`` says
    the same call may go to another upstream (this one was never really asked)."""

    def __init__(self, response: web.Response, *, retry: bool = False) -> None:
        super().__init__(response.status)
        self.response = response
        self.retry = retry


@dataclass
class _Route:
    """The upstreams one client request has used so far, by role."""

    prefill: Upstream | None = None
    decode: Upstream | None = None

    def use(self, upstream: Upstream) -> None:
        setattr(self, upstream.role, upstream)

    @property
    def stage(self) -> Upstream | None:
        return self.decode or self.prefill

    def headers(self) -> dict[str, str]:
        used = (self.prefill, self.decode)
        return {SERVED_BY[u.role]: u.url for u in used if u is not None}


class Proxy:
    """The request handlers and what they share: the config, the pools, the session."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        #: None when colocated: no prefill stage, requests go whole to ``decode``'s servers.
        self.prefill = UpstreamPool("prefill", config.prefill) if config.prefill else None
        self.decode = UpstreamPool("decode", config.decode)
        self.prefixes = PrefixRoutes(config.prefix_routes) if config.prefix_routes else None
        self._session: aiohttp.ClientSession | None = None
        self._warned_no_params = False

    # -- lifecycle -----------------------------------------------------------------

    async def client_session(self, app: web.Application) -> AsyncIterator[None]:
        """``cleanup_ctx`` hook: the app's one ClientSession lives as long as the app, and
        so does the task that probes upstreams out of rotation."""
        # No pool limit: vLLM queues requests itself, and a proxy-side cap would
        # make long streams starve short requests without the client knowing why.
        # Idle connections are dropped before the upstream drops them: aiohttp keeps
        # them 15 s, vLLM closes them after 5, and a request sent as it closes one
        # fails (4 of 40 sent 0.95-1.04 s apart to a uvicorn closing them at 1 s).
        connector = aiohttp.TCPConnector(
            limit=0,
            keepalive_timeout=self.config.upstream_keepalive_s,
            socket_factory=silent_host_detecting(self.config.unreachable_after_s),
        )
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            self._session = session
            probes = asyncio.create_task(self._probe_out_of_rotation(), name="kvmux-probes")
            try:
                yield
            finally:
                probes.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probes
                self._session = None

    @property
    def pools(self) -> tuple[UpstreamPool, ...]:
        """The pools in the order a request uses them (no prefill pool when colocated)."""
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)

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
        """Any decode server serves the same model(s); ask the least loaded one."""
        request_id = _request_id_of(request)
        headers = self._headers(request, request_id)
        deadline = self._deadline()
        route = _Route()
        try:
            return await self._call(
                self.decode,
                request,
                route,
                [],
                lambda u: self._exchange("GET", u, "/v1/models", None, headers, deadline),
            )
        except _Answer as answer:
            return answer.response

    async def health(self, request: web.Request) -> web.Response:
        """200 when every upstream's ``/health`` answers 2xx, else 503 naming the others.

        Each check also updates the pools: a failing upstream is taken out, a
        passing one is put back, so routing follows what ``/health`` just saw.
        """
        upstreams = [u for pool in self.pools for u in pool.all()]
        problems = await asyncio.gather(*(self._probe(u) for u in upstreams))
        report = [
            {
                "ok": problem is None,
                "detail": problem or "ok",
                **self._pool(u.role).state(u).report(),
            }
            for u, problem in zip(upstreams, problems, strict=True)
        ]
        failed = [f"{u} ({p})" for u, p in zip(upstreams, problems, strict=True) if p]
        body: dict[str, Any] = {"status": "unhealthy" if failed else "ok", "upstreams": report}
        if failed:
            message = "unhealthy: " + "; ".join(failed)
            body.update(error_body(503, message, "upstream_unhealthy"))
        return web.json_response(body, status=503 if failed else 200)

    async def stats(self, request: web.Request) -> web.Response:
        """Each upstream as the proxy sees it now (in rotation, in flight, sent, taken out),
        without asking any of them."""
        return web.json_response(
            {
                "prefill": self.prefill.report() if self.prefill is not None else None,
                "decode": self.decode.report(),
                "prefix_routes": len(self.prefixes) if self.prefixes is not None else None,
            }
        )

    # -- the hand-off --------------------------------------------------------------

    async def _handoff(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        request_id = _request_id_of(request)
        try:
            body = parse_client_body(await request.read())
        except BadClientRequest as exc:
            return error_response(400, str(exc), "invalid_request_error", request_id)
        deadline = self._deadline()
        headers = self._headers(request, request_id)
        path = PATHS[endpoint]
        keys = self.prefixes.keys(path, body) if self.prefixes is not None else []
        route = _Route()
        to_prefill = prefill_body(body)
        try:
            self._check_pools(request_id)  # no prefill for a request no decode can take
            out = body
            if self.prefill is not None:
                payload = await self._call(
                    self.prefill,
                    request,
                    route,
                    keys,
                    lambda u: self._exchange("POST", u, path, to_prefill, headers, deadline),
                )
                params = kv_params_from(_json_or_none(payload.body))
                if params is None and route.prefill is not None:
                    self._warn_no_params(route.prefill)
                out = decode_body(body, endpoint, params)
            answer: web.StreamResponse
            if wants_stream(body):
                answer = await self._call(
                    self.decode,
                    request,
                    route,
                    keys,
                    lambda u: self._relay_stream(request, u, path, out, headers, deadline, route),
                )
            else:
                answer = await self._call(
                    self.decode,
                    request,
                    route,
                    keys,
                    lambda u: self._exchange("POST", u, path, out, headers, deadline),
                )
        except _Answer as failed:
            failed.response.headers.update(route.headers())
            return failed.response
        except asyncio.CancelledError:
            # aiohttp cancels the handler when its client disconnects (or the proxy stops);
            # unwinding closes the upstream connection, and vLLM aborts the request.
            log.info("request %s cancelled: its request to %s was closed", request_id, route.stage)
            raise
        if not answer.prepared:
            answer.headers.update(route.headers())
        return answer

    async def _call(
        self,
        pool: UpstreamPool,
        request: web.Request,
        route: _Route,
        keys: list[bytes],
        call: Callable[[Upstream], Awaitable[_T]],
    ) -> _T:
        """``call`` on the least loaded healthy upstream of ``pool`` (the prefix's holder
        if it is not much busier), counted in flight there while it runs.

        An upstream that could not be used and was never really asked (see
        :meth:`_unusable`) is set aside and the next one tried; the last one's
        failure is the client's answer, and a pool with none healthy a 503.
        """
        request_id = _request_id_of(request)
        prefer = self.prefixes.holder(keys, pool.role) if self.prefixes and keys else None
        failed: list[str] = []
        while True:
            try:
                with pool.acquire(prefer, failed) as upstream:
                    route.use(upstream)
                    _ensure_client(request, upstream, request_id)
                    result = await call(upstream)
            except NoHealthyUpstream as exc:
                raise self._none_healthy(exc, request_id) from None
            except _Answer as answer:
                failed.append(upstream.url)
                if not (answer.retry and pool.any_in_rotation(failed)):
                    raise
                log.info("request %s: %s could not be used; trying another", request_id, upstream)
                continue
            if self.prefixes is not None and keys:
                self.prefixes.record(keys, pool.role, upstream.url)
            return result

    async def _exchange(
        self,
        method: str,
        upstream: Upstream,
        path: str,
        body: Mapping[str, Any] | None,
        headers: Mapping[str, str],
        deadline: float,
    ) -> web.Response:
        """One whole request/response with an upstream. A 2xx is returned; anything
        else raises :class:`_Answer` with what the client should get."""
        request_id = headers[REQUEST_ID]
        try:
            timeout = self._timeout(upstream, deadline, request_id)
            async with self.session.request(
                method, upstream.url + path, json=body, headers=headers, timeout=timeout
            ) as resp:
                relayed = _relay(resp.status, resp.headers, await resp.read(), request_id)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._unusable(upstream, exc, request_id) from None
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
        route: _Route,
    ) -> web.StreamResponse:
        """Decode's server-sent events, passed on as each chunk arrives."""
        request_id = headers[REQUEST_ID]
        timeout = self._timeout(upstream, deadline, request_id)
        try:
            resp = await self.session.post(
                upstream.url + path, json=body, headers=headers, timeout=timeout
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._unusable(upstream, exc, request_id) from None
        try:
            if not 200 <= resp.status < 300:
                try:
                    payload = await resp.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise self._unusable(upstream, exc, request_id) from None
                raise _Answer(_relay(resp.status, resp.headers, payload, request_id))
            out = web.StreamResponse(
                status=resp.status,
                headers={
                    "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                    "Cache-Control": "no-cache",
                    REQUEST_ID: request_id,
                    **route.headers(),
                },
            )
            await out.prepare(request)
            while True:
                try:
                    chunk = await resp.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # Headers are sent: report in-band, the way vLLM reports stream errors.
                    self._take_out_if_broken(upstream, exc)
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
                    resp.close()  # closing the connection is what makes vLLM abort
                    return out
            with contextlib.suppress(ConnectionResetError):  # client left after [DONE]
                await out.write_eof()
            return out
        finally:
            # A stream not read to its end (client gone, handler cancelled) is closed,
            # not pooled: release() closes any connection whose response is unfinished.
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
        return aiohttp.ClientTimeout(total=left, sock_connect=self.config.unreachable_after_s)

    @staticmethod
    def _headers(request: web.Request, request_id: str) -> dict[str, str]:
        headers = {
            name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers
        }
        headers[REQUEST_ID] = request_id  # the same id on both engines ties their logs
        return headers

    def _check_pools(self, request_id: str) -> None:
        for pool in self.pools:
            try:
                pool.check_any()
            except NoHealthyUpstream as exc:
                raise self._none_healthy(exc, request_id) from None

    def _none_healthy(self, exc: NoHealthyUpstream, request_id: str) -> _Answer:
        message = f"{exc}; probing their /health every {self.config.probe_interval_s:g} s"
        return _Answer(error_response(503, message, "no_healthy_upstream", request_id))

    def _pool(self, role: Role) -> UpstreamPool:
        if role == "prefill":
            assert self.prefill is not None, "a colocated proxy has no prefill upstreams"
            return self.prefill
        return self.decode

    def _unusable(self, upstream: Upstream, exc: BaseException, request_id: str) -> _Answer:
        """The answer for a call to ``upstream`` that failed with ``exc``. It may go to
        another upstream when this one was never really asked: it could not be connected
        to, or it is a prefill (which only computes KV nobody else will read) whose
        connection broke."""
        broken = self._take_out_if_broken(upstream, exc)
        retry = broken and (upstream.role == "prefill" or never_connected(exc))
        return _Answer(_upstream_failed(upstream, exc, request_id), retry=retry)

    def _take_out_if_broken(self, upstream: Upstream, exc: BaseException) -> bool:
        """Take ``upstream`` out of rotation if ``exc`` says its connection failed
        (refused, reset, dropped mid-answer, its host silent: see
        :mod:`kvmux.proxy.liveness`); whether it did. Waiting long for an answer is not
        that: a long prompt is slow, not dead (its ``/health`` decides, see :meth:`health`)."""
        slow = isinstance(exc, TimeoutError) and not never_connected(exc)
        if slow or not isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError):
            return False
        self._pool(upstream.role).take_out(upstream, str(exc) or type(exc).__name__)
        return True

    async def _probe_out_of_rotation(self) -> None:
        """Every ``probe_interval_s``: put back the upstreams out of rotation that answer."""
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            down = [u for pool in self.pools for u in pool.out_of_rotation()]
            await asyncio.gather(*(self._probe(u) for u in down))

    async def _probe(self, upstream: Upstream) -> str | None:
        """:meth:`_check` ``upstream`` and put it in or out of rotation accordingly."""
        problem = await self._check(upstream)
        pool = self._pool(upstream.role)
        if problem is None:
            pool.put_back(upstream)
        else:
            pool.take_out(upstream, f"/health: {problem}")
        return problem

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
    """The proxy as an aiohttp application: serve it with :func:`kvmux.proxy.running`, or
    with a runner given ``handler_cancellation=True`` (see the module doc)."""
    proxy = Proxy(config)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[PROXY_KEY] = proxy
    app.cleanup_ctx.append(proxy.client_session)
    app.router.add_post(PATHS["completions"], proxy.completions)
    app.router.add_post(PATHS["chat"], proxy.chat_completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/stats", proxy.stats)
    return app


def build_app(
    prefill: Sequence[str], decode: Sequence[str], timeout_s: float = 600.0
) -> web.Application:
    """:func:`create_app` from upstream URLs (validated: http(s), at least one of each)."""
    return create_app(ProxyConfig(prefill=list(prefill), decode=list(decode), timeout_s=timeout_s))


def _request_id_of(request: web.Request) -> str:
    """The client's ``X-Request-Id``, or one made up once for this request."""
    request_id = request.get(_REQUEST_ID_KEY)
    if request_id is None:
        request_id = request.headers.get(REQUEST_ID) or f"kvmux-{uuid.uuid4().hex}"
        request[_REQUEST_ID_KEY] = request_id
    return request_id


_REQUEST_ID_KEY = web.RequestKey("kvmux_request_id", str)


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


#: nginx's "client closed request": what the access log shows; nobody reads the body.
CLIENT_CLOSED = 499


def _ensure_client(request: web.Request, upstream: Upstream, request_id: str) -> None:
    """Raise :class:`_Answer` if the client has gone: ``upstream`` is then never asked."""
    transport = request.transport
    if transport is not None and not transport.is_closing():
        return
    log.info("request %s: client went away; %s not asked", request_id, upstream)
    message = f"client closed the request before {upstream} was asked"
    raise _Answer(error_response(CLIENT_CLOSED, message, "client_closed_request", request_id))


async def _write(out: web.StreamResponse, chunk: bytes) -> bool:
    """Send ``chunk`` to the client; False when the client has gone away."""
    try:
        await out.write(chunk)
    except ConnectionResetError:
        return False
    return True
