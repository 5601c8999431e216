"""``multi``: one backend made of several, with a pluggable policy.

The MultiBackend owns its children and everything that does not depend
on the policy: building them from the config, checking at ``register``
that each can hold the engine's KV memory (naming the child that cannot),
isolating every child call (:class:`~kvmux.multi.child.Child`: exceptions
and overrun deadlines become per-key failures, a circuit breaker skips a
sick child), the overall deadline, and per-child stats. The policy
(:mod:`kvmux.multi.policy`) decides where each key goes and comes from.

Stats are flat floats, ready for Prometheus: the multi's own counters,
``child.<i>.<counter>`` (see :data:`kvmux.multi.child.COUNTERS`),
``child.<i>.breaker_state`` (0 closed, 1 half-open, 2 open), the child's own
stats as ``child.<i>.backend.<name>``, and the policy's (``tier.<i>.blocks``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Hashable, Sequence
from typing import Any

from kvmux.backend import Address, Backend, Health
from kvmux.blocks import BlockCopier
from kvmux.errors import ConfigError, KvmuxError, LayoutError
from kvmux.handle import Outcome
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.multi.child import Child
from kvmux.multi.config import MultiConfig
from kvmux.multi.policy import ChildSpec
from kvmux.registry.factory import create_backend
from kvmux.registry.loader import parse_config
from kvmux.runner import Runner


class MultiBackend(Backend):
    """Children composed by a policy. Its capabilities are what the composition promises."""

    config_model = MultiConfig
    config: MultiConfig
    workers = 8
    """Transfers mostly wait on children; several may be in flight at once."""
    lane_width = 8
    """Loads from one ``source`` share a lane of their own: a hung peer below a child
    never holds up the local loads of the shared lane."""

    def __init__(self, config: MultiConfig, children: Sequence[Backend] | None = None) -> None:
        """Build the children from ``config``, or adopt ``children`` (already built, in
        config order: fault wrappers in tests, or backends shared with other code)."""
        super().__init__(config)
        policy, options = config.policy_type(), config.policy_options()
        backends = list(children) if children is not None else _build(config)
        self.children = [Child(i, b, config.breaker) for i, b in enumerate(backends)]
        problems = policy.check(options, [ChildSpec.built(child) for child in self.children])
        if problems:
            if children is None:  # ours to close; adopted ones stay their owner's
                for child in self.children:
                    child.close()
            raise ConfigError(
                config.backend,
                [(".".join(str(p) for p in where), what, None) for where, what in problems],
            )
        self.policy = policy(options, self.children)
        self.capabilities = self.policy.capabilities()

    @classmethod
    def of(cls, policy: str, children: Sequence[Backend], **options: Any) -> MultiBackend:
        """A multi over live backends: ``MultiBackend.of("fallback", [a, b])``."""
        data = {"backend": "multi", "policy": policy, "children": [c.config for c in children]}
        _, _, config = parse_config({**data, **options})
        assert isinstance(config, MultiConfig)
        return cls(config, children)

    def check_layout(self, layout: KVLayout) -> None:
        """Refuse, naming the child, KV memory one of the children cannot hold."""
        for child in self.children:
            caps = child.capabilities
            if layout.device not in caps.memory_kinds:
                raise LayoutError(
                    f"{child.label} cannot use {layout.device} memory "
                    f"(supports {sorted(caps.memory_kinds)})"
                )
            limit = caps.max_block_nbytes
            if limit is not None and layout.block_nbytes > limit:
                raise LayoutError(
                    f"{child.label} holds blocks of at most {limit} bytes; "
                    f"this layout's are {layout.block_nbytes}"
                )
        super().check_layout(layout)

    def register(self, blocks: BlockCopier) -> None:
        self.policy.register(blocks.layout, blocks.caches)

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        return self.policy.lookup(keys, source)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        return self.policy.save(keys, block_ids, time.monotonic() + self.config.timeout_s)

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> list[Outcome]:
        return self.policy.load(keys, block_ids, source, deadline)

    def lane(self, source: Address | None) -> Hashable:
        return None if source is None else json.dumps(source, sort_keys=True, default=str)

    def release(self, keys: list[BlockKey]) -> None:
        self.policy.release(keys)

    def publish(self, keys: list[BlockKey], lease: str, lease_s: float) -> None:
        for child in self.children:  # each holds what it has of them
            child.publish(keys, lease, lease_s)

    def renew(self, leases: list[str], source: Address | None) -> None:
        for child in self.children:
            child.renew(leases, source)

    def unpublish(self, leases: list[str], source: Address | None) -> None:
        for child in self.children:
            child.unpublish(leases, source)

    def address(self) -> dict[str, Any] | None:
        """``{"children": [address or None, ...]}`` when a child is reachable by peers;
        a load with this as ``source`` gives each child its own part."""
        parts = [child.backend.address() for child in self.children]
        return {"children": parts} if any(p is not None for p in parts) else None

    def health(self) -> Health:
        """Healthy while one child is: the policy routes around the others."""
        sick = []
        for child in self.children:
            try:
                health = child.health()
            except Exception as exc:
                health = Health(False, f"health() raised {type(exc).__name__}: {exc}")
            if not health.healthy:
                sick.append(f"{child.label}: {health.detail or 'unhealthy'}")
        detail = "; ".join(sick)
        return Health(len(sick) < len(self.children), detail)

    def stats(self) -> dict[str, float]:
        out = self.policy.stats()
        for child in self.children:
            out.update(child.stats())
        return out

    def close(self) -> None:
        for child in self.children:
            child.close()


def _build(config: MultiConfig) -> list[Backend]:
    """The children, built through the registry; on a failure the ones already
    built are closed and the error names the child."""
    built: list[Backend] = []
    for i, child in enumerate(config.children):
        try:
            built.append(create_backend(child))
        except KvmuxError as exc:
            for done in built:
                Runner(done).close()
            if isinstance(exc, ConfigError):
                problems = [(f"children.{i}.{p}".rstrip("."), m, v) for p, m, v in exc.problems]
                raise ConfigError(config.backend, problems) from exc
            raise ConfigError(config.backend, [(f"children.{i}", str(exc), None)]) from exc
    return built
