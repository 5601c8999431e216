"""A composition is validated up front; every error names the child and the reason."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvmux.backend import Backend
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.connector import Connector
from kvmux.errors import CapacityError, ConfigError, LayoutError, UnknownBackendError
from kvmux.multi.backend import MultiBackend
from kvmux.multi.config import load_policy
from kvmux.registry import create_connector, parse_config, scan
from kvmux.registry.loader import config_model_for
from kvmux.testing.faults import FaultWrapper
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory

CPU = {"backend": "cpu"}


def multi(policy: str, *children: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {"backend": "multi", "policy": policy, "children": list(children), **options}


def refused(config: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(config)
    assert info.value.backend == config["backend"]
    return str(info.value)


def test_a_childs_bad_field_is_reported_with_its_index_and_path() -> None:
    message = refused(multi("fallback", CPU, {"backend": "cpu", "capacity_bytes": -5}))
    assert "children.1.capacity_bytes: Input should be greater than 0 (got -5)" in message


def test_errors_in_nested_multis_carry_the_whole_path() -> None:
    inner = multi("tiered", CPU, {"backend": "dsk"})
    message = refused(multi("fallback", CPU, inner))
    assert "children.1.children.1.backend: unknown backend 'dsk'" in message
    assert "Did you mean 'disk'?" in message


def test_an_unknown_policy_gets_a_did_you_mean() -> None:
    message = refused(multi("fallbak", CPU))
    assert "policy: unknown policy 'fallbak'. Did you mean 'fallback'?" in message
    with pytest.raises(UnknownBackendError):
        load_policy("tierd")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (multi("fallback"), "children: List should have at least 1 item"),
        (multi("fallback", CPU, write="back"), "write: Extra inputs are not permitted"),
        (multi("tiered", CPU, write="sideways"), "write: Input should be 'back' or 'through'"),
        (multi("tiered", CPU, tiers=[{}, {}]), "tiers: 2 tiers configured for 1 children"),
        (multi("tiered", CPU, tiers=[{"eviction": "mru"}]), "unknown eviction policy 'mru'"),
        (multi("tiered", CPU, CPU, staging_blocks=1), "staging_blocks: write-back needs"),
        (multi("fallback", CPU, breaker={"failures": 0}), "breaker.failures"),
    ],
    ids=["empty", "other-policys-option", "bad-option", "tiers", "eviction", "staging", "breaker"],
)
def test_bad_policy_options_are_refused(config: dict[str, Any], expected: str) -> None:
    assert expected in refused(config)


def test_two_children_on_one_directory_are_refused(tmp_path: Path) -> None:
    disk = {"backend": "disk", "path": str(tmp_path / "kv")}
    again = {"backend": "disk", "path": str(tmp_path / "kv" / ".." / "kv")}
    message = refused(multi("fallback", disk, again))
    assert f"children.1: uses {tmp_path / 'kv'}, as child 0 does" in message


def test_tiered_refuses_a_child_that_gives_blocks_away_on_load() -> None:
    message = refused(multi("tiered", CPU, {"backend": "pipes:tcp"}))
    assert "children.1: 'pipes:tcp' gives a block away when it is loaded" in message


def test_the_checksum_wrappers_inner_config_is_checked_in_place() -> None:
    message = refused({"backend": "checksum", "inner": {"backend": "cpu", "capacity_bytes": 0}})
    assert "inner.capacity_bytes" in message


def test_a_child_that_cannot_be_built_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as info:
        create_connector(multi("fallback", CPU, {"backend": "disk", "path": str(blocker / "kv")}))
    assert "children.1.path: not a writable directory" in str(info.value)


class Declares(FaultWrapper):
    """A child that declares other capabilities than its inner backend's."""

    def __init__(self, inner: Backend, **capabilities: Any) -> None:
        super().__init__(inner)
        self.capabilities = replace(inner.capabilities, **capabilities)


def pool() -> Backend:
    return CpuPoolBackend(CpuPoolConfig(capacity_bytes=2**20))


def test_a_built_child_that_gives_blocks_away_is_refused_by_tiered() -> None:
    with pytest.raises(ConfigError) as info:
        Connector(MultiBackend.of("tiered", [pool(), Declares(pool(), consumes_on_load=True)]))
    assert "children.1: 'cpu' gives a block away" in str(info.value)


@pytest.mark.parametrize(
    ("capabilities", "expected"),
    [
        ({"memory_kinds": frozenset({"cuda"})}, "child 1 (cpu) cannot use cpu memory"),
        ({"max_block_nbytes": 64}, "child 1 (cpu) holds blocks of at most 64 bytes"),
    ],
    ids=["memory-kind", "block-size"],
)
def test_register_refuses_memory_a_child_cannot_hold(
    capabilities: dict[str, Any], expected: str
) -> None:
    composed = Connector(MultiBackend.of("fallback", [pool(), Declares(pool(), **capabilities)]))
    memory = KVMemory(DEFAULT_LAYOUT, 8, "cpu", seed=1)
    with pytest.raises(LayoutError, match=re.escape(expected)):
        composed.register(memory.layout, memory.caches)
    composed.close()


def test_capacity_a_tier_cannot_use_is_refused_at_register() -> None:
    tiny = {"capacity_bytes": DEFAULT_LAYOUT.block_nbytes - 1}
    composed = Connector(MultiBackend.of("tiered", [pool(), pool()], tiers=[tiny]))
    memory = KVMemory(DEFAULT_LAYOUT, 8, "cpu", seed=1)
    with pytest.raises(CapacityError, match="tier 0: capacity_bytes="):
        composed.register(memory.layout, memory.caches)
    composed.close()


def test_policies_are_entry_points_and_multi_has_a_schema() -> None:
    assert {e.name for e in scan("policies")} >= {"first-hit", "fallback", "tiered"}
    schema = config_model_for("multi").model_json_schema()
    assert {"policy", "children", "breaker"} <= set(schema["properties"])
    assert schema["properties"]["children"]["items"]["required"] == ["backend"]


def test_a_config_round_trips_through_json_with_policy_options() -> None:
    config = multi("tiered", CPU, CPU, write="through", tiers=[{"capacity_blocks": 4}])
    _, _, parsed = parse_config(config)
    _, _, again = parse_config(parsed.model_dump_json())
    assert again == parsed
    assert again.model_dump()["tiers"] == [{"capacity_blocks": 4}]


def test_a_child_that_borrows_the_engines_blocks_is_refused() -> None:
    message = refused(multi("fallback", CPU, {"backend": "tcp", "save_mode": "borrow"}))
    assert "children.1: borrows the engine's blocks (save_mode=borrow)" in message


def test_shm_refuses_to_borrow_blocks_with_the_reason() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"backend": "shm", "save_mode": "borrow"})
    assert "save_mode: Input should be 'copy' (got 'borrow')" in str(info.value)
