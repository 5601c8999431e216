"""What kvmux's metadata promises: a library's requirements, not one machine's.

torch is required from the lowest version kvmux needs, never capped (a GPU
user's vLLM pins its own torch; this repo's CPU pin is the Makefile's), and
what only a command needs (tqdm for ``kvmux bench``, transformers and
tokenizers for building the tiny model) is an extra, imported when used.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from support import run_python

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
COMMAND_ONLY = ("tqdm", "transformers", "tokenizers", "safetensors")


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def test_torch_is_required_from_a_lowest_version_and_never_capped() -> None:
    (torch,) = [Requirement(r) for r in PROJECT["dependencies"] if r.startswith("torch")]
    operators = {spec.operator for spec in torch.specifier}
    assert operators == {">="}, torch


def test_the_cpu_pin_is_the_makefiles_own() -> None:
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH\s*:=\s*torch==(\S+)$", makefile, re.MULTILINE)
    assert pin is not None
    assert "install -c $(PIN) $(TORCH)" in makefile
    assert "install -c $(PIN) -e '.[dev,vllm,bench,model]'" in makefile


def test_command_only_packages_are_extras_included_in_all() -> None:
    assert not _names(PROJECT["dependencies"]) & {*COMMAND_ONLY, "stevedore"}
    extras = PROJECT["optional-dependencies"]
    assert "tqdm" in _names(extras["bench"])
    assert {"transformers", "tokenizers", "safetensors"} <= _names(extras["model"])
    assert {"bench", "model"} <= Requirement(extras["all"][0]).extras


def test_the_library_imports_and_works_without_the_command_only_packages() -> None:
    """Each of them made unimportable: kvmux, its connector and the models package
    import and a backend runs. (torch.hub imports tqdm when it is there: not ours.)"""
    proc = run_python(
        f"""
        import sys
        for name in {COMMAND_ONLY!r}:
            sys.modules[name] = None  # `import name` now fails
        import kvmux, kvmux.connector, kvmux.models, kvmux.registry
        conn = kvmux.create_connector({{"backend": "cpu"}})
        conn.close()
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"]


def test_importing_the_library_leaves_the_model_builders_deps_unimported() -> None:
    proc = run_python(
        """
        import sys
        import kvmux, kvmux.connector, kvmux.models
        kvmux.create_connector({"backend": "cpu"}).close()
        print(sorted({m.split(".")[0] for m in sys.modules} & {"transformers", "tokenizers",
                                                               "safetensors"}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
