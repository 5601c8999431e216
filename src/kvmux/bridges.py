"""Bridges between the plug-in levels: any Pipe → a LookupBuffer → a Connector.

They let a third party implement only the level that fits its system and get
the other two for free (the registry applies them when a name is found in the
``kvmux.buffers`` or ``kvmux.pipes`` group rather than ``kvmux.connectors``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import ValidationError

from kvmux.backend import Address, Backend, Health
from kvmux.bounded import bounded_call
from kvmux.buffer import LookupBuffer
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import ClosedError, ProtocolError, TransferError, TransferTimeout
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.net.messages import Count, Message, WireProtocol
from kvmux.pipe import Pipe

log = logging.getLogger(__name__)


class _BufferRequest(Message):
    """What one end of a PipeLookupBuffer asks the other; ``id`` pairs it with its reply."""

    kind: str
    id: Count


class ContainsRequest(_BufferRequest):
    kind: Literal["contains"] = "contains"
    key: str


class DropRequest(_BufferRequest):
    """Take ``key`` out and send it back, waiting up to ``timeout`` s for it to arrive."""

    kind: Literal["drop"] = "drop"
    key: str
    timeout: float


class CountRequest(_BufferRequest):
    """How many of these leading keys are present."""

    kind: Literal["count"] = "count"
    keys: list[str]


class BufferReply(Message):
    """The answer to request ``id``; a ``drop``'s block, if ``found``, is its payload."""

    kind: Literal["reply"] = "reply"
    id: Count
    found: bool = False
    count: Count = 0


BUFFER_PROTOCOL = WireProtocol(
    "pipe_buffer", ContainsRequest, DropRequest, CountRequest, BufferReply
)
"""What two PipeLookupBuffers say to each other. It rides on a Pipe, not on a socket:
each message is a header tensor (its JSON bytes) and a payload tensor (or None), so
the validation by kind is :mod:`kvmux.net.messages`' but the framing is the Pipe's."""


class PipeLookupBuffer(LookupBuffer):
    """A lookup buffer over one Pipe: each end keeps what it inserted, and
    ``drop_select``/``contains`` ask the *other* end.

    Every message is two tensors: a JSON header (a :data:`BUFFER_PROTOCOL`
    message, validated, never unpickled) and a payload (the block, or None).
    One reader thread routes replies to waiting callers and serves the peer's
    requests on a small pool, so a peer waiting for a slow insert never blocks
    the channel.
    """

    capabilities = Capabilities(p2p=True, one_peer=True, consumes_on_load=True)

    def __init__(self, pipe: Pipe, config: BackendConfig) -> None:
        super().__init__(config)
        self.pipe = pipe
        self._store: dict[BlockKey, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[tuple[BufferReply, torch.Tensor | None]]] = {}
        self._pending_lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._servers = ThreadPoolExecutor(4, thread_name_prefix="kvmux-pipebuf")
        self._closed = False
        self._broken: Exception | None = None
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="kvmux-pipe-rx")
        self._reader.start()

    # local side
    def insert(self, key: BlockKey, tensor: torch.Tensor) -> None:
        with self._cond:
            self._store[key] = tensor
            self._cond.notify_all()

    # remote side
    def drop_select(self, key: BlockKey, timeout: float) -> torch.Tensor | None:
        request = DropRequest(id=next(self._ids), key=key.id, timeout=timeout)
        reply, payload = self._exchange(request, timeout)
        return payload if reply.found else None

    def contains(self, key: BlockKey) -> bool:
        reply, _ = self._exchange(ContainsRequest(id=next(self._ids), key=key.id), 0.0)
        return reply.found

    def count_leading(self, keys: Sequence[BlockKey]) -> int:
        """One round trip for the whole prefix, not one per key."""
        request = CountRequest(id=next(self._ids), keys=[k.id for k in keys])
        reply, _ = self._exchange(request, 0.0)
        return reply.count

    def address(self) -> dict[str, Any]:
        return self.pipe.address()

    def connect(self, address: Mapping[str, Any]) -> None:
        # Several engine threads may make the first lookup at once; a pipe takes
        # one peer, so only one of them may dial (the others would be refused).
        with self._connect_lock:
            if not self.pipe.connected:
                self.pipe.connect(address)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pipe.close()
        self._reader.join(timeout=5)
        self._servers.shutdown(wait=False, cancel_futures=True)
        self._fail_pending(ClosedError("lookup buffer closed"))

    # ------------------------------------------------------------------ internals

    def _exchange(
        self, msg: _BufferRequest, wait: float
    ) -> tuple[BufferReply, torch.Tensor | None]:
        if self._closed:
            raise ClosedError("lookup buffer closed")
        if self._broken is not None:
            raise TransferError(f"pipe to peer is broken: {self._broken}")
        fut: Future[tuple[BufferReply, torch.Tensor | None]] = Future()
        with self._pending_lock:
            self._pending[msg.id] = fut
        try:
            self._send(msg, None)
            return fut.result(timeout=wait + self.config.timeout_s)
        except TimeoutError:
            raise TransferTimeout(f"peer did not answer {msg.kind} (id {msg.id})") from None
        finally:
            with self._pending_lock:
                self._pending.pop(msg.id, None)

    def _send(self, msg: Message, payload: torch.Tensor | None) -> None:
        header = torch.frombuffer(bytearray(BUFFER_PROTOCOL.dump_json(msg)), dtype=torch.uint8)
        with self._send_lock:
            self.pipe.send_tensor(header)
            self.pipe.send_tensor(payload)

    def _read_loop(self) -> None:
        try:
            while not self._closed:
                try:
                    header = self.pipe.recv_tensor(timeout=0.5)
                except TransferTimeout:
                    continue
                payload = self.pipe.recv_tensor(timeout=self.config.timeout_s)
                msg = self._parse(header)
                if isinstance(msg, BufferReply):
                    with self._pending_lock:
                        fut = self._pending.get(msg.id)
                    if fut is not None and not fut.done():
                        fut.set_result((msg, payload))
                else:
                    assert isinstance(msg, _BufferRequest)  # every other kind is a request
                    self._servers.submit(self._serve, msg)
        except Exception as exc:  # the channel is dead; waiting callers learn why
            if not self._closed:
                self._broken = exc
            self._fail_pending(exc)

    @staticmethod
    def _parse(header: torch.Tensor | None) -> Message:
        if header is None or header.dtype != torch.uint8 or header.dim() != 1:
            raise ProtocolError("expected a uint8 message header from the peer")
        try:
            return BUFFER_PROTOCOL.validate_json(header.numpy().tobytes())
        except ValidationError as exc:
            raise ProtocolError(f"malformed message header: {exc}") from None

    def _serve(self, msg: _BufferRequest) -> None:
        try:
            reply, payload, key = self._answer(msg)
        except ValueError as exc:  # a malformed key id
            reply, payload, key = BufferReply(id=msg.id), None, None
            log.warning("peer sent a bad %s request: %s", msg.kind, exc)
        try:
            self._send(reply, payload)
        except Exception:  # peer gone mid-reply: keep the block for a retry
            if payload is not None and key is not None:
                self.insert(key, payload)

    def _answer(
        self, msg: _BufferRequest
    ) -> tuple[BufferReply, torch.Tensor | None, BlockKey | None]:
        if isinstance(msg, CountRequest):
            keys = [BlockKey.from_id(k) for k in msg.keys]
            with self._cond:
                count = next((i for i, k in enumerate(keys) if k not in self._store), len(keys))
            return BufferReply(id=msg.id, count=count), None, None
        assert isinstance(msg, ContainsRequest | DropRequest)
        key = BlockKey.from_id(msg.key)
        payload: torch.Tensor | None = None
        with self._cond:
            if isinstance(msg, DropRequest):
                self._cond.wait_for(lambda: key in self._store or self._closed, msg.timeout)
                payload = self._store.pop(key, None)
                found = payload is not None
            else:
                found = key in self._store
        return BufferReply(id=msg.id, found=found), payload, key

    def _fail_pending(self, exc: Exception) -> None:
        with self._pending_lock:
            pending = list(self._pending.values())
        for fut in pending:
            if not fut.done():
                fut.set_exception(TransferError(f"pipe to peer failed: {exc}"))


