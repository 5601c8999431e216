"""LentSlots and Returns: the engine blocks a borrowing producer holds, and their return."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from kvmux.keys import BlockKey
from kvmux.pool.lending import Returns, complete
from kvmux.slots import LentSlots


def keys(n: int, tag: str = "") -> list[BlockKey]:
    return [BlockKey(f"{tag}{i}".encode(), "t") for i in range(n)]


def settle(slots: LentSlots, returns: Returns) -> None:
    complete(returns.collect(slots))


def wait(slots: LentSlots, returns: Returns, blocks: list[int]) -> Future[None]:
    future = returns.wait(slots, blocks)
    assert future is not None
    return future


def test_a_key_names_the_block_it_was_saved_from() -> None:
    slots = LentSlots(8)
    ks = keys(3)
    assert slots.place(ks, [5, 2, 7]) == []
    assert slots.find_many(ks).tolist() == [5, 2, 7]
    assert slots.lent() == 3


def test_releasing_every_key_of_a_save_returns_its_blocks() -> None:
    slots, returns = LentSlots(8), Returns()
    ks = keys(2)
    slots.place(ks, [0, 1])
    back = wait(slots, returns, [0, 1])
    slots.release(ks[0])
    settle(slots, returns)
    assert not back.done()
    slots.release(ks[1])
    settle(slots, returns)
    assert back.done() and slots.lent() == 0


def test_a_block_read_by_a_peer_returns_when_the_read_ends() -> None:
    slots, returns = LentSlots(4), Returns()
    [k] = keys(1)
    slots.place([k], [3])
    back = wait(slots, returns, [3])
    slots.pin([3])
    slots.release(k)
    settle(slots, returns)
    assert not back.done(), "a pinned block went back to the engine"
    assert slots.find_many([k]).tolist() == [-1], "a released key must not be found"
    slots.unpin([3])
    settle(slots, returns)
    assert back.done()


def test_a_block_saved_again_under_a_new_key_drops_the_old_key_and_its_wait() -> None:
    slots, returns = LentSlots(4), Returns()
    old, new = keys(1, "old"), keys(1, "new")
    slots.place(old, [1])
    first = wait(slots, returns, [1])
    assert slots.place(new, [1]) == []
    settle(slots, returns)
    assert first.done()
    assert slots.find_many(old + new).tolist() == [-1, 1]
    assert not wait(slots, returns, [1]).done()


def test_a_block_still_read_under_its_old_key_refuses_a_new_one() -> None:
    slots = LentSlots(4)
    old, new = keys(1, "old"), keys(1, "new")
    slots.place(old, [2])
    slots.pin([2])
    assert slots.place(new, [2]) == [0]
    assert slots.find_many(old + new).tolist() == [-1, -1]


def test_a_publication_ending_releases_the_keys_it_alone_held() -> None:
    slots, returns = LentSlots(6), Returns()
    ks = keys(3)
    slots.place(ks, [0, 1, 2])
    back = wait(slots, returns, [0, 1, 2])
    first = slots.hold(np.array([0, 1]))
    second = slots.hold(np.array([1]))
    slots.end_lease(first)
    assert slots.find_many(ks).tolist() == [-1, 1, 2]  # block 1 is still published
    slots.end_lease(second)
    slots.release(ks[2])
    settle(slots, returns)
    assert back.done() and slots.lent() == 0


def test_nothing_lent_needs_no_wait_and_closing_completes_every_wait() -> None:
    slots, returns = LentSlots(4), Returns()
    assert returns.wait(slots, [0, 1]) is None
    slots.place(keys(2), [0, 1])
    waits = [wait(slots, returns, [0]), wait(slots, returns, [0, 1])]
    complete(returns.all())
    assert all(w.done() for w in waits)


def test_two_saves_waiting_on_one_block_both_end_when_it_returns() -> None:
    slots, returns = LentSlots(4), Returns()
    ks = keys(2)
    slots.place(ks, [0, 1])
    first = wait(slots, returns, [0, 1])
    again = wait(slots, returns, [1, 1])  # the same key saved once more, a block twice
    slots.release(ks[1])
    settle(slots, returns)
    assert again.done() and not first.done()
    slots.release(ks[0])
    settle(slots, returns)
    assert first.done()
