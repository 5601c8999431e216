"""Lending: a producer serves the engine's own blocks, and gives each one back.

With ``save_mode: borrow`` a served pool keeps no copy: a save names the
engine's block under its key (:class:`~kvmux.slots.LentSlots`, where slot
``i`` *is* block ``i``) and peers read the engine's KV memory itself, as
vLLM's NixlConnector does. The engine must not overwrite a lent block, so the
save's handle stays open until the block comes back: its key released (the
engine wants it), its publication ended (the consumer is done) or expired
(no renewal for ``lease_s``), and no peer still reading it.

:class:`Returns` holds the futures those handles wait on, one per save, each
done once every block its save lent is back. Futures are completed outside
the store's lock (``settle``): a caller's done-callback may call the store.

Expiry must not wait for someone to use the table, as the pool's lazy reaping
does, since nothing else would ever hand the blocks back: a :class:`Reaper`
thread reaps every :data:`REAP_INTERVAL_S`, and ends with the store.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import repeat

from kvmux.slots import LentSlots

REAP_INTERVAL_S = 0.1
"""How often expired publications and pins of lent blocks are ended: the most a
block stays lent past its lease."""


@dataclass(eq=False)  # hashed by identity: collect counts the blocks back per wait
class _Wait:
    future: Future[None]
    left: int
    """Blocks of the save not back yet."""


class Returns:
    """Futures of saves waiting for the blocks they lent. Not thread-safe: the
    store's lock guards it, with the :class:`LentSlots` passed to each call.

    A block is waited on by one save, as a rule; the rare others (the same key
    saved again from it) go in a side table, so a save of thousands of blocks
    registers them with one dict update instead of a list per block."""

    def __init__(self) -> None:
        self._first: dict[int, _Wait] = {}
        self._more: dict[int, list[_Wait]] = {}

    def wait(self, slots: LentSlots, blocks: Sequence[int]) -> Future[None] | None:
        """A future done once each of ``blocks`` still lent is back; None if none is."""
        held = list(dict.fromkeys(slots.held(blocks)))
        if not held:
            return None
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()  # nobody may cancel a return
        waiting = _Wait(future, len(held))
        shared = self._first.keys() & held if self._first else None  # none waited on: no pass
        if not shared:
            self._first.update(zip(held, repeat(waiting)))
            return future
        for block in held:
            if block in shared:
                self._more.setdefault(block, []).append(waiting)
            else:
                self._first[block] = waiting
        return future

    def collect(self, slots: LentSlots) -> list[Future[None]]:
        """The futures whose last block came back since the last call (to complete
        once the lock is released). A block lent again since, under a new key, came
        back all the same: the waits on it are older than the new lending."""
        freed = slots.take_freed()
        if self._more:  # rare: some block is waited on by more than one save
            back: Counter[_Wait] = Counter()
            for block in freed:
                first = self._first.pop(block, None)
                if first is not None:
                    back.update((first, *self._more.pop(block, ())))
        else:  # one wait per block: counted without Python code per block
            pop: Callable[[int, None], _Wait | None] = self._first.pop
            back = Counter(filter(None, map(pop, freed, repeat(None))))
        done: list[Future[None]] = []
        for waiting, count in back.items():
            waiting.left -= count
            if not waiting.left:
                done.append(waiting.future)
        return done

    def all(self) -> list[Future[None]]:
        """Every future still waiting (the store is closing: nothing reads the blocks)."""
        waits = [*self._first.values(), *(w for ws in self._more.values() for w in ws)]
        self._first.clear()
        self._more.clear()
        return list({id(w.future): w.future for w in waits}.values())


def complete(futures: Iterable[Future[None]]) -> None:
    for future in futures:
        future.set_result(None)


class Reaper:
    """Calls ``tick`` every :data:`REAP_INTERVAL_S` on a thread of its own until ``stop``."""

    def __init__(self, tick: Callable[[], None], name: str) -> None:
        self._tick = tick
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(REAP_INTERVAL_S):
            self._tick()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
