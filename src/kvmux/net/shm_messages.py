"""The shared-memory transport's own message: where a locate's (or a peek's) blocks are.

Registered in :data:`~kvmux.net.messages.PEER_PROTOCOL` on import, the way any
transport, kvmux's or a third party's, adds what it needs to the pool protocol.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

import numpy as np
import numpy.typing as npt
from pydantic import Field, StringConstraints, model_validator

from kvmux.net.messages import MAX_KEYS_PER_REQUEST, PEER_PROTOCOL, Count, Hex16, PinReply

SegmentName = Annotated[str, StringConstraints(pattern=r"^kvmux-[0-9]+-[0-9a-f]{16}$")]
"""A shared-memory segment name; the pattern keeps a peer from naming any other file."""


@PEER_PROTOCOL.register
class LocateReply(PinReply):
    """Where the blocks are: row ``rows[i]`` of the pool at ``offset`` in
    ``segment`` (-1: missing). After a locate the pin lasts ``lease_s`` or until
    ``unpin``; a peek pins nothing and answers ``versions`` instead. ``segment`` and
    ``token`` are None only from a producer with no pool yet."""

    kind: Literal["locate_reply"] = "locate_reply"
    segment: SegmentName | None
    token: Hex16 | None
    offset: Count
    versions_offset: Count | None = None
    """Where the segment's slot versions start (a producer of this version always
    says)."""
    versions: Annotated[bytes, Field(max_length=8 * MAX_KEYS_PER_REQUEST)] | None = None
    """A peek's answer: per requested key, its slot's version as a little-endian
    uint64 (0 where missing), read when the rows were."""

    @model_validator(mode="after")
    def _segment_if_found(self) -> Self:
        if self.row_bounds()[1] >= 0 and (self.segment is None or self.token is None):
            raise ValueError("rows without a segment to read them from")
        if self.versions_offset is not None and self.versions_offset % 8:
            raise ValueError("versions_offset is not 8-byte aligned")
        if self.versions is not None and (
            len(self.versions) != 2 * len(self.rows) or self.versions_offset is None
        ):
            raise ValueError("versions must be one uint64 per row, with their offset")
        return self

    def version_array(self) -> npt.NDArray[np.uint64]:
        """``versions`` as uint64 (empty if none); a read-only view, not a copy."""
        return np.frombuffer(self.versions or b"", dtype="<u8")
