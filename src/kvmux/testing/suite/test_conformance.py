"""The module ``pytest --pyargs kvmux.testing.suite --kvmux-backend NAME`` collects.

Without ``--kvmux-backend`` the whole module is skipped once, with the
command to run it, instead of reporting every test as skipped.
"""

import pytest

from kvmux.testing.plugin import HOW_TO_RUN, chosen_backend
from kvmux.testing.suite import ConnectorSuite

if chosen_backend() is None:
    pytest.skip(HOW_TO_RUN, allow_module_level=True)


class TestConformance(ConnectorSuite):
    """The whole suite against the backend named by ``--kvmux-backend``."""
