"""``sla-guard-proxy``: the console script.

    sla-guard-proxy --prefill http://p0:8000 --decode http://d0:8000 --decode http://d1:8000 \\
        --listen 0.0.0.0:8000 --policy least-loaded --router pd-proxy-a

SLA thresholds that must be histogram boundaries come from the same environment variables as on
the engines (``SLA_GUARD_TTFT_SLO_S``, ``SLA_GUARD_TPOT_SLO_S``).
"""

from __future__ import annotations

import argparse
import logging
import math

import uvicorn

from exporters.redact import install_log_redaction
from exporters.request_deadline import request_timeout_protocol
from pd_proxy.app import build_app
from pd_proxy.config import POLICIES, ProxyConfig


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen {value!r}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def parser() -> argparse.ArgumentParser:
    d = ProxyConfig(prefill=("http://x",), decode=("http://x",))
    p = argparse.ArgumentParser(prog="sla-guard-proxy",
                                description="Prefill/decode proxy for vLLM that serves the client-scope metrics.")
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="base URL of a prefill engine (repeat for several)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="base URL of a decode engine (repeat for several)")
    p.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 8000), metavar="HOST:PORT",
                   help="address to serve on (default 127.0.0.1:8000)")
    p.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="engine choice within a pool (default %(default)s)")
    p.add_argument("--router", default=d.router, help="the router label of every series (default %(default)s)")
    p.add_argument("--prefill-timeout", type=float, default=d.prefill_timeout_s, metavar="S",
                   help="total deadline of a prefill call, connect to last byte (default %(default)g s)")
    p.add_argument("--decode-timeout", type=float, default=d.decode_timeout_s, metavar="S",
                   help="total deadline of a decode call, connect to last streamed byte (default %(default)g s)")
    p.add_argument("--decode-stall-timeout", type=float, default=d.decode_stall_timeout_s, metavar="S",
                   help="longest silence of a decode stream after its first chunk (or of a whole answer's body "
                        "after its headers) before it ends as an error and the engine is left out "
                        "(default %(default)g s)")
    p.add_argument("--health-interval", type=float, default=d.health_interval_s, metavar="S",
                   help="seconds between GETs of each engine's /health; a failed one leaves the engine out until "
                        "/health answers 200 (0: off; default %(default)g s)")
    p.add_argument("--health-timeout", type=float, default=d.health_timeout_s, metavar="S",
                   help="total deadline of one /health probe (default %(default)g s)")
    p.add_argument("--max-models", type=int, default=d.max_models, metavar="N",
                   help="distinct model label values before the rest count as 'other' (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, metavar="S",
                   help="seconds a client has to send its whole request (headers and body); a slower one is "
                        "disconnected (default %(default)g s)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="N",
                   help="largest accepted request body; larger ones get 413 (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = ProxyConfig(prefill=tuple(args.prefill), decode=tuple(args.decode), policy=args.policy,
                             router=args.router, prefill_timeout_s=args.prefill_timeout,
                             decode_timeout_s=args.decode_timeout,
                             decode_stall_timeout_s=args.decode_stall_timeout,
                             health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
                             max_models=args.max_models,
                             max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout)
    except ValueError as e:
        parser().error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # engine URLs may carry user:password@ or ?key=: httpx logs each request's URL whole
    install_log_redaction(args.log_level)
    host, port = args.listen
    # SIGTERM: stop accepting and let every request in flight finish, which takes at most its two deadlines
    # (30 s cut decode streams that had --decode-timeout to run: the client saw the connection drop mid-answer)
    drain_s = math.ceil(config.prefill_timeout_s + config.decode_timeout_s)
    uvicorn.run(build_app(config), host=host, port=port, log_level=args.log_level,
                timeout_graceful_shutdown=drain_s, http=request_timeout_protocol(config.request_timeout_s))
    return 0
