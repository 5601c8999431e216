"""The wire protocol: every message two kvmux peers exchange, as pydantic models.

These models are the single source of truth for the protocol. A frame's JSON
header is validated against one of the two discriminated unions below (by its
``kind``), so a peer can only ever send what is declared here; raw bytes
follow a header only when its ``payload_nbytes()`` says so. Nothing is ever
unpickled.

Conversation of the pool connectors (``tcp``, ``shm``)::

    server → hello        client → join        server → welcome | error
    client → lookup       server → lookup_reply
    client → fetch        server → fetch_reply, then blocks frames (tcp)
    client → locate       server → locate_reply; client copies; client → unpin (shm)
    client → locate       server → nixl_locate_reply; client READs over NIXL;
                          a NIXL notification (or, on failure, unpin) ends the pin (nixl)
    client → locate       server → mooncake_locate_reply; client READs over the
                          Mooncake Transfer Engine; client → unpin (mooncake)

Conversation of a :class:`~kvmux.pipes.tcp.TcpPipe`: one ``pipe_hello`` each
way, then ``tensor`` / ``no_tensor`` frames in both directions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated, Any, ClassVar, Final, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    model_validator,
)

from kvmux.errors import LayoutError, ProtocolError, TransferError
from kvmux.keys import BlockKey
from kvmux.layout import torch_dtype

PROTOCOL_VERSION: Final = 1
MAX_KEYS_PER_REQUEST = 4096
"""Keys in one lookup/fetch/locate; larger calls are split by the client."""
MAX_KEY_ID_CHARS = 512
HEADER_SLACK = 8192
"""Room left in a frame or header budget for everything but the key list or the
payload (a header with its alignment padding is under a page and a half)."""


KeyId = Annotated[
    str, StringConstraints(max_length=MAX_KEY_ID_CHARS, pattern=r"^.*:(?:[0-9a-f]{2})+$")
]
"""``BlockKey.id`` on the wire: validated in pydantic's core, so ``BlockKey.from_id``
never fails on it, and ten thousand keys cost no Python call each."""
KeyList = Annotated[list[KeyId], Field(min_length=1, max_length=MAX_KEYS_PER_REQUEST)]
Hex16 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Mac = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Fingerprint = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{1,128}$")]
SegmentName = Annotated[str, StringConstraints(pattern=r"^kvmux-[0-9]+-[0-9a-f]{16}$")]
"""A shared-memory segment name; the pattern keeps a peer from naming any other file."""
Service = Literal["tcp", "shm", "nixl", "mooncake"]
Count = Annotated[int, Field(ge=0)]
FrameLimit = Annotated[int, Field(ge=1)]


class Message(BaseModel):
    """Base of every frame header."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    has_payload: ClassVar[bool] = False

    def payload_nbytes(self) -> int:
        """How many raw bytes follow this header in the same frame."""
        return 0


# ------------------------------------------------------------------ handshake


class Hello(Message):
    """The server's first words: who it is and a fresh nonce to authenticate against."""

    kind: Literal["hello"] = "hello"
    version: Literal[1] = PROTOCOL_VERSION
    service: Service
    nonce: Hex16
    layout: Fingerprint | None
    max_frame_bytes: FrameLimit
    max_header_bytes: FrameLimit


class Join(Message):
    """The client's answer: its layout, limits, its own nonce and its proof of the secret."""

    kind: Literal["join"] = "join"
    version: Literal[1] = PROTOCOL_VERSION
    service: Service
    nonce: Hex16
    mac: Mac | None
    layout: Fingerprint | None
    max_frame_bytes: FrameLimit
    max_header_bytes: FrameLimit


class Welcome(Message):
    """The server accepts; ``mac`` proves it knows the secret too (mutual authentication)."""

    kind: Literal["welcome"] = "welcome"
    mac: Mac | None


ErrorCode = Literal["layout_mismatch", "auth", "service", "protocol", "internal"]


class Error(Message):
    """A refusal; the connection is closed after it."""

    kind: Literal["error"] = "error"
    code: ErrorCode
    message: Annotated[str, Field(max_length=4096)]

    def to_exception(self) -> Exception:
        if self.code == "layout_mismatch":
            return LayoutError(self.message)
        return TransferError(f"peer refused ({self.code}): {self.message}")


