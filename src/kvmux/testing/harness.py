"""The harness a conformance test drives a backend through.

A backend is given to the suite as one *factory* (``factory(**config_overrides)
-> Backend``, or a Connector over one): each call builds a fresh, unregistered
instance from the same config, so the suite can open a second end for P2P backends and reopen the
same storage for persistent ones. The harness turns that factory into
:class:`Pair` objects, hiding the one difference that matters to a test:

* a local backend saves and loads on **one** instance and loads with
  ``source=None``;
* a P2P backend saves on a *producer* and loads on a separate *consumer*
  with ``source = producer.address()`` (passed through JSON, as it travels
  between engine instances in vLLM's ``kv_transfer_params``).

Tests therefore save from ``pair.src`` memory and load into ``pair.dst``
memory, which are one object for local backends and two for P2P ones.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import pytest
import torch

from kvmux.backend import Backend
from kvmux.capabilities import Capabilities
from kvmux.connector import Address, Connector
from kvmux.errors import TransferTimeout
from kvmux.handle import Handle, Status, TransferResult
from kvmux.keys import BlockKey
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory, LayoutCase, assert_blocks_equal, seed_from

ConnectorFactory = Callable[..., Backend | Connector]
"""``factory(**config_overrides) -> Backend``: a fresh instance on the same config
(the harness puts a :class:`Connector` in front; a factory may return one itself,
as ``create_connector`` does).

The only override the suite passes is ``capacity_bytes`` (capacity tests); a
factory that cannot honour it may raise ``TypeError`` or ``ConfigError`` and
those tests are skipped, naming the field.
"""

ConnectorT = TypeVar("ConnectorT", bound=Connector)

GRACE_S = 5.0
"""How far past a connector's ``timeout_s`` the suite waits before calling a transfer hung."""

NAMESPACE = "kvmux-suite"


def finish(handle: Handle, bound_s: float, what: str, *, saved: bool = False) -> TransferResult:
    """The handle's result, failing the test if it is not ready within ``bound_s``;
    with ``saved``, a save's outcome (:meth:`Handle.saved`): a backend that borrows
    blocks ends the handle itself only once they are given back."""
    try:
        result = handle.saved(bound_s) if saved else handle.result(timeout=bound_s)
    except TransferTimeout:
        pytest.fail(
            f"{what} of {len(handle.keys)} blocks did not finish within {bound_s:.1f} s: "
            "every key must end ok, missing or failed within config.timeout_s, never hang"
        )
    assert result.keys == handle.keys, f"{what}: result keys differ from the keys asked for"
    assert len(result.outcomes) == len(result.keys), f"{what}: one outcome per key expected"
    return result


def summary(result: TransferResult) -> str:
    """``"3 ok, 1 missing, 0 failed"`` plus the first failure's reason, for assertion messages."""
    counts = {s: len(result.by_status(s)) for s in Status}
    text = ", ".join(f"{n} {s.value}" for s, n in counts.items())
    failures = [o.reason for _, o in result.not_ok if o.status is Status.FAILED]
    return text + (f" (first failure: {failures[0]})" if failures else "")


def describe(obj: object) -> str:
    """``TcpBackend``, or for bridges and wrappers what they wrap:
    ``BufferBackend(PipeLookupBuffer(TcpPipe))``; a connector by its backend."""
    if isinstance(obj, Connector):
        return describe(obj.backend)
    for attr in ("buffer", "pipe", "inner"):
        inner = getattr(obj, attr, None)
        if inner is not None:
            return f"{type(obj).__name__}({describe(inner)})"
    return type(obj).__name__


