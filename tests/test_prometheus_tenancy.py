"""Prometheus-compatible query APIs as fleets deploy them, against a REAL Prometheus on loopback.

- Served under a path prefix (``--web.route-prefix=/prom``, an Ingress at ``/prometheus``): every
  query the guard makes goes under ``source.url``'s path; a URL without the prefix answers 404,
  which named no field (``HTTP 404, body is not JSON``) and now says to put the prefix in the URL.
- A multi-tenant Mimir / Cortex: every query needs ``X-Scope-OrgID``, else ``401 no org id`` as
  text. There was no way to send it; ``source.headers`` (and ``source.headers_env`` for secret
  values) now do, and a 401/403 reads unknown with one line naming the field to set. A small real
  reverse proxy here enforces the headers as Mimir does and forwards to the real Prometheus.
- Basic auth from ``user:password@`` in the URL, against Prometheus's own ``--web.config.file``.
- A bearer token read from the environment with a trailing newline (a Secret written with
  ``echo``) was refused by httpx with an error quoting it into the log and /v1/targets.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from guard_support import Engine, GuardProcess, Served, free_port
from prometheus_support import PrometheusProcess, prometheus_binary

from sla_guard.config import ConfigError, parse_config
from sla_guard.ingest.prometheus import PrometheusSourceImpl, PrometheusView

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)"),
]

ROOT = Path(__file__).resolve().parent.parent
SLOS = [
    {
        "model": "m",
        "pool": "decode",
        "objectives": [
            {
                "name": "ttft_mean",
                "indicator": "ttft",
                "objective": "mean",
                "threshold_s": 2.5,
                "window": "5m",
                "min_requests": 1,
            }
        ],
    }
]
PLANTED = "PLANTEDKEY7"  # a secret header value: must be sent, and never shown


@pytest.fixture(scope="module")
def prom():
    """A real Prometheus served under /prom, scraping one engine that has served requests."""
    engine = Engine(pool="decode")
    served = Served(engine.exposition)
    p = PrometheusProcess([f"127.0.0.1:{served.port}"], interval_s=1.0, route_prefix="/prom")
    try:
        p.wait_ready()
        p.wait_up(1)  # requests after the first scrape: an increase within the window
        for _ in range(10):
            engine.request(0.5, 0.01)
        p.wait_up(1, samples=6)
        yield p
    finally:
        p.stop()
        served.stop()


class MimirProxy:
    """A reverse proxy on 127.0.0.1 in front of ``upstream`` (the real Prometheus, its prefix
    included) at ``/prometheus``, as Mimir serves its query API: a request without
    ``X-Scope-OrgID`` is answered 401 ``no org id`` (Mimir's text), one of another tenant gets no
    data (``tenant=None``: a single-tenant server); with ``key`` set a request without
    ``X-Api-Key: key`` is 403 (a gateway), with ``bearer`` one without that bearer token 401
    ``Unauthorized``. Records each request's path and headers."""

    def __init__(
        self, upstream: str, tenant: str | None = "team-a", key: str | None = None, bearer: str | None = None
    ) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.lock = threading.Lock()
        outer = self
        client = httpx.Client(timeout=10)

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                with outer.lock:
                    outer.seen.append((self.path, dict(self.headers.items())))
                org = self.headers.get("X-Scope-OrgID")
                if not self.path.startswith("/prometheus/"):
                    return self._send(404, b"404 page not found\n")
                if not org and tenant is not None:
                    return self._send(401, b"no org id\n")
                if bearer is not None and self.headers.get("Authorization") != f"Bearer {bearer}":
                    return self._send(401, b"Unauthorized\n")
                if key is not None and self.headers.get("X-Api-Key") != key:
                    return self._send(403, b"forbidden\n")
                if org != tenant and tenant is not None:  # another tenant's (empty) store
                    return self._send(
                        200,
                        json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode(),
                        "application/json",
                    )
                r = client.get(upstream + self.path.removeprefix("/prometheus"))
                self._send(r.status_code, r.content, r.headers.get("content-type", "application/json"))

            def _send(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/prometheus"
        self._client = client
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def requests(self) -> list[tuple[str, dict[str, str]]]:
        with self.lock:
            return list(self.seen)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._client.close()


@pytest.fixture
def mimir(prom):
    proxy = MimirProxy(prom.url)
    yield proxy
    proxy.stop()


def _cfg(url: str, **source) -> dict:
    return {
        "source": {"mode": "prometheus", "url": url, "timeout_s": 3, **source},
        "evaluation_interval_s": 0.5,
        "slos": SLOS,
    }


def _cli(tmp: Path, cfg: dict, command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``sla-guard check --config F`` or ``sla-guard validate-config F``, a real process."""
    f = tmp / f"cfg-{len(list(tmp.iterdir()))}.yaml"
    f.write_text(yaml.safe_dump(cfg))
    args = [str(f)] if command == "validate-config" else ["--config", str(f)]
    return subprocess.run(
        [sys.executable, "-m", "sla_guard.cli", command, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def _slo_status(g: GuardProcess) -> str | None:
    pools = g.get("/v1/slo").json()["pools"]
    return pools[0]["slos"][0]["status"] if pools else None


def _collect(src: PrometheusSourceImpl) -> None:
    import asyncio

    asyncio.run(src.collect(time.time()))


# -- 1. a path prefix ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "/"])
def test_every_query_goes_under_the_path_prefix(prom, suffix):
    """The server check, the clock's measure, the duplicates check, instant and range (short and
    the counted, pieced long read) all answer from /prom/api/v1/query, with or without a
    trailing slash (the root answers 404: a query sent there would fail)."""
    assert httpx.get(f"http://127.0.0.1:{prom.port}/api/v1/query", params={"query": "up"}).status_code == 404
    src = PrometheusSourceImpl(parse_config(_cfg(prom.url + suffix)).source)
    try:
        _collect(src)
        v = src.view
        now = time.time()
        assert v.url == prom.url
        assert v.instant("up", {}, now)
        assert v.range("up", {}, now - 10, now)
        assert v.range("up", {}, now - 900, now)  # > RANGE_REREAD_S: the counted, pieced read
        assert v.queries >= 6 and v.failed_queries == 0 and v.errors == {}, (v.errors, v.last_error)
        assert src.ready() and src.targets()[0].up
    finally:
        src.view.close()


def test_a_url_without_the_prefix_names_the_field_and_the_fix(prom):
    """Before: ``bad_response: HTTP 404, body is not JSON`` (no field, no fix)."""
    v = PrometheusView(f"http://127.0.0.1:{prom.port}", timeout_s=3)
    try:
        assert v.query("vector(1)", time.time()) is None
    finally:
        v.close()
    assert "HTTP 404" in v.last_error and "source.url" in v.last_error and "prefix" in v.last_error, v.last_error
    assert "\n" not in v.last_error


def test_a_server_refusing_every_query_is_logged_once_a_minute_and_counted_each_time(prom, caplog):
    """Before: one warning per query, the same line 20 times a tick (``check`` against a Mimir without a
    tenant printed 20 of them before its summary). Every error is still counted and shown."""
    v = PrometheusView(f"http://127.0.0.1:{prom.port}", timeout_s=3)
    try:
        with caplog.at_level("WARNING", logger="sla_guard.ingest.prometheus"):
            for i in range(6):
                assert v.query(f"vector({i})", time.time(), prefetch=False) is None
    finally:
        v.close()
    lines = [r.getMessage() for r in caplog.records if "HTTP 404" in r.getMessage()]
    assert len(lines) == 1, lines
    assert v.errors == {"http_status": 6} and "HTTP 404" in v.last_error


# -- 2. a multi-tenant Mimir / Cortex --------------------------------------------------------------


def test_without_a_tenant_check_is_unknown_and_names_the_field(tmp_path, mimir):
    """Before: ``bad_response: HTTP 401, body is not JSON``, no field to set (and none existed)."""
    r = _cli(tmp_path, _cfg(mimir.url), "check")
    assert r.returncode == 2, r.stdout + r.stderr
    down = [line for line in r.stderr.splitlines() if line.startswith("target prometheus")]
    assert len(down) == 1, r.stderr
    assert "HTTP 401 (no org id)" in down[0] and "source.headers: {X-Scope-OrgID: <tenant>}" in down[0], down


def test_the_tenant_header_goes_with_every_query(tmp_path, mimir):
    r = _cli(tmp_path, _cfg(mimir.url, headers={"X-Scope-OrgID": "team-a"}), "check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout.splitlines()[1], r.stdout
    seen = mimir.requests()
    assert seen and all(h.get("X-Scope-OrgID") == "team-a" for _, h in seen), {h.get("X-Scope-OrgID") for _, h in seen}
    assert {p.split("?")[0] for p, _ in seen} == {"/prometheus/api/v1/query"}


def test_a_guard_refused_by_the_server_stays_up_unknown_and_says_what_to_set(tmp_path, mimir):
    g = GuardProcess(tmp_path, _cfg(mimir.url), log_level="debug")
    try:
        t = g.wait_for("the 401 shown", lambda: (t := g.get("/v1/targets").json()["targets"][0])["last_error"] and t)
        start = g.get("/v1/status").json()["ticks"]
        g.wait_for("three more ticks", lambda: g.get("/v1/status").json()["ticks"] >= start + 3)
        assert _slo_status(g) in (None, "unknown"), g.get("/v1/slo").text
        assert g.get("/v1/slo").json()["status"] == "unknown"
    finally:
        g.stop()
    assert not t["up"] and t["last_error"].startswith("auth: Prometheus answered HTTP 401 (no org id)"), t
    assert "source.headers" in t["last_error"] and "\n" not in t["last_error"]


def test_a_secret_header_from_the_environment_is_sent_and_never_shown(tmp_path, prom):
    """``headers_env``: the value read from the environment (a trailing newline, as a Secret
    written with ``echo`` has, dropped), sent with every query, in no log line or API answer."""
    proxy = MimirProxy(prom.url, key=PLANTED)
    cfg = _cfg(proxy.url, headers={"X-Scope-OrgID": "team-a"}, headers_env={"X-Api-Key": "TENANCY_KEY"})
    try:
        g = GuardProcess(tmp_path, cfg, log_level="debug", env={"TENANCY_KEY": PLANTED + "\n"})
        try:
            g.wait_for("the pool judged", lambda: _slo_status(g) == "ok")
            surfaces = g.surfaces()
        finally:
            log = g.stop()
        missing = _cli(tmp_path, cfg, "check", env={"TENANCY_KEY": ""})
    finally:
        proxy.stop()
    seen = proxy.requests()
    assert {h.get("X-Api-Key") for _, h in seen} >= {PLANTED}
    assert f"GET {proxy.url}/api/v1/query" in log  # debug: httpx's request lines are in it
    for where, text in {**surfaces, "log": log}.items():
        assert PLANTED not in text, where
    # unset: a warning naming the variable, the 403 naming the fields
    assert missing.returncode == 2
    assert "source.headers_env.X-Api-Key: $TENANCY_KEY is not set or empty" in missing.stderr, missing.stderr
    assert "HTTP 403 (forbidden)" in missing.stderr and "source.headers_env" in missing.stderr, missing.stderr


def test_a_bearer_token_with_a_trailing_newline_is_sent_and_never_shown(tmp_path, prom):
    """Before: httpx refused the header (``LocalProtocolError: Illegal header value b'Bearer
    PLANTEDKEY7\\n'``), so every query failed, and that message, token included, went to the log,
    /v1/targets and ``check``'s output."""
    proxy = MimirProxy(prom.url, tenant=None, bearer=PLANTED)
    cfg = _cfg(proxy.url, bearer_token_env="TENANCY_TOKEN")
    try:
        r = _cli(tmp_path, cfg, "check", env={"TENANCY_TOKEN": PLANTED + "\n"})
    finally:
        proxy.stop()
    assert PLANTED not in r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr


# -- 3. Basic auth from the URL, against Prometheus's own --web.config.file ----------------------

# bcrypt (cost 4, the least) of PLANTEDPW9, as Prometheus's basic_auth_users wants it
PW_HASH = "$2b$04$qjy6hgfVkvJkI90EntIymuEa9pARQYfxA67Q.K.8Iioulcw/6rDPK"


def test_url_credentials_authenticate_and_never_show(tmp_path):
    engine = Engine(pool="decode")
    served = Served(engine.exposition)
    p = PrometheusProcess(
        [f"127.0.0.1:{served.port}"],
        interval_s=1.0,
        web_config={"basic_auth_users": {"guard": PW_HASH}},
        auth=("guard", "PLANTEDPW9"),
    )
    try:
        p.wait_ready()
        p.wait_up(1)
        for _ in range(10):
            engine.request(0.5, 0.01)
        p.wait_up(1, samples=6)
        assert httpx.get(f"{p.url}/api/v1/query", params={"query": "up"}).status_code == 401
        url = f"http://guard:PLANTEDPW9@127.0.0.1:{p.port}/"
        g = GuardProcess(tmp_path, _cfg(url), log_level="debug")
        try:
            g.wait_for("the pool judged", lambda: _slo_status(g) == "ok")
            surfaces = g.surfaces()
        finally:
            log = g.stop()
        wrong = _cli(tmp_path, _cfg(f"http://guard:PLANTEDPW0@127.0.0.1:{p.port}"), "check")
    finally:
        p.stop()
        served.stop()
    assert f"GET http://127.0.0.1:{p.port}/api/v1/query" in log
    for where, text in {**surfaces, "log": log, "check": wrong.stdout + wrong.stderr}.items():
        assert "PLANTEDPW" not in text, where
    assert wrong.returncode == 2
    assert "HTTP 401" in wrong.stderr and "user:password@ in source.url" in wrong.stderr, wrong.stderr


# -- 4. the new fields' errors, from the real CLI ---------------------------------------------------


@pytest.mark.parametrize(
    ("source", "says"),
    [
        (
            {"headers": {"Authorization": "Bearer PLANTEDKEY7"}},
            "source.prometheus.headers: Value error, Authorization cannot be set here: use source.bearer_token_env",
        ),
        ({"headers_env": {"authorization": "TOKEN"}}, "source.prometheus.headers_env: Value error, Authorization"),
        (
            {"headers": {"X Scope OrgID": "a"}},
            "source.prometheus.headers: Value error, 'X Scope OrgID' is not an HTTP header name",
        ),
        ({"headers": {"X-Scope-OrgID:": "a"}}, "is not an HTTP header name"),
        (
            {"headers": {"X-Scope-OrgID": "team-a\nX-Evil: PLANTEDKEY7"}},
            "source.prometheus.headers: Value error, the value of 'X-Scope-OrgID' is not one line of printable ASCII",
        ),
        ({"headers": {"X-Scope-OrgID": " "}}, "the value of 'X-Scope-OrgID' is empty"),
        (
            {"headers": {"X-Scope-OrgID": 12345}},
            "source.prometheus.headers.X-Scope-OrgID: expected a string, not a number",
        ),
        ({"headers": {"X-Scope-OrgID": "a", "x-scope-orgid": "b"}}, "'x-scope-orgid' is given twice"),
        ({"headers": {"Host": "a"}}, "'Host' is written by the HTTP client from source.url"),
        (
            {"headers_env": {"X-Api-Key": "PLANTEDKEY7-value"}},
            "source.prometheus.headers_env: Value error, 'X-Api-Key': its variable is not an environment variable name",
        ),
        (
            {"headers": {"X-Api-Key": "a"}, "headers_env": {"x-api-key": "K"}},
            "source.prometheus.headers_env: 'x-api-key' is also in source.headers",
        ),
    ],
)
def test_header_config_errors_name_the_field_and_the_fix(tmp_path, source, says):
    cfg = _cfg("http://prometheus:9090", **source)
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert says in str(err.value), str(err.value)
    for command in ("validate-config", "check"):
        r = _cli(tmp_path, cfg, command)
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert says in r.stderr, (command, r.stderr)
        if "PLANTEDKEY7" in str(source):  # a value is never echoed (it may be a secret)
            assert "PLANTEDKEY7" not in r.stderr + r.stdout, r.stderr


def test_headers_parse():
    src = parse_config(
        _cfg("http://mimir/prometheus", headers={"X-Scope-OrgID": " team-a "}, headers_env={"X-Api-Key": "MIMIR_KEY"})
    ).source
    assert src.headers == {"X-Scope-OrgID": "team-a"} and src.headers_env == {"X-Api-Key": "MIMIR_KEY"}
