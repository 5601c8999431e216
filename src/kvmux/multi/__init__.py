"""The MultiConnector (``multi``): several backends behind one Connector, composed by
a pluggable policy (``first-hit``, ``fallback``, ``tiered``, or a third party's).

Modules: ``connector`` (the Connector), ``config`` (its config), ``policy`` (the
policy interface and shared helpers), ``policies/`` (built-ins), ``child``
(isolation and per-child stats), ``breaker``, ``eviction``, ``staging``.
"""
