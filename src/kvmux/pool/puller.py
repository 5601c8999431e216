"""Puller: the consumer's half of a served pool, the same for every transport.

Remote lookups ask the peer for the prefix it holds; a remote load goes batch
by batch over one cached link, each batch one ``transport.pull``; lease
notices (renew, release) go in the background. Failures become per-key
outcomes (and a dropped link) here, once, whatever the transport.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from kvmux.errors import ClosedError, KvmuxError, PeerRestartedError
from kvmux.handle import Outcome, failed
from kvmux.keys import BlockKey
from kvmux.lanes import Lanes
from kvmux.net.client import Link, PeerClient
from kvmux.net.messages import (
    MAX_LEASES_PER_NOTICE,
    LeaseReply,
    LookupReply,
    LookupRequest,
    Release,
    Renew,
    expect,
    key_batches,
)
from kvmux.pool.peer import PeerAddress, PullInterrupted
from kvmux.pool.transport import PullTransport
from kvmux.stats import Stats

log = logging.getLogger(__name__)

T = TypeVar("T")


class Puller:
    """Pulls from peers over ``client`` with ``transport``; counts what it survived in
    ``counters`` and sends notices on ``lanes``."""

    def __init__(
        self,
        transport: PullTransport,
        client: PeerClient,
        *,
        timeout_s: float,
        counters: Stats,
        lanes: Lanes,
    ) -> None:
        self._transport = transport
        self._client = client
        self._timeout_s = timeout_s
        self._counters = counters
        self._lanes = lanes

    def lookup(self, peer: PeerAddress, keys: list[BlockKey]) -> int:
        """How many leading ``keys`` the peer holds; 0 (logged, counted) if it cannot say."""
        try:
            self._transport.check_peer(peer)
            deadline = time.monotonic() + self._timeout_s
            return self._call(peer, deadline, lambda link: _ask_prefix(link, keys, deadline))
        except KvmuxError as exc:
            self._counters.add("lookup_errors")
            log.warning(
                "kvmux %s: lookup at %s:%s failed: %s",
                self._transport.service,
                *peer.endpoint,
                exc,
            )
            self._forget(peer, exc)
        return 0

    def load(
        self, peer: PeerAddress, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]:
        """Pull batch by batch over one link; once a batch fails, the rest fail with it."""
        self._transport.check_peer(peer)
        outcomes: list[Outcome] = []

        def exchange(link: Link) -> None:
            for batch in key_batches(keys, link.header_budget):
                outcomes.extend(
                    self._transport.pull(
                        link,
                        keys[batch.start : batch.stop],
                        block_ids[batch.start : batch.stop],
                        deadline,
                    )
                )

        try:
            self._call(peer, deadline, exchange)
        except KvmuxError as exc:
            self._forget(peer, exc)
            if isinstance(exc, PullInterrupted):
                outcomes.extend(exc.outcomes)
            reason = f"{type(exc).__name__}: pulling from {peer.host}:{peer.port}: {exc}"
            outcomes.extend([failed(reason)] * (len(keys) - len(outcomes)))
        return outcomes

    def notify(self, peer: PeerAddress, notice: type[Renew | Release], leases: list[str]) -> None:
        """Send ``notice`` messages for ``leases`` to ``peer`` in the background, on a
        lane of their own one thread wide: in order, behind no load, never in the
        caller's way. Each is answered (so a stale cached link is noticed and the
        notice resent on a fresh one, see ``PeerClient.call``). A peer that cannot
        be told is logged and counted; its leases then end at their own time."""
        step = MAX_LEASES_PER_NOTICE
        notices = [notice(leases=leases[i : i + step]) for i in range(0, len(leases), step)]
        deadline = time.monotonic() + self._timeout_s

        def send(link: Link) -> None:
            for msg in notices:
                link.channel.send(msg, deadline=deadline)
                expect(link.channel.recv(deadline), LeaseReply)

        def tell() -> None:
            try:
                self._transport.check_peer(peer)
                self._call(peer, deadline, send)
            except KvmuxError as exc:
                self._counters.add("lease_notice_errors")
                log.info(
                    "kvmux %s: could not send %s for %d publication(s) to %s:%s: %s",
                    self._transport.service,
                    notice.model_fields["kind"].default,
                    len(leases),
                    *peer.endpoint,
                    exc,
                )

        with contextlib.suppress(ClosedError):  # closing: the leases end at their time
            self._lanes.submit(("notices", peer.endpoint), tell, 1)

    def _call(self, peer: PeerAddress, deadline: float, exchange: Callable[[Link], T]) -> T:
        """``exchange`` on a link to ``peer`` (of the incarnation it names); over its
        Unix socket where it has one and the transport's peers share this host."""
        unix = peer.unix if self._transport.same_host else None
        return self._client.call(
            peer.endpoint, deadline, exchange, incarnation=peer.incarnation, unix=unix
        )

    def _forget(self, peer: PeerAddress, cause: KvmuxError) -> None:
        """Drop what is cached for a peer that failed. Not for a restarted one: the
        links and agents it has now are good, and the handshake dropped the old ones."""
        if isinstance(cause, PeerRestartedError):
            return
        self._client.forget(peer.endpoint)
        self._transport.forget_peer(peer.endpoint)

    def close(self) -> None:
        self._client.close()


def _ask_prefix(link: Link, keys: list[BlockKey], deadline: float) -> int:
    found = 0
    for batch in key_batches(keys, link.header_budget):
        link.channel.send(LookupRequest.of(keys[batch.start : batch.stop]), deadline=deadline)
        count = expect(link.channel.recv(deadline), LookupReply).count
        found += count
        if count < len(batch):
            break
    return found
