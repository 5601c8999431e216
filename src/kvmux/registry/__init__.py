"""Finding backends by name through entry points, and building them from configs."""

from kvmux.registry.entries import GROUPS, BackendEntry, scan, scan_all
from kvmux.registry.factory import create_buffer, create_connector, create_pipe
from kvmux.registry.loader import load_check, load_class, parse_config, resolve

__all__ = [
    "GROUPS",
    "BackendEntry",
    "create_buffer",
    "create_connector",
    "create_pipe",
    "load_check",
    "load_class",
    "parse_config",
    "resolve",
    "scan",
    "scan_all",
]
