"""The conformance suite fails deliberately broken backends, on the right tests.

Each broken connector (``broken_backend.py``) breaks one promise. The whole
suite runs against it in a nested pytest session; the tests about that
promise must fail, while tests about unrelated behaviour still pass, so a
failure points at the bug rather than at a crashing harness. The unbroken
``cpu`` pool under the same factory is the control: it fails nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broken_backend import BROKEN

pytest_plugins = ("pytester",)

SUBCLASSING_MODULE = """
import pytest

import broken_backend
from kvmux.testing.suite import ConnectorSuite


class TestBackend(ConnectorSuite):
    @pytest.fixture
    def connector_factory(self, tmp_path):
        return broken_backend.factory({name!r}, tmp_path)
"""

MUST_FAIL: dict[str, set[str]] = {
    "CorruptsOnLoad": {
        "test_round_trip_is_byte_exact[float16-2layers]",
        "test_round_trip_is_byte_exact[vllm-kv-first-bfloat16]",
        "test_a_batch_of_1024_small_blocks_round_trips",
        "test_concurrent_saves_and_loads_from_several_threads",
    },
    "CountsEveryHit": {
        "test_lookup_stops_at_the_first_gap",
        "test_lookup_is_zero_when_the_first_key_is_missing",
    },
    "OkForMissing": {
        "test_load_of_unknown_keys_reports_each_missing",
        "test_partial_load_reports_each_key",
        "test_missing_keys_are_reported_within_the_timeout",
    },
    "ZeroesMissingBlocks": {
        "test_load_of_unknown_keys_reports_each_missing",
        "test_partial_load_reports_each_key",
    },
    "SavesByReference": {"test_source_blocks_may_be_overwritten_once_save_completes"},
    "ForgetsOnReopen": {
        "test_blocks_survive_close_and_reopen",
        "test_a_reopened_store_keeps_old_and_accepts_new_blocks",
    },
    "FailsWhenFull": {
        "test_saving_past_capacity_never_fails_nor_loads_wrong_bytes",
        "test_stored_bytes_never_exceed_capacity",
    },
    "AcceptsAnyConfig": {"test_unknown_config_field_is_refused_naming_backend_and_field"},
    "TrustsItsFiles": {
        "test_a_corrupted_stored_block_is_never_loaded_as_ok",
        "test_a_block_corrupted_while_closed_is_never_loaded_as_ok",
        "test_another_keys_intact_block_is_never_loaded_as_ok",
    },
}

STILL_PASS = {
    "test_close_is_idempotent",
    "test_calls_after_close_raise_closed_error",
    "test_keys_and_block_ids_of_different_lengths_are_refused",
    "test_config_round_trips_through_json",
}
"""Tests none of the broken backends should fail: their bugs are elsewhere."""


def _run_suite(pytester: pytest.Pytester, name: str) -> tuple[set[str], set[str], set[str]]:
    """Names of the (passed, skipped, failed) suite tests against backend ``name``."""
    pytester.syspathinsert(Path(__file__).parent)
    pytester.makepyfile(test_backend=SUBCLASSING_MODULE.format(name=name))
    reprec = pytester.inline_run("-p", "no:cacheprovider")
    passed, skipped, failed = reprec.listoutcomes()
    errors = [
        r for r in reprec.getreports("pytest_runtest_logreport") if r.when != "call" and r.failed
    ]
    assert not errors, f"suite set-up or tear-down broke: {errors[0].longreprtext}"

    def names(reports: list[pytest.TestReport]) -> set[str]:
        return {r.nodeid.rpartition("::")[2] for r in reports}

    return names(passed), names(skipped), names(failed)


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_suite_fails_a_broken_backend_on_the_tests_about_its_bug(
    pytester: pytest.Pytester, broken: str
) -> None:
    passed, _, failed = _run_suite(pytester, broken)
    assert MUST_FAIL[broken] <= failed, (
        f"{broken} should fail {sorted(MUST_FAIL[broken] - failed)}; it failed {sorted(failed)}"
    )
    assert passed >= STILL_PASS, f"{broken} broke unrelated tests: {sorted(STILL_PASS - passed)}"


def test_suite_passes_the_unbroken_pool_under_the_same_factory(pytester: pytest.Pytester) -> None:
    passed, skipped, failed = _run_suite(pytester, "CpuPoolBackend")
    assert not failed, f"the working cpu pool failed {sorted(failed)}"
    every_must_fail = set().union(*MUST_FAIL.values())
    # Every test that catches a bug runs (passes) on the working pool, unless its
    # capability is one the plain pool does not declare.
    assert every_must_fail - passed <= {
        "test_blocks_survive_close_and_reopen",
        "test_a_reopened_store_keeps_old_and_accepts_new_blocks",
        "test_a_corrupted_stored_block_is_never_loaded_as_ok",
        "test_a_block_corrupted_while_closed_is_never_loaded_as_ok",
        "test_another_keys_intact_block_is_never_loaded_as_ok",
    }
    assert "test_blocks_survive_close_and_reopen" in skipped
