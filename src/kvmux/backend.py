"""Backend: the plugin interface, the part of a connector that moves bytes.

A backend stores and fetches blocks and nothing else. Everything every
backend would otherwise repeat lives in front of it, once: the
:class:`~kvmux.connector.Connector` checks arguments, and a
:class:`~kvmux.runner.Runner` runs each save and load as a
:class:`~kvmux.handle.Handle` (threads, deadlines, timing, byte counts,
stats). So a backend's methods are plain synchronous calls that return one
:class:`~kvmux.handle.Outcome` per key, and may assume:

* every argument is checked: keys are ``BlockKey``, none twice in a call,
  block ids in range and none twice, keys and ids pair up, lease ids are well
  formed, lists are never empty where it says so;
* ``register`` came first for ``save``/``load`` (``self.copier`` is set);
* no transfer or lookup is run after ``close`` (bookkeeping calls a
  composite passes on, ``release`` say, may still come: harmless ones).

An exception a ``save`` or ``load`` raises fails every key of that call (its
reason says why); a wrong number of outcomes does too. The bytes a transfer
moved are not the backend's to report: they are the ``ok`` keys times the
block size, so the runner counts them.

Threads: by default a transfer runs on one of the backend's :attr:`lanes`,
a FIFO queue per peer (:meth:`lane`; ``None``, the shared one, for local
work), so a hung peer holds up only the loads from it. A backend whose
local transfers are memory copies (``inline = True``) has those run in the
caller's thread instead: cheaper than any thread hop. A caller that waits
on a handle with no timeout runs a queued transfer itself, within its lane's
width (:meth:`kvmux.lanes.Lanes.run_here`). Background work a
backend needs for itself (a served pool telling a producer it is done with
a lease) goes on the same :attr:`lanes`, so it ends when the backend does.

Why a class of its own rather than hooks on the connector: composites
(``multi``, ``checksum``, the fault injectors) hold *backends*, and call
them directly with arguments their own front has already checked; they
neither re-validate nor reach past a public method into a private one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import LayoutError, NotRegisteredError
from kvmux.handle import Outcome
from kvmux.keys import BlockKey
from kvmux.lanes import Lanes
from kvmux.layout import KVLayout
from kvmux.stats import Stats

Address = Mapping[str, Any]
"""Where a peer reaches a P2P backend: JSON-able, carried between engine instances."""


@dataclass(frozen=True)
class Health:
    healthy: bool
    detail: str = ""


class Backend(ABC):
    """Stores and fetches blocks of registered KV memory under :class:`BlockKey` names.

    Subclasses implement ``lookup``, ``save`` and ``load``, and override the
    other methods where they hold more than stored blocks (pins, leases,
    servers). Contract as :class:`~kvmux.connector.Connector` states it,
    with the arguments already checked (see the module docstring).
    """

    config_model: ClassVar[type[BackendConfig]] = BackendConfig
    capabilities: Capabilities = Capabilities()
    """Class-level for most backends; bridges derive theirs per instance."""
    inline: ClassVar[bool] = False
    """True: transfers on the shared lane (``lane(source)`` None: local saves and
    loads) are memory copies cheaper than a thread hop; they run in the caller's
    thread and their handle is finished when ``save``/``load`` returns."""
    workers: ClassVar[int] = 2
    """Threads of the shared lane."""
    lane_width: ClassVar[int] = 4
    """Threads of each other lane (one per peer): see :mod:`kvmux.lanes`."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.counters = Stats()
        """The backend's own counters (errors it survived, say); reported in
        ``stats()`` beside the transfer counts the runner keeps here too."""
        self.lanes = Lanes(f"kvmux-{config.backend}")
        """Where its transfers run; threads start on first use and end with the
        work. The runner running this backend shuts them down after ``close``."""
        self.closed = False
        """Set (once) by the runner that closes it: after that, no call reaches it."""
        self._copier: BlockCopier | None = None

    @property
    def copier(self) -> BlockCopier:
        """The registered KV memory, with its layout (``copier.layout``)."""
        if self._copier is None:
            raise NotRegisteredError(
                f"{type(self).__name__}: call register() with the KV tensors first"
            )
        return self._copier

    @property
    def layout(self) -> KVLayout | None:
        """The registered layout, None before ``register``."""
        try:
            return self.copier.layout
        except NotRegisteredError:
            return None

    def attach(self, blocks: BlockCopier) -> None:
        """Called by the runner (:meth:`kvmux.runner.Runner.register`), not a hook:
        ``register``, then ``copier`` is ``blocks``. A ``register`` that raises
        leaves the backend unregistered."""
        self.register(blocks)
        self._copier = blocks

    def check_layout(self, layout: KVLayout) -> None:
        """Raise LayoutError for KV memory the capabilities refuse (memory kind,
        block size). A composite overrides it to name the child that refuses."""
        caps = self.capabilities
        if layout.device not in caps.memory_kinds:
            raise LayoutError(
                f"{type(self).__name__} cannot use {layout.device} memory "
                f"(supports {sorted(caps.memory_kinds)})"
            )
        if caps.max_block_nbytes is not None and layout.block_nbytes > caps.max_block_nbytes:
            raise LayoutError(
                f"block of {layout.block_nbytes} bytes exceeds {caps.max_block_nbytes}"
            )

    # ----------------------------------------------------------------- the plugin

    def register(self, blocks: BlockCopier) -> None:
        """Hook: the engine's KV memory (``blocks.layout``, checked against the
        capabilities); transports that pin, map or register memory do it here."""

    @abstractmethod
    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        """How many leading ``keys`` are here (or at the peer ``source``); never
        empty. Cheap, no side effects; a count out of range is clamped."""

    @abstractmethod
    def save(self, keys: list[BlockKey], block_ids: list[int]) -> Sequence[Outcome]:
        """Make blocks ``block_ids`` retrievable under ``keys``; once this returns,
        the caller may overwrite them (unless the backend borrows them: then once
        ``returned`` says so)."""

    @abstractmethod
    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> Sequence[Outcome]:
        """Fill blocks ``block_ids`` with what is stored under ``keys`` (here, or at
        the peer ``source``), by ``deadline`` (``time.monotonic()`` seconds, taken
        when the load was asked for: time spent queued counts)."""

    def returned(self, block_ids: list[int]) -> Future[None] | None:
        """Hook for backends that borrow blocks (``capabilities.borrows_blocks``),
        asked right after a save of ``block_ids``: a future done once those of them
        still lent are back with the engine, or None if none is. The save's handle
        ends with it."""
        return None

    def lane(self, source: Address | None) -> Hashable:
        """The lane a load from ``source`` runs on: ``None`` (the default, the
        shared lane) or a peer's endpoint. Called in the caller's thread, so an
        address it cannot parse may raise ``InvalidRequestError`` there."""
        return None

    def release(self, keys: list[BlockKey]) -> None:
        """Hook: free whatever ``keys`` hold beyond a normal stored block."""

    # A publication: the producer keeps a request's blocks for the consumer they
    # were published to (see kvmux.publications). Backends whose stored blocks
    # stay until released need none of it, hence the do-nothing defaults.

    def publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        """Hook: hold ``keys`` under ``lease`` for ``lease_s`` (see ``Connector.publish``)."""

    def renew(self, leases: list[str], source: Address | None) -> None:
        """Hook: extend ``leases`` here (``source`` None) or at the peer ``source``,
        without waiting on the peer (tell it on :attr:`lanes`); never empty."""

    def unpublish(self, leases: list[str], source: Address | None) -> None:
        """Hook: end ``leases`` here or at ``source``, as ``renew``."""

    def address(self) -> dict[str, Any] | None:
        """Where peers reach this instance (P2P backends), else None."""
        return None

    def health(self) -> Health:
        return Health(True)

    def stats(self) -> dict[str, float]:
        """Readings of the present (levels, declared in :data:`kvmux.stats.LEVELS`)
        and counters kept elsewhere than :attr:`counters`; merged over them."""
        return {}

    def close(self) -> None:
        """Hook: stop servers, unmap memory. Called once."""
