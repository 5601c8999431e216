"""LookupBuffer backends: keyed stores that become Connectors through
:class:`kvmux.bridges.BufferBackend` (entry-point group ``kvmux.buffers``)."""
