"""``kvmux proxy``: serve the prefill/decode proxy (:mod:`kvmux.proxy`) until stopped.

Only argparse is imported at module level: ``kvmux proxy --help`` must work
where the ``proxy`` extra (aiohttp) is not installed.
"""

from __future__ import annotations

import argparse
import logging

from kvmux.errors import KvmuxError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of a prefill vLLM server, e.g. http://127.0.0.1:8100 (repeat for more; "
        "needed unless --colocated)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a decode vLLM server, e.g. http://127.0.0.1:8200 (repeat for more)",
    )
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="no prefill stage: send each request whole to the least loaded --decode server "
        "(colocated serving behind the same front end as P/D)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks one")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="deadline for one client request, prefill and decode together (default 600)",
    )
    parser.add_argument(
        "--unreachable-after-s",
        type=float,
        default=10.0,
        help="how long a server's host may leave a connect or keepalive probes unanswered "
        "before it is taken out of rotation (a cut link; default 10)",
    )
    parser.add_argument(
        "--probe-interval-s",
        type=float,
        default=2.0,
        help="how often a server out of rotation has its /health probed (default 2)",
    )
    parser.add_argument(
        "--upstream-keepalive-s",
        type=float,
        default=4.0,
        help="longest an idle connection to a server is kept for reuse; keep it below the "
        "servers' own keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s; default 4)",
    )
    parser.add_argument(
        "--prefix-routes",
        type=int,
        default=10_000,
        help="prompt-prefix chunks remembered to send a repeated prefix back to the servers "
        "that hold it (default 10000; 0 turns prefix-aware routing off)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        from kvmux.proxy import config_from_flags, serve
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in ("aiohttp", "multidict", "yarl"):
            raise
        raise KvmuxError(
            f"kvmux proxy needs aiohttp ({exc}); install it with: pip install 'kvmux[proxy]'"
        ) from exc
    config = config_from_flags(
        colocated=args.colocated,
        prefill=args.prefill,
        decode=args.decode,
        host=args.host,
        port=args.port,
        timeout_s=args.timeout_s,
        unreachable_after_s=args.unreachable_after_s,
        probe_interval_s=args.probe_interval_s,
        upstream_keepalive_s=args.upstream_keepalive_s,
        prefix_routes=args.prefix_routes,
    )
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    serve(config, on_ready=lambda url: print(f"kvmux proxy listening on {url}", flush=True))
    return 0
