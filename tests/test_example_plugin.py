"""The example third-party package works the way a real plug-in would.

``examples/plugin`` is built and installed into a throwaway ``--target``
directory (never into this environment) and put on ``PYTHONPATH`` of
subprocesses. There its three entry points must be listed as available by
``kvmux list``, and the no-code conformance suite must pass on each name:
``dictstore`` (a Backend), ``sqlite`` (a LookupBuffer, bridged) and
``uds`` (a Pipe, bridged twice). The package's own subclassing-style tests
run against the installed copy too. All runs go in parallel to stay quick.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugin"
NAMES = {"dictstore": "backends", "sqlite": "buffers", "uds": "pipes"}


def configured(name: str) -> str:
    """How a config (and ``--kvmux-backend``) names it: a buffer or pipe by its group."""
    return name if NAMES[name] == "backends" else f"{NAMES[name]}:{name}"


RUN_TIMEOUT_S = 150


@dataclass
class Installed:
    site: Path
    source: Path

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(self.site), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("example-plugin")
    source = root / "src-copy"  # build from a copy: no build/ or egg-info in the repo
    shutil.copytree(
        EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    return Installed(site, source)


@pytest.fixture(scope="module")
def runs(installed: Installed) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Every subprocess this module checks, started together and awaited."""
    suite = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs"]
    commands = {
        name: (
            [*suite, "--pyargs", "kvmux.testing.suite", "--kvmux-backend", configured(name)],
            installed.site,
        )
        for name in NAMES
    }
    commands["own-tests"] = ([*suite, str(installed.source / "tests")], installed.source)
    commands["list"] = (
        [sys.executable, "-m", "kvmux.cli.main", "list", "--json", "--check"],
        installed.site,
    )
    procs = {
        name: subprocess.Popen(
            cmd,
            cwd=cwd,
            env=installed.env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for name, (cmd, cwd) in commands.items()
    }
    results: dict[str, subprocess.CompletedProcess[str]] = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out)
        yield results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_kvmux_list_shows_all_three_levels_available(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    listing = runs["list"]
    assert listing.returncode == 0, listing.stdout
    rows = {(r["group"], r["name"]): r for r in json.loads(listing.stdout)}
    for name, group in NAMES.items():
        row = rows.get((group, name))
        assert row is not None, f"{group}:{name} not listed"
        assert row["available"] is True, row
        assert row["distribution"] == "kvmux-example-plugin"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_conformance_suite_passes_on_the_installed_backend(
    runs: dict[str, subprocess.CompletedProcess[str]], name: str
) -> None:
    run = runs[name]
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
    assert f"kvmux backend: {NAMES[name]}:{name} = kvmux_example." in run.stdout


def test_the_packages_own_subclassing_tests_pass(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = runs["own-tests"]
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout
