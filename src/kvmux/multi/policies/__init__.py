"""The built-in MultiBackend policies, one per module; each is found by name
through the ``kvmux.policies`` entry-point group like any third-party policy."""
