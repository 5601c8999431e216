"""A peer as a consumer sees it: the parts of its ``address()`` used to reach it.

Each instance has a random *incarnation*, in its ``address()`` and in every
handshake: a consumer holding the address of an instance that has since died
and been replaced on the same port fails those keys at once, saying so, and
its next pull with the new address works (the dead peer's links, mapped
segments and agents are dropped). The address also carries the instance's
compatibility fingerprint (:mod:`kvmux.compat`), so an engine can tell before
asking that a producer runs another model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmux.backend import Address
from kvmux.errors import InvalidRequestError, TransferError
from kvmux.handle import Outcome


class PeerAddress(BaseModel):
    """The parts of an ``address()`` a consumer uses; other fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    host: str
    port: int = Field(ge=1, le=65535)
    host_id: str | None = None
    incarnation: str | None = Field(None, max_length=64)
    """The instance that published; any other at this endpoint no longer has its blocks."""
    unix: str | None = Field(None, max_length=100, pattern=r"^kvmux-[a-z]+-[0-9a-f]+$")
    """The abstract Unix socket a consumer on the peer's host dials first
    (:mod:`kvmux.net.local`); a name that does not answer means TCP."""

    @classmethod
    def parse(cls, address: Address) -> PeerAddress:
        try:
            return cls.model_validate(dict(address))
        except (TypeError, ValueError, ValidationError) as exc:
            raise InvalidRequestError(f"not a peer address: {address!r} ({exc})") from None

    @property
    def endpoint(self) -> tuple[str, int]:
        return (self.host, self.port)


class PullInterrupted(TransferError):
    """A pull that broke off midway: ``outcomes`` are final for the first keys of
    the batch (those that arrived whole), the rest fail with this error."""

    def __init__(self, message: str, outcomes: list[Outcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes
