"""What a backend can do, declared up front.

The conformance suite skips a test only when a capability says the backend
does not promise that behaviour (and says which), and the MultiBackend
refuses compositions whose children cannot work together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    p2p: bool = False
    """Loads pull from a peer instance named by ``source`` (an ``address()``)."""
    one_peer: bool = False
    """P2P with a single peer for the connector's life (a pipe): a later ``source``
    cannot switch it to another peer."""
    persistent: bool = False
    """Blocks survive closing the connector and opening a new one on the same config."""
    file_backed: bool = False
    """Stored blocks' bytes lie, as they are (not compressed or encrypted), in files
    under a directory named in the config (a path-typed field, in a nested backend's
    config too), where a test can reach them: the conformance suite damages them
    there to check that a corrupted stored block is never loaded as ok."""
    capacity_bound: bool = False
    """Bounded storage: saving past capacity evicts older blocks instead of failing."""
    consumes_on_load: bool = False
    """A successful load removes the block (lookup-buffer ``drop_select`` semantics)."""
    zero_copy: bool = False
    """The transport reads or writes registered KV memory directly."""
    layerwise: bool = False
    """Can move one layer at a time while the engine computes the next."""
    memory_kinds: frozenset[str] = field(default_factory=lambda: frozenset({"cpu"}))
    """Devices whose KV memory ``register`` accepts (``cpu``, ``cuda``)."""
    max_block_nbytes: int | None = None
    """Largest block the backend can hold, if bounded."""
    borrows_blocks: bool = False
    """A save keeps the engine's blocks instead of copying them: peers are served
    straight from the engine's KV memory, and the save's handle ends only once the
    blocks are returned (their keys released, their publication ended or expired,
    no peer reading them). Until then the engine must not overwrite them; the
    save's per-key outcome is known at once (``Handle.saved``)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["memory_kinds"] = sorted(self.memory_kinds)
        return data
