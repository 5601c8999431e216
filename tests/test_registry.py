"""The registry: names through entry points, errors that say what to do."""

from __future__ import annotations

import json

import pytest

from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.errors import BackendUnavailableError, ConfigError, UnknownBackendError
from kvmux.registry import create_connector, parse_config, resolve, scan

from support import FakeDist, kvmux_cli, run_python


def test_builtins_are_declared_through_entry_points() -> None:
    names = {(e.group, e.name): e.distribution for e in scan("backends") + scan("pipes")}
    for name in ("cpu", "disk", "shm", "tcp"):
        assert names[("backends", name)] == "kvmux"
    assert names[("pipes", "tcp")] == "kvmux"


def test_unknown_backend_lists_known_names_and_suggests_one() -> None:
    with pytest.raises(UnknownBackendError) as err:
        create_connector({"backend": "dsk"})
    assert err.value.suggestion == "disk"
    message = str(err.value)
    assert "Did you mean 'disk'?" in message
    for name in ("cpu", "disk", "shm", "tcp"):
        assert name in message


def test_unknown_group_qualifier_is_an_unknown_backend() -> None:
    with pytest.raises(UnknownBackendError):
        resolve("nope:cpu")
    with pytest.raises(UnknownBackendError):
        resolve("connectors:cpu")  # the group's name before it was kvmux.backends
    with pytest.raises(UnknownBackendError):
        resolve("policies:tiered")  # a group a connector config cannot name


def test_a_name_is_looked_up_in_one_group_only() -> None:
    """``tcp`` is both a backend and a pipe: a bare name is the backend, the pipe is
    asked for by its group, and neither falls through into the other."""
    assert resolve("tcp").qualified_name == "backends:tcp"
    assert resolve("pipes:tcp").qualified_name == "pipes:tcp"
    assert resolve("tcp", ("pipes",)).qualified_name == "pipes:tcp"
    with pytest.raises(UnknownBackendError) as err:
        resolve("tcp", ("buffers",))
    assert "(looked in buffers)" in str(err.value)


def test_a_buffer_named_like_a_backend_is_suggested_with_its_group() -> None:
    with pytest.raises(UnknownBackendError) as err:
        resolve("mooncake-store")
    assert err.value.suggestion == "buffers:mooncake-store"
    message = str(err.value)
    assert "unknown backend 'mooncake-store' (looked in backends)." in message
    assert "Did you mean 'buffers:mooncake-store'?" in message
    known = message.partition("Known: ")[2]
    assert known.index("tcp,") < known.index("buffers:mooncake-store") < known.index("pipes:tcp")


