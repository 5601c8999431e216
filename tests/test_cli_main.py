"""The ``kvmux`` command itself: what its help costs and what it shows."""

from __future__ import annotations

import json

from support import run_python

COMMANDS = ("list", "schema", "bench", "demo", "model", "proxy")


def test_top_level_help_lists_every_command_and_imports_none_of_them() -> None:
    proc = run_python(
        """
        import contextlib, io, json, sys
        from kvmux.cli.main import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(["--help"])
            except SystemExit as exc:
                code = exc.code
        loaded = sorted(m for m in sys.modules if m.startswith("kvmux.cli.") or m == "torch")
        print(json.dumps({"code": code, "help": out.getvalue(), "loaded": loaded}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["code"] == 0
    assert result["loaded"] == ["kvmux.cli.main"]
    for name in COMMANDS:
        assert f"\n    {name} " in result["help"], result["help"]


def test_a_subcommand_imports_only_its_own_module_and_keeps_its_options() -> None:
    proc = run_python(
        """
        import contextlib, io, json, sys
        from kvmux.cli.main import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(["list", "--help"])
            except SystemExit as exc:
                code = exc.code
        loaded = sorted(m for m in sys.modules if m.startswith("kvmux.cli."))
        print(json.dumps({"code": code, "help": out.getvalue(), "loaded": loaded}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["code"] == 0
    assert result["loaded"] == ["kvmux.cli.listing", "kvmux.cli.main"]
    assert "--check" in result["help"] and "usage: kvmux list" in result["help"]


def test_unknown_command_exits_2_naming_the_choices() -> None:
    proc = run_python("from kvmux.cli.main import main; main(['nope'])")
    assert proc.returncode == 2
    assert "invalid choice: 'nope'" in proc.stderr and "'proxy'" in proc.stderr