# ------------------------------------------------------------------ pool requests


class _KeysRequest(Message):
    keys: KeyList

    @classmethod
    def of(cls, keys: Sequence[BlockKey]) -> Self:
        return cls(keys=[key.id for key in keys])

    def block_keys(self) -> Iterator[BlockKey]:
        """The keys, parsed one by one as iterated (a lookup stops at its first miss)."""
        return map(BlockKey.from_id, self.keys)


class LookupRequest(_KeysRequest):
    kind: Literal["lookup"] = "lookup"


class LookupReply(Message):
    """How many leading keys of the request the server holds."""

    kind: Literal["lookup_reply"] = "lookup_reply"
    count: Count


class FetchRequest(_KeysRequest):
    """Send me these blocks (tcp); answered by a fetch_reply and blocks frames."""

    kind: Literal["fetch"] = "fetch"


class FetchReply(Message):
    """Which requested keys will follow, in request order; missing ones send nothing."""

    kind: Literal["fetch_reply"] = "fetch_reply"
    found: Annotated[list[bool], Field(max_length=MAX_KEYS_PER_REQUEST)]
    block_nbytes: Count
    """0 from a producer that has registered no KV memory (then nothing is found)."""


class Blocks(Message):
    """Raw bytes of ``count`` found blocks, starting at the ``first``-th found one."""

    kind: Literal["blocks"] = "blocks"
    has_payload: ClassVar[bool] = True
    first: Count
    count: Annotated[int, Field(ge=1, le=MAX_KEYS_PER_REQUEST)]
    nbytes: Count

    def payload_nbytes(self) -> int:
        return self.nbytes


class LocateRequest(_KeysRequest):
    """Pin these blocks in your shared segment and tell me where they are (shm)."""

    kind: Literal["locate"] = "locate"


class LocateReply(Message):
    """Where the pinned blocks are: row ``rows[i]`` of the pool at ``offset`` in
    ``segment`` (None: missing). The pin lasts ``lease_s`` or until ``unpin``.
    ``segment`` and ``token`` are None only from a producer with no pool yet."""

    kind: Literal["locate_reply"] = "locate_reply"
    lease: Count
    lease_s: Annotated[float, Field(gt=0)]
    segment: SegmentName | None
    token: Hex16 | None
    offset: Count
    slots: Count
    block_nbytes: Count
    rows: Annotated[list[Count | None], Field(max_length=MAX_KEYS_PER_REQUEST)]

    @model_validator(mode="after")
    def _rows_in_pool(self) -> LocateReply:
        if any(row is not None and row >= self.slots for row in self.rows):
            raise ValueError(f"a row is outside the pool of {self.slots} slots")
        if any(row is not None for row in self.rows) and (
            self.segment is None or self.token is None
        ):
            raise ValueError("rows without a segment to read them from")
        return self


AgentName = Annotated[str, StringConstraints(pattern=r"^kvmux-[0-9]+-[0-9a-f]{16}$")]
"""A NIXL agent's name as kvmux creates them (pid and a random token)."""
AgentMetadata = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9+/]*={0,2}$", max_length=2**20)
]
"""A NIXL agent's metadata blob, base64: opaque bytes NIXL itself parses."""


class NixlLocateReply(Message):
    """Where the pinned blocks are in the producer's NIXL-registered pool: row
    ``rows[i]`` (None: missing) of ``slots`` rows of ``block_nbytes`` at address
    ``base``. ``metadata`` (base64, for ``add_remote_agent``) comes with the first
    reply on a connection; later replies send only the agent's name. The pin
    lasts ``lease_s`` or until the consumer's notification (or ``unpin``)."""

    kind: Literal["nixl_locate_reply"] = "nixl_locate_reply"
    lease: Count
    lease_s: Annotated[float, Field(gt=0)]
    agent: AgentName
    metadata: AgentMetadata | None
    base: Count
    slots: Count
    block_nbytes: Count
    rows: Annotated[list[Count | None], Field(max_length=MAX_KEYS_PER_REQUEST)]

    @model_validator(mode="after")
    def _rows_in_pool(self) -> NixlLocateReply:
        if any(row is not None and row >= self.slots for row in self.rows):
            raise ValueError(f"a row is outside the pool of {self.slots} slots")
        return self


