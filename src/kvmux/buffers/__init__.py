"""LookupBuffer backends: keyed stores that become Connectors through
:class:`kvmux.bridges.BufferConnector` (entry-point group ``kvmux.buffers``)."""
