"""The kvmux conformance suite: one contract, checked the same way for every backend.

Two ways to run it:

* **No code** - against any installed backend, through the pytest plugin::

      pytest --pyargs kvmux.testing.suite --kvmux-backend disk
      pytest --pyargs kvmux.testing.suite --kvmux-backend tcp --kvmux-config '{"timeout_s": 5}'

* **Subclassing** (fsspec's ``tests/abstract`` pattern) - in a backend's own tests::

      from kvmux.testing.suite import ConnectorSuite

      class TestMine(ConnectorSuite):
          @pytest.fixture
          def connector_factory(self, tmp_path):
              return lambda **overrides: MyBackend(MyConfig(path=tmp_path, **overrides))

  The factory builds a fresh instance on the same config at each call; the
  suite calls it several times per test (a P2P consumer, a reopened store).
  Pick single groups of tests by subclassing the mixins below instead.

Tests that rely on a capability (``persistent``, ``file_backed``, ``capacity_bound``,
``p2p``, ``not consumes_on_load``...) are skipped, with the capability named, where
the backend does not declare it.
"""

from kvmux.testing.suite.bad_config import BadConfigTests
from kvmux.testing.suite.bad_input import BadInputTests
from kvmux.testing.suite.base import SuiteBase
from kvmux.testing.suite.batch import BatchTests
from kvmux.testing.suite.capacity import CapacityTests
from kvmux.testing.suite.concurrency import ConcurrencyTests
from kvmux.testing.suite.consumption import ConsumptionTests
from kvmux.testing.suite.deadlines import DeadlineTests
from kvmux.testing.suite.failures import FaultToleranceTests
from kvmux.testing.suite.hostile_peers import HostilePeerTests
from kvmux.testing.suite.lending import LendingTests
from kvmux.testing.suite.lifecycle import LifecycleTests
from kvmux.testing.suite.lookup import LookupTests
from kvmux.testing.suite.missing import MissingKeyTests
from kvmux.testing.suite.persistence import PersistenceTests
from kvmux.testing.suite.publications import PublicationTests
from kvmux.testing.suite.roundtrip import RoundTripTests
from kvmux.testing.suite.stored_integrity import StoredBlockIntegrityTests


class ConnectorSuite(
    RoundTripTests,
    LookupTests,
    MissingKeyTests,
    BatchTests,
    ConcurrencyTests,
    ConsumptionTests,
    PersistenceTests,
    StoredBlockIntegrityTests,
    CapacityTests,
    PublicationTests,
    LendingTests,
    FaultToleranceTests,
    DeadlineTests,
    HostilePeerTests,
    BadInputTests,
    BadConfigTests,
    LifecycleTests,
):
    """Every conformance test. Subclass it and override ``connector_factory``."""


__all__ = [
    "BadConfigTests",
    "BadInputTests",
    "BatchTests",
    "CapacityTests",
    "ConcurrencyTests",
    "ConnectorSuite",
    "ConsumptionTests",
    "DeadlineTests",
    "FaultToleranceTests",
    "HostilePeerTests",
    "LendingTests",
    "LifecycleTests",
    "LookupTests",
    "MissingKeyTests",
    "PersistenceTests",
    "PublicationTests",
    "RoundTripTests",
    "StoredBlockIntegrityTests",
    "SuiteBase",
]
