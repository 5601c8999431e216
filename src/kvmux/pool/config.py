"""The config every served pool shares (``tcp``, ``shm``, ``nixl``, ``mooncake``).

Without a ``secret``, the server answers anyone who can reach its port; it
binds 127.0.0.1 unless ``host`` says otherwise. ``address()`` carries the
host peers must dial: ``advertise``, else the bound host, else (for a
wildcard bind) this machine's first non-loopback address
(:mod:`kvmux.net.advertise`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from kvmux.backends.cpu import CpuPoolConfig
from kvmux.net.advertise import WILDCARDS


class ServedPoolConfig(CpuPoolConfig):
    host: str = Field(
        "127.0.0.1", description="address the server listens on (0.0.0.0: every interface)"
    )
    advertise: str | None = Field(
        None,
        description="address peers are told to reach this server at (in address()); "
        "default: host, or for a wildcard host this machine's first non-loopback IPv4 "
        "address. Set it with several interfaces or NAT between hosts",
    )
    port: int = Field(0, ge=0, le=65535, description="listening port; 0 picks a free one")
    secret: SecretStr | None = Field(
        None,
        description="shared secret both peers must prove (HMAC); never sent. Without one "
        "the server is open to anyone who can reach its port",
    )
    max_frame_bytes: int = Field(
        64 * 2**20, ge=2**16, description="largest frame accepted from a peer, header included"
    )
    max_header_bytes: int = Field(
        2**20, ge=2**16, description="largest frame header accepted from a peer"
    )
    max_connections: int = Field(
        256,
        ge=1,
        description="connections the server keeps open at once; past it, the oldest one "
        "still in its handshake is dropped, else the newcomer is refused (counted, logged)",
    )
    handshake_timeout_s: float = Field(
        3.0, gt=0, description="a connection that has not joined within this is closed"
    )
    idle_timeout_s: float = Field(
        300.0, gt=0, description="a joined connection without a request for this long is closed"
    )

    save_mode: Literal["copy", "borrow"] = Field(
        "copy",
        description="copy: a save copies blocks into the pool (capacity_bytes) and ends at "
        "once; borrow: peers are served from the engine's KV memory itself (no pool, no "
        "copy) and a save's handle ends only once its blocks are given back (released, "
        "their publication ended or expired, no peer reading them)",
    )

    @property
    def borrows_blocks(self) -> bool:
        return self.save_mode == "borrow"

    @field_validator("advertise")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        if value is not None and value in WILDCARDS:
            raise ValueError(f"advertise={value!r} is a wildcard; peers cannot reach it")
        return value


class PinnedPoolConfig(ServedPoolConfig):
    """A pool whose consumers pin what they read (``shm``, ``nixl``, ``mooncake``)."""

    lease_s: float = Field(
        30.0, gt=0, description="longest a consumer's pin holds slots without being ended"
    )
