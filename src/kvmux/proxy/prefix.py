"""Where the proxy last sent a prompt prefix: a bounded LRU, so a repeat goes back there.

A prefill server that computed a prompt keeps its KV in vLLM's prefix cache
(and in kvmux's store); a decode server that loaded it keeps it too. A later
request that starts with the same prefix (a follow-up turn, a shared system
prompt) is cheaper on those servers: prefill computes only the new tail, and
decode loads only the part it does not hold. So :class:`PrefixRoutes`
remembers, per role, which upstream each prefix went to, and the pools prefer
that upstream unless it is clearly busier than the others.

What it keys on, honestly: the request *as the client sent it*, not tokens.
The proxy sees token ids only when the client sends them; for a text prompt
or chat messages it has text, and tokenising it (or computing kvmux's chained
block keys, which need token ids *and* the model's kvmux namespace: model,
dtypes, block size) would mean a tokenizer and a model config in the proxy,
or a lookup round trip to every server per request. Instead the prompt is cut
into fixed chunks (``chunk_tokens`` token ids, or ``chunk_chars`` characters
of a text prompt or of the messages' JSON) and each chunk's hash is chained to
the previous one, salted by endpoint and model, so a key stands for the whole
prefix up to it. Only whole chunks count. This is a memory of where the proxy
sent things, not of what the servers still hold: an entry for a prefix a server
has since evicted costs an ordinary miss there, nothing more.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from kvmux.proxy.upstreams import Role


class PrefixRoutes:
    """Chained prompt-prefix hashes -> the upstream of each role they last went to."""

    def __init__(self, capacity: int, chunk_tokens: int = 64, chunk_chars: int = 256) -> None:
        if capacity < 1 or chunk_tokens < 1 or chunk_chars < 1:
            raise ValueError(
                f"capacity, chunk_tokens and chunk_chars must be >= 1, "
                f"got {capacity}, {chunk_tokens}, {chunk_chars}"
            )
        self.capacity = capacity
        self.chunk_tokens = chunk_tokens
        self.chunk_chars = chunk_chars
        self._routes: OrderedDict[bytes, dict[Role, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._routes)

    def keys(self, path: str, body: Mapping[str, Any]) -> list[bytes]:
        """The chained keys of the request's whole chunks, shortest prefix first; none for
        a request without one prompt (a batch of prompts, a body with neither field)."""
        return list(self._chain(path, body))

    def holder(self, keys: list[bytes], role: Role) -> str | None:
        """The upstream of ``role`` that the longest known prefix went to."""
        for key in reversed(keys):
            routes = self._routes.get(key)
            if routes is not None and role in routes:
                self._routes.move_to_end(key)
                return routes[role]
        return None

    def record(self, keys: list[bytes], role: Role, url: str) -> None:
        """``url`` now holds every prefix in ``keys``; the oldest entries go past capacity."""
        for key in keys:
            self._routes.setdefault(key, {})[role] = url
            self._routes.move_to_end(key)
        while len(self._routes) > self.capacity:
            self._routes.popitem(last=False)

    def _chain(self, path: str, body: Mapping[str, Any]) -> Iterator[bytes]:
        chunks = self._chunks(body)
        if chunks is None:
            return
        digest = hashlib.blake2b(
            json.dumps([path, body.get("model")]).encode(), digest_size=16
        ).digest()
        for chunk in chunks:
            digest = hashlib.blake2b(digest + chunk, digest_size=16).digest()
            yield digest

    def _chunks(self, body: Mapping[str, Any]) -> list[bytes] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            n = self.chunk_tokens
            whole = len(prompt) // n
            return [json.dumps(prompt[i * n : (i + 1) * n]).encode() for i in range(whole)]
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(body.get("messages"), list) and "prompt" not in body:
            text = json.dumps(body["messages"], sort_keys=True, separators=(",", ":"))
        else:
            return None
        n = self.chunk_chars
        raw = [text[i * n : (i + 1) * n] for i in range(len(text) // n)]
        return [part.encode() for part in raw]
