"""Example kvmux plug-ins, one per level: ``dictstore`` (Backend), ``sqlite``
(LookupBuffer) and ``uds`` (Pipe). Each module stands alone; kvmux imports
only the one a config names."""
