"""Running the proxy: in-process for tests and demos, or until a signal for the CLI.

``port=0`` lets the OS pick a free port; the URL handed back (and printed by
``kvmux proxy``) carries the port actually bound, so callers never race for
a port they guessed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from kvmux.errors import KvmuxError
from kvmux.proxy.app import create_app
from kvmux.proxy.config import ProxyConfig


class ListenError(KvmuxError, OSError):
    """The proxy could not bind its host and port (in use, not an address of this host)."""


def base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@asynccontextmanager
async def running_app(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` for the ``async with`` block; yields its base URL.

    Any aiohttp app works (the tests serve their fake vLLM servers with it).
    A handler whose client disconnects is cancelled (``handler_cancellation``),
    as vLLM's own server does: for the proxy this closes the upstream request,
    which makes vLLM abort it. On exit the app is cleaned up, which closes the
    proxy's ClientSession.
    """
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ListenError(f"cannot listen on {base_url(host, port)}: {exc}") from exc
        yield base_url(host, runner.addresses[0][1])
    finally:
        await runner.cleanup()


@asynccontextmanager
async def running(config: ProxyConfig) -> AsyncIterator[str]:
    """The proxy for ``config``, served for the ``async with`` block; yields its base URL."""
    async with running_app(create_app(config), config.host, config.port) as url:
        yield url


def serve(config: ProxyConfig, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then close cleanly. ``on_ready(url)`` runs once
    the port is bound (``kvmux proxy`` prints its "listening" line there)."""
    asyncio.run(_serve(config, on_ready))


async def _serve(config: ProxyConfig, on_ready: Callable[[str], None] | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
    async with running(config) as url:
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
