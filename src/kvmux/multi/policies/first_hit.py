"""``first-hit``: vLLM's own MultiConnector behaviour, for drop-in compatibility.

vLLM asks its connectors in order and loads the whole request from the first
one reporting a hit; it saves to all of them. A failed block is not retried
elsewhere: the engine recomputes it. Pick ``fallback`` for more.
"""

from __future__ import annotations

from kvmux.backend import Address
from kvmux.handle import MISSING, Outcome
from kvmux.keys import BlockKey
from kvmux.multi.policy import Policy, save_to_all


class FirstHitPolicy(Policy):
    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        return next((n for child in self.children if (n := child.lookup(keys, source))), 0)

    def save(self, keys: list[BlockKey], block_ids: list[int], deadline: float) -> list[Outcome]:
        return save_to_all(self.children, keys, block_ids, deadline)

    def load(
        self, keys: list[BlockKey], block_ids: list[int], source: Address | None, deadline: float
    ) -> list[Outcome]:
        for child in self.children:
            if child.lookup(keys, source) > 0:
                result = child.load(keys, block_ids, source, deadline)
                return list(result.outcomes)
        return [MISSING] * len(keys)