class BufferBackend(Backend):
    """Any LookupBuffer as a backend: one uint8 tensor per key, the block's bytes
    behind a header holding the layout fingerprint.

    A buffer is raw bytes with no handshake, so the header is what stops an
    instance with another layout from loading same-sized blocks of another
    shape: the key fails instead. Keys themselves stay layout-free, because a
    lookup may come from a process that holds no KV memory (an engine's
    scheduler). A load takes what is there now (``drop_select`` with no wait),
    so a key the buffer does not hold is reported missing at once; a consumer
    that expects a block still in flight polls ``lookup`` first.

    A load's reads are bounded by its deadline, all in one
    :func:`~kvmux.bounded.bounded_call` (one thread per load, not per block): a
    buffer whose client blocks on a cut link would otherwise hold the load, and
    the engine, past it. Keys read before the deadline count; the rest fail. An
    abandoned read returns a tensor of its own, never writes into the KV blocks,
    so nothing lands in them late; the checks and copies into the blocks run in
    the caller's thread.
    """

    def __init__(self, buffer: LookupBuffer, config: BackendConfig) -> None:
        super().__init__(config)
        self.buffer = buffer
        self.capabilities = replace(buffer.capabilities, consumes_on_load=True)

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        self._attach(source)
        return self.buffer.count_leading(keys)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        header = self._header()
        nbytes = self.copier.block_nbytes
        outcomes: list[Outcome] = []
        for key, block in zip(keys, block_ids, strict=True):
            stored = torch.empty(_HEADER_BYTES + nbytes, dtype=torch.uint8)
            stored[:_HEADER_BYTES] = header
            self.copier.copy_out([block], stored[_HEADER_BYTES:].view(1, nbytes))
            try:
                self.buffer.insert(key, stored)
            except Exception as exc:  # one key's failure is that key's outcome
                outcomes.append(failed(f"insert failed: {exc}"))
                continue
            outcomes.append(OK)
        return outcomes

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> list[Outcome]:
        header = self._header()
        nbytes = self.copier.block_nbytes

        def place(read: _Read, block: int) -> Outcome:
            if isinstance(read, Exception):  # the read's own failure, handled as if raised here
                raise read
            if read is None:
                return MISSING
            if read.dtype != torch.uint8 or read.numel() != _HEADER_BYTES + nbytes:
                return failed(
                    f"block holds {read.numel()} {read.dtype} elements, "
                    f"layout needs {_HEADER_BYTES + nbytes} uint8"
                )
            flat = read.reshape(-1)
            if not torch.equal(flat[:_HEADER_BYTES], header):
                return failed(
                    "layout mismatch: the block was saved by an instance whose "
                    "KV layout differs from this one's"
                )
            self.copier.copy_in([block], flat[_HEADER_BYTES:].view(1, nbytes))
            return OK

        self._attach(source)
        pairs = list(zip(keys, block_ids, strict=True))  # unpaired: raise before any read
        # A key left unread failed as a peer that stopped answering does (the deadline
        # passed before its read began), or with the read that hung past it.
        unread = failed(f"deadline of {self.config.timeout_s} s passed")
        batch = _BatchRead(self.buffer, keys, deadline)
        if pairs and batch.wait_s > 0:
            try:
                bounded_call(batch, batch.wait_s, f"reading {len(keys)} blocks from the buffer")
            except TransferTimeout:  # the buffer hangs: the deadline is spent
                hung = batch.abandon()
                if hung is not None:
                    unread = failed(hung)
        outcomes: list[Outcome] = []
        for (_, block), read in zip(pairs, batch.reads, strict=False):  # reads may stop early
            try:
                outcomes.append(place(read, block))
            except TransferTimeout as exc:  # the buffer gave up: the deadline is spent
                outcomes.extend([failed(str(exc))] * (len(keys) - len(outcomes)))
                return outcomes
            except Exception as exc:  # one key's failure is that key's outcome
                outcomes.append(failed(str(exc)))
        outcomes.extend([unread] * (len(keys) - len(outcomes)))
        return outcomes

    def _header(self) -> torch.Tensor:
        digest = bytes.fromhex(self.copier.layout.fingerprint())
        return torch.frombuffer(bytearray(digest), dtype=torch.uint8)

    def _attach(self, source: Address | None) -> None:
        if source is not None and self.capabilities.p2p:
            self.buffer.connect(source)

    def health(self) -> Health:
        return self.buffer.health()

    def address(self) -> dict[str, Any] | None:
        return self.buffer.address()

    def close(self) -> None:
        self.buffer.close()


_HEADER_BYTES = 16
"""Length of the layout fingerprint in front of every block a BufferBackend stores."""

_Read = torch.Tensor | Exception | None
"""One key's read from a buffer: its tensor, None (the buffer lacks it), or what it raised."""


class _BatchRead:
    """A load's reads, key by key in order, all in one :func:`~kvmux.bounded.bounded_call`
    thread (one thread per load, not one per block).

    :attr:`reads` holds the reads that have completed. They stop at the deadline and
    after a read that timed out by itself. A caller that stops waiting calls
    :meth:`abandon`: from then on the thread starts no further read (a read
    consumes its block) and records nothing, so :attr:`reads` is final.
    """

    def __init__(self, buffer: LookupBuffer, keys: Sequence[BlockKey], deadline: float) -> None:
        self.buffer = buffer
        self.keys = keys
        self.deadline = deadline
        self.wait_s = deadline - time.monotonic()
        self.reads: list[_Read] = []
        self._lock = threading.Lock()
        self._abandoned = False
        self._reading: float | None = self.wait_s
        """While a read is under way (or the first is about to start): the wait it had."""

    def __call__(self) -> None:
        for key in self.keys:
            with self._lock:
                if self._abandoned or time.monotonic() >= self.deadline:
                    self._reading = None
                    return
                self._reading = self.deadline - time.monotonic()
            read: _Read
            try:
                read = self.buffer.drop_select(key, 0.0)
            except Exception as exc:  # one key's failure is that key's outcome
                read = exc
            with self._lock:
                self._reading = None
                if self._abandoned:  # too late: discarded, as an abandoned read is
                    return
                self.reads.append(read)
            if isinstance(read, TransferTimeout):  # the buffer gave up: the deadline is spent
                return

    def abandon(self) -> str | None:
        """Stop the reads where they are. Returns why the key being read failed, if a
        read is under way (it hung past the deadline); None if the reads had stopped."""
        with self._lock:
            self._abandoned = True
            if self._reading is None:
                return None
            key = self.keys[len(self.reads)]
            # The text a bounded_call of this one read would have raised.
            return f"reading {key.id} from the buffer took over {self._reading:.3g} s"
