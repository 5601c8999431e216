"""The two requests one client request becomes, following vLLM's P/D convention.

vLLM's disaggregated serving has no proxy protocol of its own; the KV
connectors (vLLM's ``NixlConnector``, kvmux's adapter) agree on a convention
carried in the request field ``kv_transfer_params``:

* the prefill server gets the client's request cut to one token with
  ``do_remote_decode: true``, so it computes the prompt's KV cache, keeps it
  for a remote reader, and answers with the ``kv_transfer_params`` a decoder
  needs to fetch it (engine id, block ids, host, port ...);
* the decode server gets the client's original request plus those params, so
  it loads the KV cache instead of recomputing it and generates the answer.

Everything here is pure: dicts in, dicts out, so the convention can be tested
without a server and stays in one place.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]

#: What the prefill server is told: "a remote engine will decode this request".
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class BadClientRequest(ValueError):
    """A client body the proxy cannot split into prefill and decode (answered with 400)."""


def parse_client_body(raw: bytes) -> dict[str, Any]:
    """The client's JSON object; the fields the proxy itself relies on are checked here,
    everything else is left for vLLM to validate (it answers 400 through the proxy)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadClientRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadClientRequest(f"request body must be a JSON object, not {type(body).__name__}")
    if not isinstance(body.get("stream", False), bool):
        raise BadClientRequest(f"'stream' must be true or false, not {body['stream']!r}")
    return body


def wants_stream(body: Mapping[str, Any]) -> bool:
    return body.get("stream") is True


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's request cut to one token and marked for remote decode.

    Streaming, ``n`` and ``min_tokens`` would only make prefill produce (or be
    refused for) output nobody reads: the answer comes from decode.
    """
    out = copy.deepcopy(dict(body))
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def kv_params_from(prefill_response: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a prefill response carries; None when the prefill
    engine has no KV connector (then decode recomputes the prompt)."""
    if not isinstance(prefill_response, dict):
        return None
    params = prefill_response.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


def prompt_token_ids(params: Mapping[str, Any] | None) -> list[int] | None:
    """The prompt as prefill tokenised it, when its connector returns it (kvmux's does)."""
    ids = (params or {}).get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
        return ids
    return None


def decode_body(
    body: Mapping[str, Any], endpoint: Endpoint, params: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The client's original request plus what prefill handed over.

    For ``/v1/completions`` with one string prompt, the prompt becomes the token
    ids prefill used: decode then skips tokenising and is certain to see the
    same tokens whose KV cache it loads. Chat keeps its messages (the chat
    template is applied by decode itself).
    """
    out = copy.deepcopy(dict(body))
    if params is None:
        out.pop("kv_transfer_params", None)
        return out
    out["kv_transfer_params"] = copy.deepcopy(dict(params))
    ids = prompt_token_ids(params)
    if endpoint == "completions" and isinstance(out.get("prompt"), str) and ids is not None:
        out["prompt"] = ids
    return out
