"""``file_backed`` stores: a stored block damaged on disk is never loaded as ok.

A disk flips bits, a crash tears a write, an operator copies a file under
the wrong name. The backend may serve a good copy it keeps elsewhere, or
refuse the block (missing or failed): both are honest. What it must never do
is load the damaged (or the other key's) bytes as ``ok``, and once it has
refused a block, ``lookup`` must stop counting it, or the engine asks for it
again and again.
"""

from __future__ import annotations

from kvmux.handle import Status, TransferResult
from kvmux.keys import BlockKey
from kvmux.testing.harness import Harness, Pair
from kvmux.testing.requirements import requires
from kvmux.testing.stored_files import StoredFiles
from kvmux.testing.suite.base import SuiteBase

ANY_STATUS = frozenset(Status)


def _refused_keys_are_no_longer_counted(
    pair: Pair, keys: list[BlockKey], result: TransferResult
) -> None:
    for key, outcome in zip(keys, result.outcomes, strict=True):
        if outcome.status is not Status.OK:
            assert pair.lookup([key]) == 0, (
                f"{key} was refused ({outcome.status.value}: {outcome.reason}), "
                "yet lookup still counts it"
            )


class StoredBlockIntegrityTests(SuiteBase):
    @requires("file_backed")
    def test_a_corrupted_stored_block_is_never_loaded_as_ok(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(4)
        expected = pair.save_all(keys, range(4))
        StoredFiles.of(pair.saver).flip_a_bit(expected[1])
        result = pair.load_and_verify(keys, range(8, 12), expected, ANY_STATUS)
        _refused_keys_are_no_longer_counted(pair, keys, result)

    @requires("file_backed", "persistent")
    def test_a_block_corrupted_while_closed_is_never_loaded_as_ok(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(4)
        expected = pair.save_all(keys, range(4))
        files = StoredFiles.of(pair.saver)
        pair.loader.close()
        pair.saver.close()
        files.flip_a_bit(expected[2])
        reopened = harness.pair(saver=harness.open())
        result = reopened.load_and_verify(keys, range(8, 12), expected, ANY_STATUS)
        _refused_keys_are_no_longer_counted(reopened, keys, result)

    @requires("file_backed")
    def test_another_keys_intact_block_is_never_loaded_as_ok(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(2)
        expected = pair.save_all(keys, range(2))
        StoredFiles.of(pair.saver).put_in_place_of(intact=expected[1], victim=expected[0])
        result = pair.load_and_verify(keys[:1], [8], expected[:1], ANY_STATUS)
        _refused_keys_are_no_longer_counted(pair, keys[:1], result)
