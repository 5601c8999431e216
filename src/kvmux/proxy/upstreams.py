"""Pools of upstream vLLM servers: the least loaded healthy one, taken out when it breaks.

Prefill and decode each get their own pool: the two roles scale independently
(often more prefill than decode servers, or the reverse), so which decode
server a request lands on must not depend on which prefill server it used.

Choice is by load, not in blind turns: a request goes to the upstream with the
fewest requests the proxy has in flight there (a long stream on one decode
server sends the next requests to the others). Equal loads are broken in turn,
so sequential requests still spread over every server. The count is the
proxy's own, per upstream, and is kept right on every way out of a request
(answer, error, client gone, cancellation) by :meth:`UpstreamPool.acquire`.

An upstream that cannot be reached (connection refused or broken) is taken out
of rotation; :mod:`kvmux.proxy.app` probes its ``/health`` in the background
and puts it back once it answers. An upstream that *answers* with an error
(a 4xx from vLLM, say) is alive and stays in. Errors name the role and URL,
so a 502 or 503 says which server to look at.

The proxy runs on one event loop and nothing here awaits, so no lock is needed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvmux.errors import KvmuxError

Role = Literal["prefill", "decode"]

log = logging.getLogger("kvmux.proxy")


@dataclass(frozen=True)
class Upstream:
    """One vLLM server and the part it plays."""

    role: Role
    url: str

    def __str__(self) -> str:
        return f"{self.role} upstream {self.url}"


class NoHealthyUpstream(KvmuxError, RuntimeError):
    """Every upstream of a role is out of rotation (answered with 503, naming them)."""


@dataclass
class UpstreamState:
    """What the pool knows of one upstream."""

    upstream: Upstream
    in_rotation: bool = True
    #: Requests the proxy has open with it right now.
    in_flight: int = 0
    #: Requests sent to it since the proxy started.
    sent: int = 0
    #: Times it was taken out of rotation.
    taken_out: int = 0
    #: Why it was last taken out (kept after it is back, for the report).
    last_problem: str | None = None

    def report(self) -> dict[str, Any]:
        return {
            "role": self.upstream.role,
            "url": self.upstream.url,
            "in_rotation": self.in_rotation,
            "in_flight": self.in_flight,
            "sent": self.sent,
            "taken_out": self.taken_out,
            "last_problem": self.last_problem,
        }


class UpstreamPool:
    """The servers of one role; :meth:`acquire` hands out the least loaded healthy one."""

    def __init__(self, role: Role, urls: Sequence[str], prefer_slack: int = 1) -> None:
        if not urls:
            raise ValueError(f"no {role} upstreams")
        if len(set(urls)) != len(urls):
            raise ValueError(f"{role} upstreams are listed more than once: {list(urls)}")
        self.role = role
        #: How many more requests in flight a preferred upstream may have than the least loaded.
        self.prefer_slack = prefer_slack
        self._states = [UpstreamState(Upstream(role, url)) for url in urls]
        self._turn = 0  # where the next tie-break starts

    def all(self) -> list[Upstream]:
        return [state.upstream for state in self._states]

    def state(self, upstream: Upstream) -> UpstreamState:
        for state in self._states:
            if state.upstream == upstream:
                return state
        raise KeyError(f"{upstream} is not in the {self.role} pool")

    def report(self) -> list[dict[str, Any]]:
        return [state.report() for state in self._states]

    def out_of_rotation(self) -> list[Upstream]:
        return [s.upstream for s in self._states if not s.in_rotation]

    def any_in_rotation(self, exclude: Collection[str] = ()) -> bool:
        """Whether an upstream in rotation is left once the URLs in ``exclude`` are set aside."""
        return any(s.in_rotation and s.upstream.url not in exclude for s in self._states)

    def check_any(self) -> None:
        """Raise :class:`NoHealthyUpstream` when every upstream is out of rotation."""
        if not self.any_in_rotation():
            raise NoHealthyUpstream(self._none_left(()))

    def choose(self, prefer: str | None = None, exclude: Collection[str] = ()) -> Upstream:
        """The upstream in rotation with the fewest requests in flight (ties in turn).

        ``prefer`` (a URL) wins when it is in rotation and no busier than the
        least loaded one plus ``prefer_slack`` (it already holds the
        request's prefix, which is worth a little queueing, not a lot).
        ``exclude`` are URLs this request has already failed on. Raises
        :class:`NoHealthyUpstream` when nothing is left.
        """
        n = len(self._states)
        ordered = [self._states[(self._turn + i) % n] for i in range(n)]
        candidates = [s for s in ordered if s.in_rotation and s.upstream.url not in exclude]
        if not candidates:
            raise NoHealthyUpstream(self._none_left(exclude))
        chosen = min(candidates, key=lambda s: s.in_flight)  # the first of equals: in turn
        if prefer is not None:
            for s in candidates:
                if s.upstream.url == prefer and s.in_flight <= chosen.in_flight + self.prefer_slack:
                    chosen = s
        self._turn = (self._states.index(chosen) + 1) % n
        return chosen.upstream

    @contextlib.contextmanager
    def acquire(
        self, prefer: str | None = None, exclude: Collection[str] = ()
    ) -> Iterator[Upstream]:
        """:meth:`choose` one and count a request in flight there for the ``with`` block.

        The count is taken back in ``finally``: however the block ends (an answer,
        an error, a client that left, a cancelled handler) it returns to what it was.
        """
        state = self.state(self.choose(prefer, exclude))
        state.in_flight += 1
        state.sent += 1
        try:
            yield state.upstream
        finally:
            state.in_flight -= 1

    def take_out(self, upstream: Upstream, problem: str) -> None:
        """Stop choosing ``upstream`` until :meth:`put_back`; logged once per outage."""
        state = self.state(upstream)
        state.last_problem = problem
        if not state.in_rotation:
            return
        state.in_rotation = False
        state.taken_out += 1
        log.warning("%s taken out of rotation: %s", upstream, problem)

    def put_back(self, upstream: Upstream) -> None:
        state = self.state(upstream)
        if state.in_rotation:
            return
        state.in_rotation = True
        log.warning("%s is healthy again and back in rotation", upstream)

    def _none_left(self, exclude: Collection[str]) -> str:
        out = [s for s in self._states if not s.in_rotation]
        why = "; ".join(f"{s.upstream.url} ({s.last_problem})" for s in out)
        failed = [url for url in exclude if all(s.upstream.url != url for s in out)]
        if failed:
            why = "; ".join(filter(None, [why, "failed for this request: " + ", ".join(failed)]))
        return f"no healthy {self.role} upstream: {why}"
