"""The NIXL transport's own message: where a locate's pinned blocks are, for a NIXL READ.

Registered in :data:`~kvmux.net.messages.PEER_PROTOCOL` on import (no NIXL needed:
it is plain pydantic), the way any transport adds what it needs to the pool protocol.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import StringConstraints

from kvmux.net.messages import PEER_PROTOCOL, Count, PinReply

AgentName = Annotated[str, StringConstraints(pattern=r"^kvmux-[0-9]+-[0-9a-f]{16}$")]
"""A NIXL agent's name as kvmux creates them (pid and a random token)."""
AgentMetadata = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9+/]*={0,2}$", max_length=2**20)
]
"""A NIXL agent's metadata blob, base64: opaque bytes NIXL itself parses."""


@PEER_PROTOCOL.register
class NixlLocateReply(PinReply):
    """Where the pinned blocks are in the producer's NIXL-registered pool: row
    ``rows[i]`` (-1: missing) of ``slots`` rows of ``block_nbytes`` at address
    ``base``. ``metadata`` (base64, for ``add_remote_agent``; about a kilobyte)
    comes with every reply, so a consumer that dropped the agent (a failed link)
    can add it back from any connection; it adds it only once. The pin lasts
    ``lease_s`` or until the consumer's ``unpin``."""

    kind: Literal["nixl_locate_reply"] = "nixl_locate_reply"
    agent: AgentName
    metadata: AgentMetadata | None
    base: Count
