"""A bad ``kv_connector_extra_config`` stops vLLM's front end in seconds, with kvmux's message.

vLLM resolves the connector class while it builds its config, in the API
server, before any engine core starts; kvmux checks its extra config there
(:mod:`kvmux.adapters.vllm.preflight`). The factory tests check the hook
itself; the server tests run real ``vllm.entrypoints.openai.api_server``
processes and time them from start to exit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

from kvmux.adapters.vllm import config as vllm_config
from kvmux.adapters.vllm import preflight
from kvmux.adapters.vllm.config import ExtraConfigError
from kvmux.adapters.vllm.connector import KvmuxConnector
from kvmux.demo.run import server_args
from kvmux.demo.servers import VllmServer
from kvmux.errors import ConfigError, UnknownBackendError
from kvmux.registry import parse_config

pytestmark = pytest.mark.timeout(300)

#: Generous for a busy 2-core box; an unchecked config took ~18 s (the engine core
#: loads the weights first), a checked one ~9 s, nearly all of it importing vLLM.
EXIT_WITHIN_S = 30.0


@pytest.fixture(scope="module", autouse=True)
def plugins() -> None:
    load_general_plugins()  # what every vLLM process does first: kvmux's hook runs


def _transfer(extra: dict[str, Any], **kw: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=kw.pop("kv_connector", "kvmux"),
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        **kw,
    )


# ------------------------------------------------------------ the factory hook


def test_a_good_config_resolves_to_the_kvmux_connector() -> None:
    cls = KVConnectorFactory.get_connector_class(_transfer({"backend": "cpu"}))
    assert cls is KvmuxConnector


def test_an_unknown_backend_is_refused_where_vllm_resolves_the_class() -> None:
    with pytest.raises(ExtraConfigError) as info:
        KVConnectorFactory.get_connector_class(_transfer({"backend": "shmm"}))
    message = str(info.value)
    assert message.startswith("invalid kvmux config in kv_connector_extra_config: ")
    assert "kv_connector_extra_config.backend: unknown backend 'shmm'" in message
    assert "Did you mean 'shm'?" in message
    assert isinstance(info.value.__cause__, UnknownBackendError)
    assert not isinstance(info.value, ValueError)  # pydantic would bury a ValueError


def test_a_bad_backend_field_names_its_full_path_and_value() -> None:
    with pytest.raises(ExtraConfigError) as info:
        KVConnectorFactory.get_connector_class(_transfer({"backend": "cpu", "capacity_bytes": -1}))
    assert "kv_connector_extra_config.capacity_bytes: " in str(info.value)
    assert "(got -1)" in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, ConfigError)


def test_the_connector_named_by_module_path_is_checked_too() -> None:
    config = _transfer(
        {"backend": "nosuch"},
        kv_connector="KvmuxConnector",
        kv_connector_module_path="kvmux.adapters.vllm.connector",
    )
    with pytest.raises(ExtraConfigError, match="unknown backend 'nosuch'"):
        KVConnectorFactory.get_connector_class(config)


def test_a_kvmux_child_of_vllms_multi_connector_is_checked_while_vllm_builds_its_config() -> None:
    child = {"kv_connector": "kvmux", "kv_role": "kv_both"}
    config = _transfer(
        {"connectors": [{**child, "kv_connector_extra_config": {"backend": "dsk"}}]},
        kv_connector="MultiConnector",
    )
    with pytest.raises(ExtraConfigError, match="Did you mean 'disk'"):
        KVConnectorFactory.supports_hma_config(config)


def test_other_connectors_resolve_as_before_whatever_their_extra_config() -> None:
    config = _transfer({"backend": "shmm", "anything": 1}, kv_connector="ExampleConnector")
    assert KVConnectorFactory.get_connector_class(config).__name__ == "ExampleConnector"


def test_a_config_is_validated_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM resolves the class (checked there) right before it builds each role's
    connector, which reads the same config: the second read reuses the first."""
    validations: list[object] = []

    def counting(data: Any) -> Any:
        validations.append(data)
        return parse_config(data)

    monkeypatch.setattr(vllm_config, "parse_config", counting)
    extra = {"backend": "cpu", "capacity_bytes": 3 * 2**20, "vllm": {"lease_s": 7.0}}
    for _ in range(2):
        assert KVConnectorFactory.get_connector_class(_transfer(extra)) is KvmuxConnector
    backend, options = vllm_config.split_extra_config(dict(extra))
    assert len(validations) == 1
    assert backend.model_dump()["capacity_bytes"] == 3 * 2**20 and options.lease_s == 7.0
    for _ in range(2):  # a refused config is never remembered
        with pytest.raises(ExtraConfigError):
            KVConnectorFactory.get_connector_class(_transfer({**extra, "capacity_bytes": -1}))
    assert len(validations) == 3


def test_installing_twice_wraps_once() -> None:
    wrapped = KVConnectorFactory.get_connector_class
    preflight.install(KVConnectorFactory)
    assert KVConnectorFactory.get_connector_class == wrapped
    with pytest.raises(ExtraConfigError):  # still checked, and only once
        KVConnectorFactory.get_connector_class(_transfer({"backend": "shmm"}))


# ------------------------------------------------------------ real API servers


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"backend": "shmm"},
            "kv_connector_extra_config.backend: unknown backend 'shmm'",
        ),
        (
            {"backend": "cpu", "capacity_bytes": 0},
            "kv_connector_extra_config.capacity_bytes: Input should be greater than 0 (got 0)",
        ),
    ],
    ids=["unknown-backend", "bad-field"],
)
def test_a_bad_config_ends_the_api_server_in_seconds_with_kvmuxs_message_last(
    tiny_model_dir: str, tmp_path: Path, extra: dict[str, Any], expected: str
) -> None:
    kv_transfer = {
        "kv_connector": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    server = VllmServer("bad-config", tiny_model_dir, server_args(kv_transfer), log_dir=tmp_path)
    started = time.monotonic()
    server.start()
    try:
        code = server.wait_exit(EXIT_WITHIN_S)
        took = time.monotonic() - started
    finally:
        server.stop(grace_s=5)
    log = server.log_path.read_text(errors="replace")
    print(f"\n{extra}: exit status {code} after {took:.1f} s")  # the figure, shown with -s
    assert code is not None, f"still running after {EXIT_WITHIN_S} s:\n{server.log_tail()}"
    assert code != 0
    last = [line for line in log.splitlines() if line.strip()][-1]
    assert last.startswith("kvmux.adapters.vllm.config.ExtraConfigError: invalid kvmux config")
    assert expected in last
    assert "EngineCore" not in log, "the engine core started before the config was refused"