class MooncakeLocateReply(Message):
    """Where the pinned blocks are in the producer's Transfer-Engine-registered pool:
    row ``rows[i]`` (None: missing) of ``slots`` rows of ``block_nbytes`` at address
    ``base``, readable through the engine whose RPC port is ``te_port`` on the host
    the client already reached (never a host the server names: a server cannot
    point a client at a third machine). The pin lasts ``lease_s`` or until ``unpin``."""

    kind: Literal["mooncake_locate_reply"] = "mooncake_locate_reply"
    lease: Count
    lease_s: Annotated[float, Field(gt=0)]
    te_port: Annotated[int, Field(ge=1, le=65535)]
    base: Count
    slots: Count
    block_nbytes: Count
    rows: Annotated[list[Count | None], Field(max_length=MAX_KEYS_PER_REQUEST)]

    @model_validator(mode="after")
    def _rows_in_pool(self) -> MooncakeLocateReply:
        if any(row is not None and row >= self.slots for row in self.rows):
            raise ValueError(f"a row is outside the pool of {self.slots} slots")
        return self


class Unpin(Message):
    """The client is done copying; no reply."""

    kind: Literal["unpin"] = "unpin"
    lease: Count


# ------------------------------------------------------------------ pipe


class PipeHello(Message):
    kind: Literal["pipe_hello"] = "pipe_hello"
    version: Literal[1] = PROTOCOL_VERSION


class TensorHeader(Message):
    """One tensor's dtype and shape; its ``nbytes`` raw bytes (C order) follow."""

    kind: Literal["tensor"] = "tensor"
    has_payload: ClassVar[bool] = True
    dtype: Annotated[str, Field(max_length=32)]
    shape: Annotated[list[Count], Field(max_length=32)]
    nbytes: Count

    @model_validator(mode="after")
    def _size_matches(self) -> TensorHeader:
        try:
            dtype = torch_dtype(self.dtype)
        except LayoutError as exc:
            raise ValueError(str(exc)) from None
        numel = 1
        for dim in self.shape:
            numel *= dim
        itemsize = dtype.itemsize
        if numel * itemsize != self.nbytes:
            raise ValueError(
                f"{self.dtype} tensor of shape {self.shape} has {numel * itemsize} bytes, "
                f"header says {self.nbytes}"
            )
        return self

    def payload_nbytes(self) -> int:
        return self.nbytes


class NoTensor(Message):
    """``send_tensor(None)``: a message of its own, with no payload."""

    kind: Literal["no_tensor"] = "no_tensor"


PeerMessage = Annotated[
    Hello
    | Join
    | Welcome
    | Error
    | LookupRequest
    | LookupReply
    | FetchRequest
    | FetchReply
    | Blocks
    | LocateRequest
    | LocateReply
    | NixlLocateReply
    | MooncakeLocateReply
    | Unpin,
    Field(discriminator="kind"),
]
PipeMessage = Annotated[PipeHello | TensorHeader | NoTensor, Field(discriminator="kind")]

M = TypeVar("M", bound=Message)

PEER_PROTOCOL: TypeAdapter[Any] = TypeAdapter(PeerMessage)
PIPE_PROTOCOL: TypeAdapter[Any] = TypeAdapter(PipeMessage)


def expect(msg: Message, cls: type[M]) -> M:
    """``msg`` if it is a ``cls``; a peer's Error becomes its exception, anything
    else is a ProtocolError (the conversation is out of step)."""
    if isinstance(msg, cls):
        return msg
    if isinstance(msg, Error):
        raise msg.to_exception()
    wanted = cls.model_fields["kind"].default
    raise ProtocolError(f"expected a {wanted!r} message, got {getattr(msg, 'kind', '?')!r}")


def key_batches(keys: Sequence[BlockKey], max_header_bytes: int) -> Iterator[range]:
    """Index ranges of ``keys`` whose requests fit ``max_header_bytes`` and the key limit."""
    if not keys:
        return
    per_key = max(len(key.id) for key in keys) + 3  # quotes and a comma
    size = max(1, min(MAX_KEYS_PER_REQUEST, (max_header_bytes - HEADER_SLACK) // per_key))
    for start in range(0, len(keys), size):
        yield range(start, min(start + size, len(keys)))
