"""``kvmux proxy``: an OpenAI-compatible prefill/decode proxy in front of vLLM servers.

A client sends an ordinary ``/v1/completions`` or ``/v1/chat/completions``
request; the proxy runs it as a one-token prefill on one server, then hands
the prefill's ``kv_transfer_params`` to a decode server that loads the KV cache
and produces the answer (streamed or not, as the client asked). It follows
vLLM's P/D convention only, so it fronts any KV connector that does (kvmux's
vLLM adapter, vLLM's ``NixlConnector``).

Modules: :mod:`~kvmux.proxy.config` (validated settings),
:mod:`~kvmux.proxy.upstreams` (pools: least loaded healthy upstream first),
:mod:`~kvmux.proxy.prefix` (where a prompt prefix was last sent),
:mod:`~kvmux.proxy.handoff` (the prefill and decode request bodies),
:mod:`~kvmux.proxy.app` (the aiohttp handlers), :mod:`~kvmux.proxy.server`
(serving it). Needs ``aiohttp`` (``pip install 'kvmux[proxy]'``).
"""

from __future__ import annotations

from kvmux.proxy.app import PROXY_KEY, Proxy, build_app, create_app
from kvmux.proxy.config import ProxyConfig, ProxyConfigError, config_from_flags
from kvmux.proxy.handoff import PREFILL_KV_TRANSFER_PARAMS, decode_body, prefill_body
from kvmux.proxy.prefix import PrefixRoutes
from kvmux.proxy.server import ListenError, base_url, running, running_app, serve
from kvmux.proxy.upstreams import NoHealthyUpstream, Upstream, UpstreamPool

__all__ = [
    "PREFILL_KV_TRANSFER_PARAMS",
    "PROXY_KEY",
    "ListenError",
    "NoHealthyUpstream",
    "PrefixRoutes",
    "Proxy",
    "ProxyConfig",
    "ProxyConfigError",
    "Upstream",
    "UpstreamPool",
    "base_url",
    "build_app",
    "config_from_flags",
    "create_app",
    "decode_body",
    "prefill_body",
    "running",
    "running_app",
    "serve",
]
