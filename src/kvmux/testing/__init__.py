"""Testing tools for kvmux backends, importable by anyone who writes one.

* :mod:`kvmux.testing.suite` - the conformance suite (``ConnectorSuite``);
* :mod:`kvmux.testing.cross_process` - cross-process tests for P2P backends
  (``CrossProcessTests``: a producer in another process, consumers in the test's);
* :mod:`kvmux.testing.faults` - wrappers that inject drops, delays,
  corruption, mid-batch failures and deaths into any connector;
* :mod:`kvmux.testing.plugin` - the pytest plugin (``--kvmux-backend``).

This package imports nothing itself: pytest loads the plugin module in every
run, and that must stay cheap.
"""
