"""The MultiBackend (``multi``): several backends behind one backend, composed by
a pluggable policy (``first-hit``, ``fallback``, ``tiered``, or a third party's).

Modules: ``backend`` (the MultiBackend), ``config`` (its config), ``policy`` (the
policy interface and shared helpers), ``policies/`` (built-ins), ``child``
(isolation and per-child stats), ``breaker``, ``eviction``, ``staging``.
"""
