"""Which address a server tells its peers: the one they can reach it at.

A server bound to one address advertises that address. One bound to a
wildcard (``0.0.0.0``, ``::``, empty) listens everywhere, and the wildcard
itself means nothing to a peer on another host; unless the operator names an
``advertise`` address, it advertises this host's first non-loopback IPv4
address of an interface that is up (the kernel's own list, in index order:
``eth0`` before later ones, as ``ip addr`` shows them), and loopback when
there is none (then only peers on this host can reach it anyway). Several
interfaces, or NAT between the hosts: set ``advertise``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


def advertised_host(bound: str, advertise: str | None) -> str:
    """What peers are told: ``advertise`` if set, else ``bound`` unless it is a
    wildcard, else :func:`first_host_address`."""
    if advertise:
        return advertise
    if bound not in WILDCARDS:
        return bound
    return first_host_address()


def host_facing(server: str) -> str:
    """The address a client advertises to the other clients of ``server`` (a store's
    master): loopback when the server is on loopback (everyone is on this host),
    else :func:`first_host_address`."""
    try:
        loopback = ipaddress.ip_address(server.strip("[]")).is_loopback
    except ValueError:
        loopback = server == "localhost"
    return "127.0.0.1" if loopback else first_host_address()


def first_host_address() -> str:
    """This host's first non-loopback IPv4 address on an interface that is up;
    ``127.0.0.1`` if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(sock, _SIOCGIFFLAGS, request), 16)[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                raw = fcntl.ioctl(sock, _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            address = socket.inet_ntoa(raw[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                return address
    return "127.0.0.1"
