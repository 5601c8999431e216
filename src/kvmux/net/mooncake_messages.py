"""The Mooncake transport's own message: where a locate's pinned blocks are, for a
Transfer Engine READ.

Registered in :data:`~kvmux.net.messages.PEER_PROTOCOL` on import (no Mooncake
needed: it is plain pydantic), the way any transport adds what it needs to the
pool protocol.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvmux.net.messages import PEER_PROTOCOL, Count, PinReply


@PEER_PROTOCOL.register
class MooncakeLocateReply(PinReply):
    """Where the pinned blocks are in the producer's Transfer-Engine-registered pool:
    row ``rows[i]`` (-1: missing) of ``slots`` rows of ``block_nbytes`` at address
    ``base``, readable through the engine whose RPC port is ``te_port`` on the host
    the client already reached (never a host the server names: a server cannot
    point a client at a third machine). The pin lasts ``lease_s`` or until ``unpin``."""

    kind: Literal["mooncake_locate_reply"] = "mooncake_locate_reply"
    te_port: Annotated[int, Field(ge=1, le=65535)]
    base: Count