@dataclass
class Pair:
    """The two ends of a transfer: ``saver`` with ``src`` memory, ``loader`` with ``dst``."""

    saver: Connector
    loader: Connector
    src: KVMemory
    dst: KVMemory
    source: Address | None
    bound_s: float

    def through(self, loader: Connector) -> Pair:
        """This pair, loading through ``loader`` (a fault-injecting wrapper of ours)."""
        return replace(self, loader=loader)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        return self.loader.lookup(keys, self.source)

    def save(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> TransferResult:
        return finish(self.saver.save(keys, block_ids), self.bound_s, "save", saved=True)

    def load(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> TransferResult:
        return finish(self.loader.load(keys, block_ids, self.source), self.bound_s, "load")

    def save_all(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> torch.Tensor:
        """Save and require every key ok; returns the bytes saved (the expected load)."""
        expected = self.src.blocks(list(block_ids))
        result = self.save(keys, block_ids)
        assert result.ok, f"save of {len(keys)} blocks: {summary(result)}"
        return expected

    def load_and_verify(
        self,
        keys: Sequence[BlockKey],
        block_ids: Sequence[int],
        expected: torch.Tensor,
        allow: frozenset[Status] = frozenset({Status.OK}),
    ) -> TransferResult:
        """Load into ``block_ids`` and check every key against the contract.

        An ``ok`` block must hold exactly ``expected``'s row; a ``missing``
        block must be untouched; only statuses in ``allow`` are accepted.
        """
        before = self.dst.blocks(list(block_ids))
        result = self.load(keys, block_ids)
        statuses = {o.status for o in result.outcomes}
        assert statuses <= allow, (
            f"load of {len(keys)} blocks: {summary(result)}; allowed: "
            f"{sorted(s.value for s in allow)}"
        )
        after = self.dst.blocks(list(block_ids))
        labels = [
            f"block {b} (key #{i}, {o.status.value})"
            for i, (b, o) in enumerate(zip(block_ids, result.outcomes, strict=True))
        ]
        ok = [i for i, o in enumerate(result.outcomes) if o.status is Status.OK]
        missing = [i for i, o in enumerate(result.outcomes) if o.status is Status.MISSING]
        if ok:
            assert_blocks_equal(
                after[ok], expected[ok], [labels[i] for i in ok], "blocks loaded ok"
            )
        if missing:
            assert_blocks_equal(
                after[missing],
                before[missing],
                [labels[i] for i in missing],
                "blocks of missing keys must be left untouched",
            )
        return result


@dataclass
class Harness:
    """Opens connectors from one factory for one test and closes them all afterwards."""

    factory: ConnectorFactory
    device: str = "cpu"
    test_id: str = ""
    _opened: list[Connector] = field(default_factory=list)
    _spare: Connector | None = None
    _capabilities: Capabilities | None = None
    _memories: itertools.count[int] = field(default_factory=itertools.count)
    _salt: bytes = field(default_factory=lambda: uuid.uuid4().bytes)

    @property
    def capabilities(self) -> Capabilities:
        """What the backend declares, read from a live instance (bridges decide per
        instance); that instance is kept as the next one ``open()`` returns."""
        if self._capabilities is None:
            self._spare = self._build({})
            self._capabilities = self._spare.capabilities
        return self._capabilities

    @property
    def backend_label(self) -> str:
        """Names the backend in skip messages, bridges with what they wrap."""
        conn = self._spare or (self._opened[0] if self._opened else None)
        return describe(conn) if conn is not None else "the backend"

    def open(self, **overrides: Any) -> Connector:
        """A fresh, unregistered connector (config fields replaced by ``overrides``)."""
        if self._spare is not None:
            spare, self._spare = self._spare, None
            if not overrides:
                return spare
            spare.close()  # two differently configured instances on one store could clash
        return self._build(overrides)

    def _build(self, overrides: dict[str, Any]) -> Connector:
        made = self.factory(**overrides)
        conn = Connector(made) if isinstance(made, Backend) else made
        assert isinstance(conn, Connector), f"factory returned {made!r}, not a Backend"
        return self.track(conn)

    def track(self, conn: ConnectorT) -> ConnectorT:
        """Close ``conn`` (a wrapper, say) with the others when the test ends."""
        self._opened.append(conn)
        return conn

    def memory(self, case: LayoutCase = DEFAULT_LAYOUT, num_blocks: int = 16) -> KVMemory:
        """KV tensors full of random bytes, different for every call."""
        seed = seed_from(f"{self.test_id}#{next(self._memories)}")
        return KVMemory(case, num_blocks, self.device, seed)

    def pair(
        self,
        case: LayoutCase = DEFAULT_LAYOUT,
        num_blocks: int = 16,
        *,
        saver: Connector | None = None,
        **overrides: Any,
    ) -> Pair:
        """A registered saver and loader (one instance unless the backend is P2P)."""
        saver = saver if saver is not None else self.open(**overrides)
        src = self.memory(case, num_blocks)
        saver.register(src.layout, src.caches)
        if not saver.capabilities.p2p:
            return Pair(saver, saver, src, src, None, saver.config.timeout_s + GRACE_S)
        address = saver.address()
        assert address is not None, "a p2p backend must return its address() for consumers"
        source = json.loads(json.dumps(address))  # it travels between instances as JSON
        loader = self.open(**overrides)
        dst = self.memory(case, num_blocks)
        loader.register(dst.layout, dst.caches)
        bound = max(saver.config.timeout_s, loader.config.timeout_s) + GRACE_S
        return Pair(saver, loader, src, dst, source, bound)

    def keys(self, n: int) -> list[BlockKey]:
        """``n`` chained keys no other test (or earlier run on the same store) uses."""
        out: list[BlockKey] = []
        parent: BlockKey | None = None
        for i in range(n):
            parent = BlockKey.child(parent, self._salt + i.to_bytes(4, "little"), NAMESPACE)
            out.append(parent)
        self._salt = uuid.uuid4().bytes
        return out

    def close(self) -> None:
        """Close every connector opened (consumers first); re-raise the first error."""
        error: BaseException | None = None
        for conn in reversed(self._opened):
            try:
                conn.close()
            except Exception as exc:  # close the rest, then report the first
                error = error or exc
        self._opened.clear()
        self._spare = None
        if error is not None:
            raise error
