"""The pytest plugin: the no-code way to run the suite, and harmless everywhere else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import DirectoryPath, FilePath, NewPath

from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig, invent_paths
from kvmux.testing.requirements import requires, unmet

pytest_plugins = ("pytester",)


def test_suite_runs_against_a_backend_named_on_the_command_line(
    pytester: pytest.Pytester,
) -> None:
    config = json.dumps({"capacity_bytes": 8 * 2**20})
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-rs",
        "--pyargs",
        "kvmux.testing.suite",
        "--kvmux-backend",
        "cpu",
        "--kvmux-config",
        config,
    )
    outcomes = result.parseoutcomes()
    assert result.ret == 0, result.stdout.str()
    assert outcomes.get("failed", 0) == 0 and outcomes["passed"] > 0
    result.stdout.fnmatch_lines(
        [
            "kvmux backend: backends:cpu = kvmux.backends.cpu:CpuPoolBackend (kvmux *)",
            f"kvmux config: {config}",
            "*requires capability 'persistent' (CpuPoolBackend declares persistent=False)",
        ]
    )


def test_suite_without_a_backend_is_skipped_once_with_instructions(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs", "--pyargs", "kvmux.testing.suite")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*no kvmux backend chosen*--kvmux-backend NAME*"])
    result.stdout.no_fnmatch_line("kvmux backend:*")


def test_a_subclass_without_a_factory_is_skipped_with_instructions(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        from kvmux.testing.suite import LookupTests

        class TestForgot(LookupTests):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    assert result.parseoutcomes()["skipped"] > 0
    assert "passed" not in result.parseoutcomes()
    result.stdout.fnmatch_lines(["*define a `connector_factory` fixture*"])


def test_unrelated_test_runs_are_left_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain(): assert 1 + 1 == 2")
    result = pytester.runpytest("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("kvmux backend*")


def test_loading_the_plugin_imports_neither_torch_nor_a_backend() -> None:
    code = (
        "import sys, kvmux.testing.plugin; "
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvmux.backends')"
        " or m.startswith('stevedore')); print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kvmux-backend", "nosuch"], "*unknown backend 'nosuch'*Known: *cpu*"),
        (["--kvmux-backend", "cpu", "--kvmux-config", "{oops"], "*not valid JSON*"),
        (["--kvmux-backend", "cpu", "--kvmux-config", "[1]"], "*must be a JSON object*"),
    ],
)
def test_bad_options_are_usage_errors(
    pytester: pytest.Pytester, args: list[str], message: str
) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_required_path_fields_get_fresh_paths(tmp_path: Path) -> None:
    class PathsConfig(BackendConfig):
        store: Path
        spool: DirectoryPath
        socket: NewPath
        certificate: FilePath
        optional: Path | None = None
        given: Path

    invented = invent_paths(PathsConfig, {"given": "/elsewhere"}, tmp_path)
    assert sorted(invented) == ["socket", "spool", "store"]
    assert Path(invented["store"]).is_dir() and Path(invented["spool"]).is_dir()
    assert not Path(invented["socket"]).exists()
    assert all(Path(p).parent == tmp_path for p in invented.values())


def test_skip_messages_name_the_capability() -> None:
    assert unmet(Capabilities(), ["persistent"], "MyConnector") == (
        "requires capability 'persistent' (MyConnector declares persistent=False)"
    )
    assert unmet(Capabilities(consumes_on_load=True), ["not consumes_on_load"], "B") == (
        "requires capability 'not consumes_on_load' (B declares consumes_on_load=True)"
    )
    assert unmet(Capabilities(p2p=True), ["p2p", "not persistent"], "C") is None


def test_requirements_with_unknown_capabilities_fail_at_import() -> None:
    with pytest.raises(ValueError, match=r"unknown capability 'persistant'.*persistent"):
        requires("persistant")
