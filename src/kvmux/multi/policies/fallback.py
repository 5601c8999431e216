"""``fallback``: composed hits and per-block fallback across children in order.

A lookup counts the longest prefix the children hold *between them*, so
blocks 0-9 may come from one child and 10-19 from another. A load takes
each block from the first child that delivers it: a block a child lacks,
fails, times out on or returns corrupt (behind ``checksum``) is asked of
the next child, and only what no child delivers is reported to the engine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvmux.backend import Address
from kvmux.capabilities import Capabilities
from kvmux.handle import OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.multi.policy import (
    Policy,
    PolicyOptions,
    composed_lookup,
    derive_capabilities,
    load_in_turn,
    save_to_all,
)


class FallbackOptions(PolicyOptions):
    save_to: Literal["all", "first"] = Field(
        "all",
        description="'all': every save goes to every child (any one can serve it later); "
        "'first': to the first child, and keys it fails to the next one",
    )


class FallbackPolicy(Policy):
    options_model = FallbackOptions
    options: FallbackOptions

    def capabilities(self) -> Capabilities:
        caps = [child.capabilities for child in self.children]
        # With save_to=first a block lands in whichever child took it: all must persist.
        persist = any if self.options.save_to == "all" else all
        return derive_capabilities(caps, persistent=persist(c.persistent for c in caps))

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        return composed_lookup(self.children, keys, source)

    def save(self, keys: list[BlockKey], block_ids: list[int], deadline: float) -> list[Outcome]:
        if self.options.save_to == "all":
            return save_to_all(self.children, keys, block_ids, deadline)
        return self._save_in_turn(keys, block_ids, deadline)

    def _save_in_turn(
        self, keys: list[BlockKey], block_ids: list[int], deadline: float
    ) -> list[Outcome]:
        reasons: list[list[str]] = [[] for _ in keys]
        pending = list(range(len(keys)))
        for child in self.children:
            if not pending:
                break
            ids = [block_ids[j] for j in pending]
            result = child.save([keys[j] for j in pending], ids, deadline)
            for j, outcome in zip(pending, result.outcomes, strict=True):
                if not outcome.ok:
                    reasons[j].append(outcome.reason or f"{child.label}: failed")
            pending = [j for j, o in zip(pending, result.outcomes, strict=True) if not o.ok]
        lost = set(pending)
        outcomes = [failed("; ".join(why)) if j in lost else OK for j, why in enumerate(reasons)]
        return outcomes

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]:
        return load_in_turn(self.children, keys, block_ids, source, deadline).outcomes
