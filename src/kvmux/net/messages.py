"""The wire protocol: the messages two kvmux peers exchange, as pydantic models.

A :class:`WireProtocol` is the set of messages one kind of conversation may
carry, keyed by their ``kind``. A frame's JSON header is validated against
the registered classes only (by its ``kind``), so a peer can only ever send
what some transport declared; raw bytes follow a header only when its
``payload_nbytes()`` says so. Nothing is ever unpickled. The set is open:
a transport registers its own messages (:meth:`WireProtocol.register`) next
to its code, as shm, NIXL and Mooncake do with their locate replies, so a
third-party transport reuses the pool conversation without editing kvmux.

Conversation of the pool connectors (``tcp``, ``shm``, ``nixl``, ``mooncake``)::

    server → hello        client → join        server → welcome | error
    client → lookup       server → lookup_reply
    client → fetch        server → fetch_reply, then blocks frames (tcp)
    client → locate       server → locate_reply; client copies; client → unpin (shm)
    client → locate       server → nixl_locate_reply; client READs over NIXL;
                          client → unpin (nixl)
    client → locate       server → mooncake_locate_reply; client READs over the
                          Mooncake Transfer Engine; client → unpin (mooncake)
    client → renew        server → lease_reply (a consumer still coming for a publication)
    client → release      server → lease_reply (a consumer done with one; all four)

Conversation of a :class:`~kvmux.pipes.tcp.TcpPipe`: one ``pipe_hello`` each
way, then ``tensor`` / ``no_tensor`` frames in both directions.
"""

from __future__ import annotations

import json
import re
import struct
import threading
from collections.abc import Iterator, Sequence
from functools import reduce
from itertools import groupby
from operator import itemgetter, or_
from typing import (
    Annotated,
    Any,
    ClassVar,
    Final,
    Literal,
    Self,
    TypeVar,
    get_args,
    get_origin,
)

import numpy as np
import numpy.typing as npt
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    model_validator,
)

from kvmux.addressing import SMALL_BATCH
from kvmux.compat import Compat
from kvmux.errors import IncompatiblePeerError, LayoutError, ProtocolError, TransferError
from kvmux.keys import BlockKey
from kvmux.layout import torch_dtype

PROTOCOL_VERSION: Final = 3
"""Of the pool conversation (hello/join). 2: keys travel as digests in runs, rows
and found flags as packed bytes. 3: the handshake carries the server's
incarnation and both sides' compatibility fingerprints. A peer of another
version is refused at the handshake, naming both versions."""
PIPE_PROTOCOL_VERSION: Final = 1
MAX_KEYS_PER_REQUEST = 4096
"""Keys in one lookup/fetch/locate; larger calls are split by the client."""
MAX_KEY_ID_CHARS = 512
MAX_LEASES_PER_NOTICE = 1024
"""Publications named in one renew/release; longer lists are split by the client."""
HEADER_SLACK = 8192
"""Room left in a frame or header budget for everything but the key list or the
payload (a header with its alignment padding is under a page and a half)."""


Namespace = Annotated[str, StringConstraints(max_length=MAX_KEY_ID_CHARS, pattern=r"^[^\n]*$")]
KeyRun = tuple[
    Namespace,
    Annotated[int, Field(ge=1, le=MAX_KEY_ID_CHARS // 2)],
    Annotated[int, Field(ge=1, le=MAX_KEYS_PER_REQUEST)],
]
"""(namespace, digest bytes, keys): consecutive keys of a request that share both."""
Hex16 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Mac = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Fingerprint = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{1,128}$")]
LeaseId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
"""A publication's id (:func:`kvmux.publications.new_lease_id`): 128 random bits, so
only whoever was given the params can renew or release it."""
SHORT_NAME = r"^[a-z][a-z0-9_]{0,31}$"
"""What a service name or a message kind looks like: short, lowercase, stable."""
Service = Annotated[str, StringConstraints(pattern=SHORT_NAME)]
"""A pool transport's name (``tcp``, ``shm``, a third party's own), said at the
handshake: both ends of a connection must name the same one."""
Count = Annotated[int, Field(ge=0)]
MAX_PIECES = 2**16
"""Most byte ranges per block a lending producer may declare (:attr:`PinReply.pieces`):
one per layer, or per layer and K/V."""
FrameLimit = Annotated[int, Field(ge=1)]


class Message(BaseModel):
    """Base of every frame header."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    has_payload: ClassVar[bool] = False

    def payload_nbytes(self) -> int:
        """How many raw bytes follow this header in the same frame."""
        return 0


# ------------------------------------------------------------------ handshake


Version = Annotated[int, Field(ge=1, le=2**16)]


class Hello(Message):
    """The server's first words: who it is and a fresh nonce to authenticate against.

    ``incarnation`` is random per server instance: a client that holds an address
    naming another incarnation knows at once that the blocks it names are gone
    (the peer restarted on the same port). ``version`` is any number, so a
    peer of another version is told which, instead of failing to parse."""

    kind: Literal["hello"] = "hello"
    version: Version = PROTOCOL_VERSION
    service: Service
    nonce: Hex16
    incarnation: Hex16 | None = None
    layout: Fingerprint | None
    compat: Compat | None = None
    max_frame_bytes: FrameLimit
    max_header_bytes: FrameLimit


class Join(Message):
    """The client's answer: its layout and fingerprint, limits, its own nonce and its
    proof of the secret."""

    kind: Literal["join"] = "join"
    version: Version = PROTOCOL_VERSION
    service: Service
    nonce: Hex16
    mac: Mac | None
    layout: Fingerprint | None
    compat: Compat | None = None
    max_frame_bytes: FrameLimit
    max_header_bytes: FrameLimit


class Welcome(Message):
    """The server accepts; ``mac`` proves it knows the secret too (mutual authentication)."""

    kind: Literal["welcome"] = "welcome"
    mac: Mac | None


ErrorCode = Literal[
    "layout_mismatch", "incompatible", "auth", "service", "busy", "protocol", "internal"
]


class Error(Message):
    """A refusal; the connection is closed after it."""

    kind: Literal["error"] = "error"
    code: ErrorCode
    message: Annotated[str, Field(max_length=4096)]

    def to_exception(self) -> Exception:
        if self.code == "layout_mismatch":
            return LayoutError(self.message)
        if self.code == "incompatible":
            return IncompatiblePeerError(self.message)
        return TransferError(f"peer refused ({self.code}): {self.message}")


# ------------------------------------------------------------------ pool requests


class _KeysRequest(Message):
    """A batch of keys, compact: ``runs`` of (namespace, digest length, count) in
    order, and every key's digest back to back in ``digests`` (base64 in JSON).

    Four thousand keys as ``namespace:hex`` strings made a 300 KB header that
    cost its producer a Python parse per key (12 ms a batch, on the path of
    every load); as one byte string they cost a base64 decode, and the checks
    below are over the batch, not per key. A batch is one run in practice
    (one namespace, one digest size)."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    runs: Annotated[list[KeyRun], Field(min_length=1, max_length=MAX_KEYS_PER_REQUEST)]
    digests: bytes

    @model_validator(mode="after")
    def _digests_fill_the_runs(self) -> Self:
        if sum(count for _, _, count in self.runs) > MAX_KEYS_PER_REQUEST:
            raise ValueError(f"more than {MAX_KEYS_PER_REQUEST} keys in one request")
        if len(self.digests) != sum(size * count for _, size, count in self.runs):
            raise ValueError("the digests do not add up to the runs' keys")
        if any(len(ns) + 1 + 2 * size > MAX_KEY_ID_CHARS for ns, size, _ in self.runs):
            raise ValueError(f"a key's id would be over {MAX_KEY_ID_CHARS} characters")
        return self

    @classmethod
    def of(cls, keys: Sequence[BlockKey]) -> Self:
        digests = list(map(itemgetter(0), keys))
        return cls(runs=_key_runs(keys, digests), digests=b"".join(digests))

    def digest_runs(self) -> list[tuple[str, list[bytes]]]:
        """Each run's namespace and its keys' digests, in request order. A producer
        finds its slots by these (``PinnedSlots.stored_keys``) without building a
        key per digest: bytes are no work for the garbage collector, while
        thousands of key tuples a request set off its passes (a 4096-block shm
        load took 15-17 ms with them, 12-14 without)."""
        runs: list[tuple[str, list[bytes]]] = []
        blob, at = memoryview(self.digests), 0
        for ns, size, count in self.runs:
            end = at + size * count
            runs.append((ns, np.frombuffer(blob[at:end], dtype=f"V{size}").tolist()))
            at = end
        return runs

    def block_keys(self) -> list[BlockKey]:
        """The keys, in request order. Built unchecked: the validators above have
        checked every field ``BlockKey`` would (non-empty bytes, a str)."""
        keys: list[BlockKey] = []
        for ns, digests in self.digest_runs():
            keys.extend(BlockKey.unchecked_batch(digests, ns))
        return keys


def _key_runs(keys: Sequence[BlockKey], digests: list[bytes]) -> list[tuple[str, int, int]]:
    """Runs of consecutive keys sharing a namespace and a digest size (C-level grouping).
    The usual batch, one run, is recognised from two sets: no tuple per key, so
    a batch of thousands of keys also feeds the garbage collector nothing."""
    namespaces, sizes = set(map(itemgetter(1), keys)), set(map(len, digests))
    if len(namespaces) == 1 and len(sizes) == 1:
        return [(namespaces.pop(), sizes.pop(), len(keys))]
    same = groupby(zip(map(itemgetter(1), keys), map(len, digests), strict=True))
    return [(ns, size, len(list(run))) for (ns, size), run in same]


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
    """Which requested keys will follow, in request order; missing ones send nothing.

    ``found`` is one byte per requested key, 1 (follows) or 0 (missing), base64 in
    JSON: checked as one string, not as thousands of JSON booleans."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    kind: Literal["fetch_reply"] = "fetch_reply"
    found: Annotated[bytes, Field(max_length=MAX_KEYS_PER_REQUEST)]
    block_nbytes: Count
    """0 from a producer that has registered no KV memory (then nothing is found)."""

    @model_validator(mode="after")
    def _flags(self) -> Self:
        if self.found.translate(None, b"\0\1"):
            raise ValueError("found flags must be 0 or 1")
        return self


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


class PeekRequest(_KeysRequest):
    """Tell me where these blocks are and each one's slot version, without pinning
    them: the consumer checks the versions after its copy (shm)."""

    kind: Literal["peek"] = "peek"


class PinReply(Message):
    """What every locate reply carries, whatever the transport adds: the lease that
    pins the found slots, and per requested key its ``rows`` entry.

    ``rows`` holds one little-endian int32 per requested key (base64 in JSON): the
    pool row that holds it, or -1 if missing. As a JSON list, the ints of a
    4096-key batch were 20 KB to build, encode and validate one by one; as bytes
    they are checked at once (:meth:`row_array`) and never leave numpy.

    ``pieces`` comes from a producer that lends the engine's blocks instead of
    keeping a pool (``save_mode: borrow``): ``rows`` are then its block ids (of
    ``slots`` blocks) and block 0's pieces start at these addresses in its
    registered KV memory (:meth:`~kvmux.addressing.BlockAddressing.piece_starts`;
    the layouts, which fix every other offset, matched at the handshake)."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    lease: Count
    lease_s: Annotated[float, Field(gt=0)]
    slots: Annotated[int, Field(ge=0, le=2**31 - 1)]
    block_nbytes: Count
    rows: Annotated[bytes, Field(max_length=4 * MAX_KEYS_PER_REQUEST)]
    pieces: Annotated[list[Count], Field(max_length=MAX_PIECES)] | None = None

    @model_validator(mode="after")
    def _rows_in_pool(self) -> Self:
        if len(self.rows) % 4:
            raise ValueError("rows are not whole int32s")
        low, high = self.row_bounds()
        if low < -1 or high >= self.slots:
            raise ValueError(f"a row is outside the pool of {self.slots} slots")
        return self

    def row_array(self) -> npt.NDArray[np.int32]:
        """``rows`` as int32 (-1: missing); a read-only view, not a copy."""
        return np.frombuffer(self.rows, dtype="<i4")

    def row_bounds(self) -> tuple[int, int]:
        """The least and the greatest of ``rows`` ((-1, -1) if none). A few rows are
        read as Python ints: the validators ran two numpy reductions a reply, half
        the cost of checking a one-block reply, on both ends of every load."""
        count = len(self.rows) // 4
        if not count:
            return -1, -1
        if count < SMALL_BATCH:
            few = struct.unpack(f"<{count}i", self.rows[: 4 * count])
            return min(few), max(few)
        rows = self.row_array()
        return int(rows.min()), int(rows.max())


def pack_rows(rows: Sequence[int | None] | npt.NDArray[np.integer[Any]]) -> bytes:
    """A producer's found rows (None or -1: missing) as :attr:`PinReply.rows`. An
    int array (``PinnedSlots.find_many``'s) is encoded at once, with no loop per row."""
    if isinstance(rows, np.ndarray):
        return rows.astype("<i4").tobytes()
    return np.array([-1 if row is None else row for row in rows], dtype="<i4").tobytes()


class Unpin(Message):
    """The client is done copying; no reply."""

    kind: Literal["unpin"] = "unpin"
    lease: Count


class Renew(Message):
    """The consumer holds these publications' params and has not loaded yet (its
    queue is long): extend each by its lease. Unknown ids are ignored."""

    kind: Literal["renew"] = "renew"
    leases: Annotated[list[LeaseId], Field(min_length=1, max_length=MAX_LEASES_PER_NOTICE)]


class Release(Message):
    """The consumer is done with these publications (loaded, failed, aborted, or
    rejected before reaching its engine): drop their holds now, not at lease end.
    Unknown ids are ignored."""

    kind: Literal["release"] = "release"
    leases: Annotated[list[LeaseId], Field(min_length=1, max_length=MAX_LEASES_PER_NOTICE)]


class LeaseReply(Message):
    """The answer to a renew or release: how many of its leases the producer held
    (the others had expired, were released already, or are another instance's)."""

    kind: Literal["lease_reply"] = "lease_reply"
    known: Count


# ------------------------------------------------------------------ pipe


class PipeHello(Message):
    kind: Literal["pipe_hello"] = "pipe_hello"
    version: Literal[1] = PIPE_PROTOCOL_VERSION


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


M = TypeVar("M", bound=Message)


class WireProtocol:
    """The messages one kind of conversation may carry, by ``kind``: a header is
    validated against exactly these, and a message of any other kind is refused
    on receipt (:meth:`validate_json` fails) and on sending (:meth:`dump_json`).

    It is open: a transport adds its own messages with :meth:`register` (a class
    decorator) in the module that defines them, so a third party extends the pool
    protocol (:data:`PEER_PROTOCOL`) without editing kvmux. Each kind names one
    class for good; registering another class under a taken kind is refused.
    """

    def __init__(self, name: str, *messages: type[Message]) -> None:
        self.name = name
        self._classes: dict[str, type[Message]] = {}
        self._adapter: TypeAdapter[Any] | None = None
        self._lock = threading.Lock()
        for cls in messages:
            self.register(cls)

    def register(self, cls: type[M]) -> type[M]:
        """Add ``cls`` (a :class:`Message` with ``kind: Literal["its_kind"]``) to this
        protocol and return it unchanged. Registering it again is harmless."""
        if not (isinstance(cls, type) and issubclass(cls, Message)):
            raise TypeError(f"{cls!r} is not a kvmux.net.messages.Message")
        field = cls.model_fields.get("kind")
        if field is None or get_origin(field.annotation) is not Literal:
            raise TypeError(f"{cls.__name__} has no kind: Literal[...] field")
        if get_args(field.annotation) != (field.default,):
            raise TypeError(f"{cls.__name__}.kind must be one Literal, its default")
        kind = _short_name("message kind", field.default)
        with self._lock:
            taken = self._classes.get(kind)
            if taken is not None and taken is not cls:
                raise ValueError(
                    f"kind {kind!r} of the {self.name} protocol is {taken.__module__}."
                    f"{taken.__qualname__}'s; {cls.__module__}.{cls.__qualname__} needs another"
                )
            self._classes[kind] = cls
            self._adapter = None
        return cls

    def validate_json(self, raw: bytes) -> Message:
        """The message ``raw`` (one JSON header) holds; a pydantic ValidationError if it
        is not exactly one of the registered kinds, with nothing extra."""
        message: Message = self._validator().validate_json(raw)
        return message

    def dump_json(self, msg: Message) -> bytes:
        """``msg`` as a header; a ProtocolError if its class is not registered here."""
        if self._classes.get(getattr(msg, "kind", "")) is not type(msg):
            raise ProtocolError(
                f"{type(msg).__name__} is not a message of the {self.name} protocol"
            )
        return msg.__pydantic_serializer__.to_json(msg)

    def _validator(self) -> TypeAdapter[Any]:
        """The discriminated union of the registered classes, rebuilt after a registration."""
        adapter = self._adapter
        if adapter is None:
            with self._lock:
                classes = tuple(self._classes.values())
                if len(classes) == 1:
                    adapter = TypeAdapter(classes[0])
                else:
                    union: Any = reduce(or_, classes)  # Hello | Join | ...
                    adapter = TypeAdapter(Annotated[union, Field(discriminator="kind")])
                self._adapter = adapter
        return adapter


def check_service(name: str) -> str:
    """``name`` if it is a valid :data:`Service`; ValueError otherwise."""
    return _short_name("service name", name)


def _short_name(what: str, name: object) -> str:
    if not (isinstance(name, str) and re.fullmatch(SHORT_NAME, name)):
        raise ValueError(
            f"{what} {name!r} is not a short lowercase name (a letter, then up to 31 "
            "letters, digits or _)"
        )
    return name


PEER_PROTOCOL = WireProtocol(
    "pool",
    Hello,
    Join,
    Welcome,
    Error,
    LookupRequest,
    LookupReply,
    FetchRequest,
    FetchReply,
    Blocks,
    LocateRequest,
    PeekRequest,
    Unpin,
    Renew,
    Release,
    LeaseReply,
)
"""What the pool connections carry. Transports register their own replies in it
(:mod:`kvmux.net.shm_messages`, :mod:`~kvmux.net.nixl_messages`,
:mod:`~kvmux.net.mooncake_messages`)."""
PIPE_PROTOCOL = WireProtocol("pipe", PipeHello, TensorHeader, NoTensor)
"""What a :class:`~kvmux.pipes.tcp.TcpPipe` carries."""


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
    sizes = list(map(len, map(itemgetter(0), keys)))  # digest sizes, at C speed
    namespaces = set(map(itemgetter(1), keys))
    per_key = 4 * -(-max(sizes) // 3)  # its digest in base64, rounded up
    if len(namespaces) > 1 or min(sizes) != max(sizes):
        # the worst case, a run of its own per key: '["namespace",255,4096],'
        per_key += max(len(json.dumps(ns)) for ns in namespaces) + 16
    size = max(1, min(MAX_KEYS_PER_REQUEST, (max_header_bytes - HEADER_SLACK) // per_key))
    for start in range(0, len(keys), size):
        yield range(start, min(start + size, len(keys)))
