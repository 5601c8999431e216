"""The shared-memory transport's own message: where a locate's pinned blocks are.

Registered in :data:`~kvmux.net.messages.PEER_PROTOCOL` on import, the way any
transport, kvmux's or a third party's, adds what it needs to the pool protocol.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import StringConstraints, model_validator

from kvmux.net.messages import PEER_PROTOCOL, Count, Hex16, PinReply

SegmentName = Annotated[str, StringConstraints(pattern=r"^kvmux-[0-9]+-[0-9a-f]{16}$")]
"""A shared-memory segment name; the pattern keeps a peer from naming any other file."""


@PEER_PROTOCOL.register
class LocateReply(PinReply):
    """Where the pinned blocks are: row ``rows[i]`` of the pool at ``offset`` in
    ``segment`` (-1: missing). The pin lasts ``lease_s`` or until ``unpin``.
    ``segment`` and ``token`` are None only from a producer with no pool yet."""

    kind: Literal["locate_reply"] = "locate_reply"
    segment: SegmentName | None
    token: Hex16 | None
    offset: Count

    @model_validator(mode="after")
    def _segment_if_found(self) -> Self:
        if (self.row_array() >= 0).any() and (self.segment is None or self.token is None):
            raise ValueError("rows without a segment to read them from")
        return self
