"""One error hierarchy for everything kvmux raises.

Errors are part of the interface: each one carries what the caller needs to fix
the problem (the known names, the pydantic path, the package to install), so
the message alone is enough to act on.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

ConfigProblem = tuple[str, str, Any]
"""``(path, message, value)``: one field of a config that does not validate; ``path``
is dotted (``children.1.capacity_bytes``), empty for the config as a whole."""


class KvmuxError(Exception):
    """Base class of every error kvmux raises on purpose."""


class UnknownBackendError(KvmuxError, LookupError):
    """A name that no installed distribution declares in the group asked for."""

    def __init__(
        self, name: str, group: str, known: Iterable[str], suggestion: str | None = None
    ) -> None:
        """``known`` is listed in the order given (group by group); ``suggestion``
        overrides the closest known name (the same name in another group, which has
        to be asked for explicitly)."""
        self.name = name
        self.group = group
        self.known = list(dict.fromkeys(known))
        close = difflib.get_close_matches(name, self.known, n=1, cutoff=0.6)
        self.suggestion = suggestion or (close[0] if close else None)
        hint = f" Did you mean {self.suggestion!r}?" if self.suggestion else ""
        names = ", ".join(self.known) or "(none installed)"
        super().__init__(f"unknown backend {name!r} (looked in {group}).{hint} Known: {names}.")


class BackendUnavailableError(KvmuxError, ImportError):
    """A declared backend whose code or dependencies cannot be imported here."""

    def __init__(self, name: str, group: str, reason: str) -> None:
        self.name = name
        self.group = group
        self.reason = reason
        super().__init__(f"{group} backend {name!r} is unavailable: {reason}")


class ConfigError(KvmuxError, ValueError):
    """A backend config that does not validate; names the backend, field path and value."""

    def __init__(self, backend: str | None, problems: list[ConfigProblem]) -> None:
        self.backend = backend
        self.problems = problems
        where = f"backend {backend!r}" if backend else "kvmux config"
        lines = [f"  {path or '<root>'}: {msg} (got {value!r})" for path, msg, value in problems]
        super().__init__(f"invalid config for {where}:\n" + "\n".join(lines))


class LayoutError(KvmuxError, ValueError):
    """KV memory that does not match the registered layout, or two layouts that differ."""


class NotRegisteredError(KvmuxError, RuntimeError):
    """A transfer was asked of a connector before ``register`` gave it KV memory."""


class ClosedError(KvmuxError, RuntimeError):
    """An operation on a connector, buffer or pipe that was already closed."""


class TransferError(KvmuxError):
    """A transfer that could not complete (peer gone, I/O error)."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer or wait that ran past its deadline."""


class ProtocolError(TransferError):
    """A peer sent a frame that is garbage, truncated, oversized or unexpected."""


class PeerRestartedError(TransferError):
    """The process at a peer's address is not the one that published the blocks asked
    for (it restarted, or another took its port): those blocks are gone."""


class IncompatiblePeerError(KvmuxError):
    """A peer whose blocks are not this instance's KV: another model, dtype, tensor-
    parallel shard or protocol version. The message names the field that differs."""


class CapacityError(KvmuxError):
    """A block that can never fit in the backend, whatever is evicted."""


class InvalidRequestError(KvmuxError, ValueError):
    """A call whose arguments contradict each other (lengths, ranges, duplicates)."""


class StorageError(KvmuxError, OSError):
    """A store's directory or files that cannot be written (a full disk, an I/O error);
    the message names the path and the operating system's reason."""
