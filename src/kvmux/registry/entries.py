"""Reading the entry-point tables: names, owners, and whether a backend can load here.

Nothing in this module imports a backend. Availability is judged from package
metadata (are the entry point's extras installed?) and from whether the
backend's top-level package exists, so ``kvmux list`` stays fast even with
every heavy backend installed; ``load_check`` is the slow, honest check.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field, replace

from packaging.requirements import InvalidRequirement, Requirement

GROUPS: tuple[str, ...] = ("backends", "buffers", "pipes", "policies")
"""Short group names; the entry-point group is ``kvmux.<short>``."""

CONNECTOR_GROUPS: tuple[str, ...] = ("backends", "buffers", "pipes")
"""The groups a connector config may name: a backend by its bare name, a lookup
buffer or a pipe (bridged to a connector) as ``buffers:NAME`` / ``pipes:NAME``."""

OWN_DISTRIBUTION = "kvmux"


def entry_point_group(group: str) -> str:
    return f"kvmux.{group}"


@dataclass(frozen=True)
class BackendEntry:
    """One declared backend, as the packaging metadata describes it."""

    name: str
    group: str
    distribution: str
    version: str
    entry_point: md.EntryPoint = field(compare=False, repr=False)
    shadowed_by: str | None = None
    """Set when another distribution declares the same name and wins."""

    @property
    def value(self) -> str:
        """``module:object``, as the entry point declares it."""
        return self.entry_point.value

    @property
    def extras(self) -> tuple[str, ...]:
        """The distribution's extras the entry point needs (``name = mod:obj [extra]``)."""
        return tuple(self.entry_point.extras)

    @property
    def module(self) -> str:
        return self.value.partition(":")[0].strip()

    @property
    def qualified_name(self) -> str:
        return f"{self.group}:{self.name}"

    @property
    def config_name(self) -> str:
        """What a connector config's ``backend`` field says to pick this entry: the bare
        name for a backend, ``group:name`` for a buffer or pipe (nothing falls through)."""
        return self.name if self.group == CONNECTOR_GROUPS[0] else self.qualified_name

    def install_hint(self) -> str:
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"pip install '{self.distribution}{extras}'"

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot load here (with what to install), or None.

        Judged without importing the backend: the shadowing rule, the
        requirements of the entry point's extras, and the top-level package.
        """
        if self.shadowed_by is not None:
            return (
                f"name {self.name!r} is also declared by {self.shadowed_by!r}, which wins "
                f"(kvmux's own first, then distributions in alphabetical order)"
            )
        missing = [req for req in self._extra_requirements() if not _satisfied(req)]
        if missing:
            names = ", ".join(str(req) for req in missing)
            return f"needs {names} (not installed); install with: {self.install_hint()}"
        top = self.module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            return f"module {top!r} is not installed; install with: {self.install_hint()}"
        return None

    def _extra_requirements(self) -> list[Requirement]:
        if not self.extras:
            return []
        try:
            declared = md.requires(self.distribution) or []
        except md.PackageNotFoundError:
            return []
        wanted: list[Requirement] = []
        for line in declared:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is None:
                continue
            if any(req.marker.evaluate({"extra": extra}) for extra in self.extras):
                req.marker = None
                wanted.append(req)
        return wanted


def _satisfied(req: Requirement) -> bool:
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        return False
    return not req.specifier or req.specifier.contains(version, prereleases=True)


_scanned: dict[tuple[str, tuple[tuple[str, int], ...]], list[BackendEntry]] = {}


def scan(group: str) -> list[BackendEntry]:
    """Every entry declared in ``group``, sorted by name, shadowed ones included.

    Reading every distribution's metadata costs 20-60 ms beside vLLM's hundreds
    of dependencies, and a multi resolves a dozen names; so the answer is kept
    until ``sys.path`` or one of its directories changes (installing a package
    adds a ``.dist-info`` directory, which changes its parent's mtime).
    """
    key = (group, _path_signature())
    cached = _scanned.get(key)
    if cached is None:
        cached = _scanned[key] = _scan(group)
    return list(cached)


def _path_signature() -> tuple[tuple[str, int], ...]:
    def mtime(path: str) -> int:
        try:
            return os.stat(path or ".").st_mtime_ns
        except OSError:
            return -1

    return tuple((p, mtime(p)) for p in sys.path)


def _scan(group: str) -> list[BackendEntry]:
    by_name: dict[str, dict[str, BackendEntry]] = defaultdict(dict)
    for ep in md.entry_points(group=entry_point_group(group)):
        dist = ep.dist
        dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
        version = dist.version if dist is not None else "?"
        entry = BackendEntry(
            name=ep.name,
            group=group,
            distribution=dist_name,
            version=version,
            entry_point=ep,
        )
        # The same distribution seen twice on sys.path counts once.
        by_name[ep.name].setdefault(_canonical(dist_name), entry)
    out: list[BackendEntry] = []
    for name in sorted(by_name):
        claims = sorted(by_name[name].values(), key=_precedence)
        winner = claims[0]
        out.append(winner)
        out.extend(replace(loser, shadowed_by=winner.distribution) for loser in claims[1:])
    return out


def scan_all() -> list[BackendEntry]:
    return [entry for group in GROUPS for entry in scan(group)]


def _canonical(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def _precedence(entry: BackendEntry) -> tuple[int, str]:
    return (
        0 if _canonical(entry.distribution) == OWN_DISTRIBUTION else 1,
        _canonical(entry.distribution),
    )
