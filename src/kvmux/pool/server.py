"""PoolServer: the thread that answers a served pool's peers.

Made by the backend's ``register`` (before it there is no pool to serve and
no layout to declare), closed by its ``close``. It answers what every served
pool answers (lookups, lease renewals and releases) and hands the rest to the
transport's handlers (:class:`~kvmux.pool.transport.PullTransport`). Sockets,
handshakes and connection limits are :class:`~kvmux.net.server.FrameServer`'s.
"""

from __future__ import annotations

from kvmux.net.advertise import advertised_host
from kvmux.net.frames import Limits
from kvmux.net.handshake import Terms, refusal
from kvmux.net.messages import Error, LeaseReply, LookupReply, LookupRequest, Release, Renew
from kvmux.net.server import FrameServer, ServerLimits, Session
from kvmux.pool.config import ServedPoolConfig
from kvmux.pool.store import PoolStore
from kvmux.pool.transport import PullTransport


class PoolServer:
    """Serves ``store`` to peers through ``transport``, declaring ``terms``."""

    def __init__(
        self,
        config: ServedPoolConfig,
        store: PoolStore,
        transport: PullTransport,
        *,
        terms: Terms,
        incarnation: str,
        limits: Limits,
        secret: str | None,
    ) -> None:
        self._store = store
        self._terms = terms
        self._frames = FrameServer(
            host=config.host,
            port=config.port,
            service=transport.service,
            limits=limits,
            server_limits=ServerLimits(
                config.max_connections, config.handshake_timeout_s, config.idle_timeout_s
            ),
            timeout_s=config.timeout_s,
            secret=secret,
            terms=lambda: terms,
            incarnation=incarnation,
            handlers={
                LookupRequest: self._serve_lookup,
                Renew: self._serve_renew,
                Release: self._serve_release,
                **transport.handlers(self.refused),
            },
            on_close=transport.session_closed,
            unix_name=f"kvmux-{transport.service}-{incarnation}" if transport.same_host else None,
        )
        self.host = advertised_host(self._frames.host, config.advertise)
        """Where peers reach the server; see :mod:`kvmux.net.advertise`."""
        self.port: int = self._frames.port
        self.unix_name = self._frames.unix_name
        """Where peers on this host reach the server too (None: TCP only)."""

    @property
    def alive(self) -> bool:
        return self._frames.alive

    def refused(self, session: Session) -> bool:
        """Check the terms at every request that sends blocks: a client that declared
        no layout, or another one, must never receive them (told why, each time).
        Worked out at the session's first such request and kept with it."""
        if not session.refusal_known:
            session.refusal, session.refusal_known = self._refusal(session), True
        if session.refusal is None:
            return False
        session.send(session.refusal)
        return True

    def _refusal(self, session: Session) -> Error | None:
        mine, theirs = self._terms, session.peer
        refused = refusal(mine, Terms(theirs.layout, theirs.compat))
        if refused is None and theirs.layout is None and mine.layout is not None:
            refused = Error(
                code="layout_mismatch",
                message="the client registered no KV layout; it cannot receive blocks",
            )
        return refused

    def _serve_lookup(self, session: Session, req: LookupRequest) -> None:
        runs = req.digest_runs()  # parsed before taking the lock saves wait on
        with self._store.lock:
            count = self._store.slots.prefix(self._store.slots.stored_keys(runs))
        session.send(LookupReply(count=count))

    def _serve_renew(self, session: Session, msg: Renew) -> None:
        session.send(LeaseReply(known=self._store.renew(msg.leases)))

    def _serve_release(self, session: Session, msg: Release) -> None:
        session.send(LeaseReply(known=self._store.unpublish(msg.leases)))

    def stats(self) -> dict[str, float]:
        frames = self._frames
        return {
            "server_connections": frames.connections,
            "rejected_connections": frames.rejected,
            "refused_connections": frames.refused,
            "handshake_timeouts": frames.handshake_timeouts,
            "idle_connections_closed": frames.idle_closed,
        }

    def close(self) -> None:
        self._frames.close()
