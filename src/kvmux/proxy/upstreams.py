"""Round-robin pools of upstream vLLM servers.

Prefill and decode each get their own pool with its own counter: the two
roles scale independently (often more prefill than decode servers, or the
reverse), so which decode server a request lands on must not depend on which
prefill server it used. Errors name the role and URL, so a 502 says which
server to look at.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

#: ``colocated``: a server that prefills and decodes whole requests (no P/D hand-off).
Role = Literal["prefill", "decode", "colocated"]


@dataclass(frozen=True)
class Upstream:
    """One vLLM server and the part it plays."""

    role: Role
    url: str

    def __str__(self) -> str:
        return f"{self.role} upstream {self.url}"


@dataclass
class UpstreamPool:
    """The servers of one role, handed out in turn.

    The proxy runs on one event loop, so ``next()`` needs no lock.
    """

    role: Role
    urls: Sequence[str]
    _turns: itertools.cycle[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(f"no {self.role} upstreams")
        self.urls = tuple(self.urls)
        self._turns = itertools.cycle(self.urls)

    def next(self) -> Upstream:
        return Upstream(self.role, next(self._turns))

    def all(self) -> list[Upstream]:
        return [Upstream(self.role, url) for url in self.urls]
