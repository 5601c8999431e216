"""multi compositions, and the checksum wrapper, pass the conformance suite.

Each composition is built through the registry from one config. The suite
passes ``capacity_bytes`` to test bounded backends; here it becomes the
children's bound (``fallback``, the ``checksum``'s inner backend) or every
tier's (``tiered``), so the capacity tests exercise eviction, demotion and
composed lookups too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvmux.registry.loader
from kvmux.registry import create_connector
from kvmux.registry.entries import scan
from kvmux.testing.configs import SUITE_TIMEOUT_S
from kvmux.testing.harness import ConnectorFactory
from kvmux.testing.suite import ConnectorSuite

POOL = 8 * 2**20

Compose = Callable[[Path, int | None], dict[str, Any]]


def _cpu(capacity: int | None) -> dict[str, Any]:
    return {"backend": "cpu", "capacity_bytes": capacity or POOL}


def _disk(tmp: Path, name: str) -> dict[str, Any]:
    return {"backend": "disk", "path": str(tmp / name)}


def fallback_cpu_cpu(tmp: Path, capacity: int | None) -> dict[str, Any]:
    return {"policy": "fallback", "children": [_cpu(capacity), _cpu(capacity)]}


def first_hit_cpu_disk(tmp: Path, capacity: int | None) -> dict[str, Any]:
    disk = {**_disk(tmp, "disk"), "capacity_bytes": capacity}
    return {"policy": "first-hit", "children": [_cpu(capacity), disk]}


def tiered_cpu_disk(tmp: Path, capacity: int | None) -> dict[str, Any]:
    tier = {"capacity_bytes": capacity or 4 * 2**20}
    return {
        "policy": "tiered",
        "children": [_cpu(None), _disk(tmp, "disk")],
        "tiers": [tier, {**tier, "eviction": "arc"}] if capacity else [tier],
    }


def nested(tmp: Path, capacity: int | None) -> dict[str, Any]:
    """fallback over [tiered write-through over two cpu pools, disk]."""
    inner = {
        "backend": "multi",
        "policy": "tiered",
        "write": "through",
        "children": [_cpu(capacity), _cpu(capacity)],
        "tiers": [{"capacity_blocks": 4}],
    }
    disk = {**_disk(tmp, "disk"), "capacity_bytes": capacity}
    return {"policy": "fallback", "children": [inner, disk]}


def checksum_cpu(tmp: Path, capacity: int | None) -> dict[str, Any]:
    return {"backend": "checksum", "inner": _cpu(capacity)}


def checksum_disk(tmp: Path, capacity: int | None) -> dict[str, Any]:
    disk = {**_disk(tmp, "disk"), "capacity_bytes": capacity}
    return {"backend": "checksum", "inner": disk, "algorithm": "blake2b"}


def checksum_unchecked_disk(tmp: Path, capacity: int | None) -> dict[str, Any]:
    """The wrapper alone answers for the disk's files: the disk's own digest is off."""
    disk = {**_disk(tmp, "disk"), "capacity_bytes": capacity, "checksum": False}
    return {"backend": "checksum", "inner": disk}


COMPOSITIONS: dict[str, Compose] = {
    "fallback[cpu,cpu]": fallback_cpu_cpu,
    "first-hit[cpu,disk]": first_hit_cpu_disk,
    "tiered[cpu,disk]": tiered_cpu_disk,
    "fallback[tiered[cpu,cpu],disk]": nested,
    "checksum[cpu]": checksum_cpu,
    "checksum[disk]": checksum_disk,
    "checksum[unchecked disk]": checksum_unchecked_disk,
}


@pytest.fixture(scope="module", autouse=True)
def _entry_points_read_once() -> Iterator[None]:
    """Each registry lookup re-reads every installed distribution's entry points
    (tens of ms in a large environment), and a multi config looks up each child
    and its policy: ten times this module's run time. Nothing is installed while
    it runs, so read them once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kvmux.registry.loader, "scan", functools.cache(scan))
        yield


def suite_factory(compose: Compose, tmp_path: Path) -> ConnectorFactory:
    """A factory for the suite; ``capacity_bytes`` goes to the children (see above)."""

    def factory(**overrides: Any) -> Any:
        capacity = overrides.pop("capacity_bytes", None)
        config = {"backend": "multi", "timeout_s": SUITE_TIMEOUT_S, **compose(tmp_path, capacity)}
        return create_connector({**config, **overrides})

    return factory


@pytest.fixture(scope="module", params=sorted(COMPOSITIONS))
def composition(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


class TestComposition(ConnectorSuite):
    @pytest.fixture
    def connector_factory(self, composition: str, tmp_path: Path) -> ConnectorFactory:
        return suite_factory(COMPOSITIONS[composition], tmp_path)
