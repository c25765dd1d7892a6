"""What an operator sets for the proxy, validated once at start.

A frozen dataclass rather than the guard's pydantic config: the proxy is a data source beside
``engine_hooks`` and may not import the guard, and its handful of flags come from the command line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

POLICIES = ("round-robin", "least-loaded")


def engine_url(url: str) -> str:
    """An engine's base URL without a trailing slash; only http(s) with a host is accepted."""
    u = urlsplit(url.strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"engine URL {url!r}: expected http(s)://host[:port]")
    return url.strip().rstrip("/")


def display_url(url: str) -> str:
    """An engine URL as it may appear in error bodies and logs: without user:password@."""
    u = urlsplit(url)
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{u.port}" if u.port else host
    return f"{u.scheme}://{netloc}{u.path}"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    policy: str = "round-robin"
    # The ``router`` label: which proxy instance measured a series (several proxies may front one
    # deployment). A stable name, not a pod name, so restarts do not mint new series.
    router: str = "sla-guard-proxy"
    # Total deadline of one upstream call, connect to the last byte of the body. Prefill answers
    # one token; decode streams the whole generation.
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 600.0
    # The longest a decode stream may stay silent once its first chunk came. vLLM sends a running request's
    # chunks one decode step apart (ms), a preemption's recompute at worst seconds: 30 s of silence is an
    # engine that stalled, and the stream ends and the engine is left out as a hung one is. Before its first
    # chunk a decode engine queues and pulls the KV cache, which is given --prefill-timeout (if longer). A whole
    # answer's body (vLLM sends it with its headers) gets the same bound after its headers.
    decode_stall_timeout_s: float = 30.0
    # Active health: every this many seconds (0: off) each engine's /health is asked, under health_timeout_s; a
    # refusal, a 5xx or no answer leaves the engine out until /health answers 200 (see balance.py for what that
    # 200 may and may not undo). Short: a probe that waits is an engine no request should wait for.
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    # Distinct values of the model label before the rest are counted as "other": the model comes
    # from the client's body, and clients must not be able to mint series.
    max_models: int = 16
    max_body_bytes: int = 16 * 1024 * 1024
    # A client must deliver its whole request (headers and body) within this many seconds of connecting, or of
    # its previous response, else the connection is closed: uvicorn alone waits forever, so slowloris clients
    # held their connections for good. Room for --max-body-bytes over a slow link; the answer is not bounded.
    request_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one prefill and one decode engine URL are needed")
        object.__setattr__(self, "prefill", tuple(engine_url(u) for u in self.prefill))
        object.__setattr__(self, "decode", tuple(engine_url(u) for u in self.decode))
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        if not self.router:
            raise ValueError("router name must not be empty")
        if self.prefill_timeout_s <= 0 or self.decode_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if not self.decode_stall_timeout_s > 0:
            raise ValueError(
                f"decode_stall_timeout_s (--decode-stall-timeout) must be a positive number of seconds, "
                f"got {self.decode_stall_timeout_s!r}"
            )
        if not (0 <= self.health_interval_s < math.inf):
            raise ValueError(
                f"health_interval_s (--health-interval) must be 0 (off) or a positive number of seconds, "
                f"got {self.health_interval_s!r}"
            )
        if not (0 < self.health_timeout_s < math.inf):
            raise ValueError(
                f"health_timeout_s (--health-timeout) must be a positive number of seconds, "
                f"got {self.health_timeout_s!r}"
            )
        if not (0 < self.request_timeout_s < math.inf):
            raise ValueError(
                f"request_timeout_s (--request-timeout) must be a positive number of seconds, "
                f"got {self.request_timeout_s!r}"
            )
        if self.max_models < 1 or self.max_body_bytes < 1:
            raise ValueError("max_models and max_body_bytes must be >= 1")