def test_the_registry_imports_no_policy_and_no_multi() -> None:
    proc = run_python(
        """
        import sys
        import kvmux.registry.factory, kvmux.registry.loader
        print([m for m in sys.modules if m.startswith("kvmux.multi")])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bad_config_names_backend_field_path_and_value() -> None:
    with pytest.raises(ConfigError) as err:
        create_connector({"backend": "cpu", "capacity_bytes": -5})
    assert err.value.backend == "cpu"
    assert err.value.problems[0][0] == "capacity_bytes"
    assert "capacity_bytes" in str(err.value) and "-5" in str(err.value)


def test_unknown_config_field_is_rejected() -> None:
    with pytest.raises(ConfigError, match="capacity_gb"):
        create_connector({"backend": "cpu", "capacity_gb": 4})


def test_config_accepts_dict_json_text_and_model() -> None:
    for config in (
        {"backend": "cpu", "capacity_bytes": 4096},
        json.dumps({"backend": "cpu", "capacity_bytes": 4096}),
        CpuPoolConfig(capacity_bytes=4096),
    ):
        entry, cls, cfg = parse_config(config)
        assert (entry.name, cls) == ("cpu", CpuPoolBackend)
        assert isinstance(cfg, CpuPoolConfig) and cfg.capacity_bytes == 4096


@pytest.mark.parametrize(
    "config",
    ["not json", "[1, 2]", {"capacity_bytes": 1}, {"backend": 3}],
)
def test_malformed_config_is_a_config_error(config: object) -> None:
    with pytest.raises(ConfigError):
        parse_config(config)


def test_listing_imports_no_backend_and_no_torch() -> None:
    proc = run_python(
        """
        import json, sys
        from kvmux.cli.listing import records
        rows = records()
        heavy = ("torch", "kvmux.backends.cpu", "kvmux.connector")
        heavy = [m for m in heavy if m in sys.modules]
        print(json.dumps({"n": len(rows), "heavy": heavy}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["n"] >= 5 and out["heavy"] == []


def test_broken_plugin_is_listed_unavailable_and_breaks_nothing(fake_dist: FakeDist) -> None:
    site = fake_dist(
        "kvmux-broken",
        {"kvmux.backends": {"broken": "kvmux_broken:Broken"}},
        {"kvmux_broken/__init__.py": "raise RuntimeError('boom at import')\n"},
    )
    proc = kvmux_cli("list", "--json", "--check", pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["group"], r["name"]): r for r in json.loads(proc.stdout)}
    broken = rows[("backends", "broken")]
    assert broken["available"] is False
    assert "boom at import" in broken["reason"] and "kvmux-broken" in broken["reason"]
    assert rows[("backends", "cpu")]["available"] is True

    proc = run_python(
        """
        from kvmux.registry import create_connector
        from kvmux.errors import BackendUnavailableError
        try:
            create_connector({"backend": "broken"})
        except BackendUnavailableError as exc:
            print("unavailable:", exc)
        c = create_connector({"backend": "cpu"})
        print("cpu ok", type(c.backend).__name__)
        """,
        site,
    )
    assert proc.returncode == 0, proc.stderr
    assert "unavailable:" in proc.stdout and "boom at import" in proc.stdout
    assert "cpu ok CpuPoolBackend" in proc.stdout


def test_default_listing_never_calls_an_unimported_plugin_available(
    fake_dist: FakeDist,
) -> None:
    site = fake_dist(
        "kvmux-broken",
        {"kvmux.backends": {"broken": "kvmux_broken:Broken"}},
        {"kvmux_broken/__init__.py": "raise RuntimeError('boom at import')\n"},
    )
    proc = kvmux_cli("list", "--json", pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["group"], r["name"]): r for r in json.loads(proc.stdout)}
    assert rows[("backends", "broken")]["available"] is None
    assert rows[("backends", "broken")]["reason"] is None
    assert all(r["available"] is not True for r in rows.values())

    proc = kvmux_cli("list", pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if " broken " in x)
    assert line.endswith("installed (not checked)") and "available" not in line
    assert "`kvmux list --check` imports each" in proc.stdout

    proc = kvmux_cli("list", "--check", "--group", "backends", pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if " broken " in x)
    assert "unavailable: importing kvmux_broken:Broken failed" in line
    assert "not checked" not in proc.stdout


def test_missing_extra_is_unavailable_with_install_hint(fake_dist: FakeDist) -> None:
    site = fake_dist(
        "kvmux-needs-extra",
        {"kvmux.backends": {"needy": "kvmux_needy:Needy [fast]"}},
        {"kvmux_needy/__init__.py": "Needy = None\n"},
    )
    info = next(site.glob("kvmux_needs_extra-*.dist-info"))
    metadata = info / "METADATA"
    metadata.write_text(
        metadata.read_text()
        + "Provides-Extra: fast\nRequires-Dist: surely-not-installed-pkg>=1; extra == 'fast'\n"
    )
    proc = kvmux_cli("list", "--json", pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in json.loads(proc.stdout) if r["name"] == "needy")
    assert row["available"] is False
    assert "surely-not-installed-pkg" in row["reason"]
    assert "pip install 'kvmux-needs-extra[fast]'" in row["reason"]


def test_two_distributions_claiming_one_name_resolve_deterministically(
    fake_dist: FakeDist,
) -> None:
    module = """
        from kvmux.backends.cpu import CpuPoolBackend
        class Mine(CpuPoolBackend):
            pass
    """
    fake_dist("zeta-kv", {"kvmux.backends": {"dup": "zeta_kv:Mine"}}, {"zeta_kv.py": module})
    site = fake_dist(
        "alpha-kv",
        {"kvmux.backends": {"dup": "alpha_kv:Mine", "cpu": "alpha_kv:Mine"}},
        {"alpha_kv.py": module},
    )
    expected_losers = {("dup", "zeta-kv", "alpha-kv"), ("cpu", "alpha-kv", "kvmux")}
    proc = kvmux_cli("list", "--json", "--check", pythonpath=site)
    rows = [r for r in json.loads(proc.stdout) if r["name"] in ("dup", "cpu")]
    winners = {(r["name"], r["distribution"]) for r in rows if r["available"]}
    assert winners == {("dup", "alpha-kv"), ("cpu", "kvmux")}
    losers = {(r["name"], r["distribution"], r["shadowed_by"]) for r in rows if not r["available"]}
    assert losers == expected_losers

    proc = kvmux_cli("list", "--json", pythonpath=site)  # metadata alone shows the shadowing
    rows = [r for r in json.loads(proc.stdout) if r["name"] in ("dup", "cpu")]
    unchecked = {(r["name"], r["distribution"]) for r in rows if r["available"] is None}
    assert unchecked == {("dup", "alpha-kv"), ("cpu", "kvmux")}
    losers = {
        (r["name"], r["distribution"], r["shadowed_by"]) for r in rows if r["available"] is False
    }
    assert losers == expected_losers

    proc = run_python(
        """
        from kvmux.registry import create_connector
        print(type(create_connector({"backend": "dup"}).backend).__module__)
        print(type(create_connector({"backend": "cpu"}).backend).__module__)
        """,
        site,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["alpha_kv", "kvmux.backends.cpu"]


def test_entry_point_that_is_not_a_connector_is_refused(fake_dist: FakeDist) -> None:
    site = fake_dist(
        "kvmux-wrong",
        {"kvmux.backends": {"wrong": "kvmux_wrong:thing"}},
        {"kvmux_wrong.py": "thing = 42\n"},
    )
    proc = run_python(
        """
        from kvmux.registry import create_connector
        create_connector({"backend": "wrong"})
        """,
        site,
    )
    assert proc.returncode != 0
    assert "BackendUnavailableError" in proc.stderr and "not a Backend subclass" in proc.stderr


def test_cli_unknown_backend_exits_2_with_suggestion() -> None:
    proc = kvmux_cli("schema", "tpc")
    assert proc.returncode == 2
    assert "Did you mean 'tcp'?" in proc.stderr


def test_cli_schema_prints_the_backend_config_model() -> None:
    proc = kvmux_cli("schema", "disk")
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert "path" in schema["required"]
    assert schema["properties"]["capacity_bytes"]["anyOf"][0]["exclusiveMinimum"] == 0


def test_unavailable_backend_error_is_an_import_error() -> None:
    assert issubclass(BackendUnavailableError, ImportError)


def test_listing_says_which_servers_are_open_to_anyone_who_reaches_their_port() -> None:
    proc = kvmux_cli("list", "--json", "--check")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["group"], r["name"]): r for r in json.loads(proc.stdout)}
    for name in ("tcp", "shm"):
        note = rows[("backends", name)]["note"]
        assert note is not None and "open to anyone" in note and "`secret`" in note
    assert "no authentication" in (rows[("pipes", "tcp")]["note"] or "")
    assert rows[("backends", "cpu")]["note"] is None
    table = kvmux_cli("list")
    assert table.returncode == 0, table.stderr
    assert "without a `secret`, anyone who reaches the port" in table.stdout
