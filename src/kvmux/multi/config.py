"""The ``multi`` config: a policy, its children's configs and the policy's own options.

``{"backend": "multi", "policy": "tiered", "children": [{"backend": "cpu"},
{"backend": "disk", "path": "/kv"}], "write": "back"}``. Everything is
checked when the config is validated, before any child is built: each child
against its own backend's model (through the registry, so a problem reads
``children.1.path``), the policy's options against the policy's model, and
the composition against the policy's rules (with the capabilities the child
backends declare). Policy options sit at the top level so a config reads
flat; only the chosen policy's fields are accepted there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path, PurePath
from typing import Any

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import BackendUnavailableError, ConfigProblem, UnknownBackendError
from kvmux.multi.breaker import BreakerConfig
from kvmux.multi.policy import ChildSpec, Policy, PolicyOptions, Problem
from kvmux.problems import as_validation_error, dotted, problems_of
from kvmux.registry.loader import NestedConfig, check_kind, load_class, resolve


class MultiConfig(BackendConfig):
    model_config = ConfigDict(extra="allow", frozen=True)

    backend: str = "multi"
    policy: str = Field(
        description="how children are used: a name in the kvmux.policies group "
        "(built in: first-hit, fallback, tiered); its options go at the top level"
    )
    children: list[NestedConfig] = Field(
        min_length=1, description="backend configs, in the policy's order (tiers: top first)"
    )
    breaker: BreakerConfig = Field(
        default_factory=BreakerConfig, description="per-child circuit breaker"
    )

    _policy: type[Policy] | None = PrivateAttr(None)
    _options: PolicyOptions | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_composition(self) -> MultiConfig:
        try:
            policy = load_policy(self.policy)
        except (UnknownBackendError, BackendUnavailableError) as exc:
            raise _invalid([("policy", _policy_problem(exc), self.policy)]) from None
        try:
            options = policy.options_model.model_validate(self.model_extra or {})
        except ValidationError as exc:
            raise _invalid(problems_of(exc)) from None
        specs = [ChildSpec(i, c, partial(_declared, c)) for i, c in enumerate(self.children)]
        problems = _shared_paths(self.children) + _borrowing(self.children)
        problems += policy.check(options, specs)
        if problems:
            raise _invalid(
                [(dotted(where), what, self._value_at(where)) for where, what in problems]
            )
        self._policy, self._options = policy, options
        return self

    def policy_type(self) -> type[Policy]:
        """The chosen policy's class (found once, when the config was validated)."""
        if self._policy is None:
            self._policy = load_policy(self.policy)
        return self._policy

    def policy_options(self) -> PolicyOptions:
        """The chosen policy's options, parsed from this config's extra fields."""
        if self._options is None:
            self._options = self.policy_type().options_model.model_validate(self.model_extra or {})
        return self._options

    def _value_at(self, where: tuple[str | int, ...]) -> Any:
        """The config value a problem points at, as the user wrote it (for the message)."""
        value: Any = self.model_dump(mode="json")
        for part in where:
            try:
                value = value[part]
            except (KeyError, IndexError, TypeError):
                return None
        return value


def load_policy(name: str) -> type[Policy]:
    """The policy called ``name`` (entry-point group ``kvmux.policies``), imported on
    first use; UnknownBackendError with a did-you-mean otherwise."""
    entry = resolve(name, ("policies",))
    policy: type[Policy] = check_kind(entry, load_class(entry), Policy)
    return policy


def _policy_problem(exc: UnknownBackendError | BackendUnavailableError) -> str:
    if isinstance(exc, BackendUnavailableError):
        return str(exc)
    hint = f" Did you mean {exc.suggestion!r}?" if exc.suggestion else ""
    return f"unknown policy {exc.name!r}.{hint} Known: {', '.join(exc.known) or '(none)'}."


def _declared(config: BackendConfig) -> Capabilities:
    """A child's capabilities as its backend class declares them (a buffer or pipe
    behind a bridge gives each block away on load)."""
    entry = resolve(config.backend)
    caps: Capabilities = getattr(load_class(entry), "capabilities", Capabilities())
    if entry.group != "backends":
        caps = replace(caps, consumes_on_load=True)
    return caps


def _shared_paths(children: Sequence[BackendConfig]) -> list[Problem]:
    """Two children on one directory would be one store counted twice."""
    problems: list[Problem] = []
    owner: dict[Path, int] = {}
    for i, child in enumerate(children):
        for path in set(_paths(child)):
            if path in owner:
                problems.append(
                    (
                        ("children", i),
                        f"uses {path}, as child {owner[path]} does: one store "
                        "cannot be two children",
                    )
                )
            owner.setdefault(path, i)
    return problems


def _borrowing(children: Sequence[BackendConfig]) -> list[Problem]:
    """A child that borrows the engine's blocks ends each save only once its blocks
    are given back, and a composition waits for every child's save to end."""
    return [
        (
            ("children", i),
            "borrows the engine's blocks (save_mode=borrow): a composition cannot wait "
            "for its saves; give it save_mode=copy",
        )
        for i, child in enumerate(children)
        if child.borrows_blocks
    ]


def _paths(config: BackendConfig) -> Iterator[Path]:
    for name in type(config).model_fields:
        yield from _paths_in(getattr(config, name))


def _paths_in(value: Any) -> Iterator[Path]:
    if isinstance(value, PurePath):
        yield Path(value).resolve()
    elif isinstance(value, BackendConfig):
        yield from _paths(value)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _paths_in(item)


def _invalid(problems: Sequence[ConfigProblem]) -> ValidationError:
    return as_validation_error("multi config", problems)
