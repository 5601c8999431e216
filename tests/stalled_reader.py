"""A tcp consumer that asks for blocks and never reads them: a hung decode, for real.

Run as ``python stalled_reader.py HOST PORT BLOCKS LAYOUT``. It joins the producer
(:mod:`kvmux.testing.peer`'s keys and layout), sends one fetch of every block,
prints ``asked`` and then reads nothing, so the producer's sends fill the socket
and stall until the test stops or kills this process.
"""

from __future__ import annotations

import socket
import sys
import time

from kvmux.compat import Compat
from kvmux.net.frames import Channel, Limits
from kvmux.net.handshake import join_handshake
from kvmux.net.messages import PEER_PROTOCOL, FetchRequest
from kvmux.testing.peer import empty_caches, make_keys, make_layout


def main() -> None:
    host, port, blocks, layout_name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    layout = make_layout(empty_caches(blocks, layout_name))
    sock = socket.create_connection((host, port), timeout=5)
    chan = Channel(sock, PEER_PROTOCOL, Limits(2**20, 2**26))
    deadline = time.monotonic() + 5
    join_handshake(
        chan,
        service="tcp",
        layout=layout.fingerprint(),
        secret=None,
        deadline=deadline,
        compat=Compat.of(layout),
    )
    chan.send(FetchRequest.of(make_keys(blocks)), deadline=deadline)
    print("asked", flush=True)
    sys.stdin.read()  # reads nothing from the socket until stopped, killed or told to end


if __name__ == "__main__":
    main()
