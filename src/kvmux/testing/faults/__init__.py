"""Fault injection: wrappers that make any backend misbehave on purpose.

Each wrapper is a backend over a live one (``Connector(Delay(conn.backend,
0.1))`` puts a front on it), so the code under test (the multi backend's
fallback, an engine adapter, the conformance suite) runs unchanged against a
real backend that drops, delays, corrupts, breaks mid-batch or dies, in the
spirit of Mooncake's fault-injecting transport decorator. Wrappers stack
(``Delay(DropKeys(cpu, rate=0.5), 0.1)``) and are deterministic: which keys are
hit depends only on ``seed`` and the key, never on timing or thread order.

======================  =====================================================
``DropKeys``            chosen keys load as ``missing`` (the store lost them)
``Delay``               transfers (and lookups) complete late
``CorruptBytes``        loaded blocks have bytes flipped, outcome still ``ok``
``FailMidBatch``        the first N keys of a batch succeed, the rest fail
``Die``                 after N calls the backend raises, fails, or hangs
======================  =====================================================
"""

from kvmux.testing.faults.choice import KeyChoice
from kvmux.testing.faults.data import CorruptBytes, DropKeys
from kvmux.testing.faults.partial import FailMidBatch
from kvmux.testing.faults.timing import Delay, Die
from kvmux.testing.faults.wrapper import FaultWrapper

__all__ = [
    "CorruptBytes",
    "Delay",
    "Die",
    "DropKeys",
    "FailMidBatch",
    "FaultWrapper",
    "KeyChoice",
]
