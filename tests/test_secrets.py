"""Credentials in target and Prometheus URLs never leave the guard (issue 13, item 4).

Real ``sla-guard serve`` processes on loopback, configured with URLs that carry planted secrets
(``user:PLANTEDPW1@``, ``?token=PLANTEDTOK2``, ...), scrape real loopback servers (one target
down, so the error paths run) or query a real loopback Prometheus stub that records what it is
sent. Every surface an operator or an unauthenticated client can read is collected -- the
process's log output at info and debug level, ``/metrics``, ``/v1/targets``, ``/v1/status``,
``/v1/slo``, ``/v1/findings``, ``sla-guard check`` as a table and as ``--json`` -- and none may
contain a planted string. Each surface is also checked to show the redacted form, so a surface
that says nothing at all cannot pass by accident. The Prometheus stub proves the credentials
are still *used*: Basic auth from the URL when no bearer is configured, the bearer otherwise.
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import yaml
from guard_support import Engine, GuardProcess, Served, free_port

from exporters.redact import redact_record, redact_text, redact_url, strip_userinfo
from sla_guard.ingest.prometheus import PrometheusView

ROOT = Path(__file__).resolve().parent.parent
SECRETS = ("PLANTEDUSER0", "PLANTEDPW1", "PLANTEDTOK2", "PLANTEDPW3", "PLANTEDTOK4", "PLANTEDTOK5", "PLANTEDPW6")
SLOS = [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5,
                         "window": "10s", "min_requests": 1}]}]


def assert_clean(where: str, text: str) -> None:
    for s in SECRETS:
        i = text.find(s)
        assert i < 0, f"{s} leaked in {where}: ...{text[max(0, i - 120):i + 40]}..."


# -- a real Prometheus-compatible stub that records what it is sent ---------------------------
class PromStub:
    """``/api/v1/query`` on 127.0.0.1: answers ``vector(1)`` with 1 and anything else with an
    empty vector, every 4th request with HTTP 500 (an error path); records each request's
    Authorization header and query parameters."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, dict[str, list[str]]]] = []
        self.lock = threading.Lock()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                q = parse_qs(urlsplit(self.path).query)
                with outer.lock:
                    outer.seen.append((self.headers.get("Authorization"), q))
                    n = len(outer.seen)
                if n % 4 == 0:
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                one = q.get("query") == ["vector(1)"]
                at = float(q.get("time", ["0"])[0])
                body = json.dumps({"status": "success", "data": {
                    "resultType": "vector", "result": [{"metric": {}, "value": [at, "1"]}] if one else []}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def requests(self) -> list[tuple[str | None, dict[str, list[str]]]]:
        with self.lock:
            return list(self.seen)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_check(tmp: Path, cfg: dict, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    f = tmp / f"check-{len(list(tmp.iterdir()))}.yaml"
    f.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(f), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **(env or {})})


# -- embedded scrape mode ---------------------------------------------------------------------
@pytest.fixture
def scrape_cfg():
    """Two live targets with a password / a query token in their URL, one dead target with both,
    none of them named (so the URL is the default name)."""
    engines = [Engine(model="m", pool="decode", engine=str(i)) for i in range(2)]
    for e in engines:
        e.request(0.2, 0.01)
    servers = [Served(e.exposition) for e in engines]
    dead = free_port()
    urls = {
        "pw": f"http://PLANTEDUSER0:PLANTEDPW1@127.0.0.1:{servers[0].port}/metrics",
        "tok": f"http://127.0.0.1:{servers[1].port}/metrics?token=PLANTEDTOK2&x=1",
        "dead": f"http://PLANTEDUSER0:PLANTEDPW1@127.0.0.1:{dead}/metrics?token=PLANTEDTOK2",
    }
    shown = {
        "pw": f"http://***@127.0.0.1:{servers[0].port}/metrics",
        "tok": f"http://127.0.0.1:{servers[1].port}/metrics?token=***&x=***",
        "dead": f"http://***@127.0.0.1:{dead}/metrics?token=***",
    }
    cfg = {"source": {"mode": "scrape", "interval_s": 0.5, "timeout_s": 0.5,
                      "targets": [{"url": u, "model": "m", "pool": "decode"} for u in urls.values()]},
           "evaluation_interval_s": 0.3, "slos": SLOS}
    yield cfg, shown, servers
    for s in servers:
        s.stop()


@pytest.mark.parametrize("log_level", ["info", "debug"])
def test_scrape_mode_serve_shows_no_credentials(tmp_path, scrape_cfg, log_level):
    cfg, shown, servers = scrape_cfg
    g = GuardProcess(tmp_path, cfg, log_level=log_level)
    try:
        def scraped_all() -> dict | None:
            body = g.get("/v1/targets").json()
            ts = {t["name"]: t for t in body["targets"]}
            ok = (len(ts) == 3 and ts.get(shown["dead"], {}).get("last_error")
                  and ts[shown["pw"]]["up"] and ts[shown["tok"]]["up"])
            return body if ok else None

        targets = g.wait_for("every target scraped, the dead one failed", scraped_all)
        g.wait_for("an evaluation", lambda: g.get("/readyz", auth=False).status_code == 200)
        assert all(s.hits >= 1 for s in servers)  # the credentials did not stop the scrapes
        surfaces = g.surfaces()
    finally:
        log = g.stop()
    # positive controls: each surface shows the redacted URLs, so it is the surface we meant
    by_name = {t["name"]: t for t in targets["targets"]}
    assert {t["url"] for t in targets["targets"]} == set(shown.values())
    assert by_name[shown["dead"]]["up"] is False and by_name[shown["dead"]]["last_error"].startswith("connect")
    assert f'target="{shown["pw"]}"' in surfaces["/metrics"] and f'target="{shown["dead"]}"' in surfaces["/metrics"]
    assert "guard_scrape_errors" in surfaces["/metrics"]
    assert '"status"' in surfaces["/v1/slo"] and '"findings"' in surfaces["/v1/findings?state=all"]
    if log_level == "debug":  # httpx's request line is logged, redacted
        assert f"GET {shown['tok']}" in log and f"GET {shown['pw']}" in log, log[-3000:]
    else:  # ... and not logged at all at info
        assert "HTTP Request:" not in log
    for where, text in {**surfaces, "log": log}.items():
        assert_clean(f"{where} ({log_level})", text)


def test_scrape_mode_check_shows_no_credentials(tmp_path, scrape_cfg):
    cfg, shown, _ = scrape_cfg
    table = run_check(tmp_path, cfg)
    assert table.returncode in (0, 1, 2), table.stderr
    assert "MODEL" in table.stdout and f"target {shown['dead']} ({shown['dead']}) down: connect" in table.stderr
    as_json = run_check(tmp_path, cfg, "--json")
    assert json.loads(as_json.stdout)["pools"], as_json.stdout
    for where, text in (("check stdout", table.stdout), ("check stderr", table.stderr),
                        ("check --json stdout", as_json.stdout), ("check --json stderr", as_json.stderr)):
        assert_clean(where, text)


# -- Prometheus mode --------------------------------------------------------------------------
@pytest.fixture
def prom():
    stub = PromStub()
    yield stub
    stub.stop()


def _prom_cfg(url: str, **source) -> dict:
    return {"source": {"mode": "prometheus", "url": url, "timeout_s": 2, **source},
            "evaluation_interval_s": 0.3, "slos": SLOS}


def _run_prometheus_guard(tmp_path, prom: PromStub, cfg: dict, shown_url: str, env=None) -> None:
    """Serve at debug level until the stub has answered a few evaluations (one a 500), then
    check every surface."""
    g = GuardProcess(tmp_path, cfg, log_level="debug", env=env)
    try:
        g.wait_for("a dozen queries (with 500s among them)", lambda: len(prom.requests()) >= 12)
        body = g.wait_for("the server seen", lambda: g.get("/v1/targets").json())
        surfaces = g.surfaces()
    finally:
        log = g.stop()
    assert body["targets"][0]["url"] == shown_url
    assert "Prometheus answered HTTP 500" in log  # the error path ran (and was logged)
    assert f"GET {shown_url}/api/v1/query" in log  # httpx's request line, without the credentials
    for where, text in {**surfaces, "log": log}.items():
        assert_clean(where, text)


def test_prometheus_url_credentials_become_basic_auth_never_shown(tmp_path, prom):
    url = f"http://PLANTEDUSER0:PLANTEDPW3@127.0.0.1:{prom.port}/?token=PLANTEDTOK5"
    _run_prometheus_guard(tmp_path, prom, _prom_cfg(url), f"http://127.0.0.1:{prom.port}")
    basic = "Basic " + base64.b64encode(b"PLANTEDUSER0:PLANTEDPW3").decode()
    seen = prom.requests()
    assert seen and all(auth == basic for auth, _ in seen), {a for a, _ in seen}
    assert all(q.get("token") == ["PLANTEDTOK5"] for _, q in seen)  # the URL's query is still sent


def test_prometheus_bearer_token_is_sent_and_never_shown(tmp_path, prom):
    cfg = _prom_cfg(f"http://127.0.0.1:{prom.port}", bearer_token_env="GUARD_SECRETS_PROM_TOKEN")
    _run_prometheus_guard(tmp_path, prom, cfg, f"http://127.0.0.1:{prom.port}",
                          env={"GUARD_SECRETS_PROM_TOKEN": "PLANTEDTOK4"})
    seen = prom.requests()
    assert seen and all(auth == "Bearer PLANTEDTOK4" for auth, _ in seen), {a for a, _ in seen}


def test_prometheus_explicit_bearer_wins_over_url_credentials(prom):
    """Defence in depth (config loading also rejects the combination): httpx would replace the
    bearer header with Basic auth built from the URL; the view drops the URL's userinfo."""
    view = PrometheusView(f"http://PLANTEDUSER0:PLANTEDPW6@127.0.0.1:{prom.port}", token="PLANTEDTOK4",
                          timeout_s=2)
    try:
        assert view.query("vector(1)", time.time()) is not None
    finally:
        view.close()
    assert [a for a, _ in prom.requests()] == ["Bearer PLANTEDTOK4"]
    assert view.url == f"http://127.0.0.1:{prom.port}"


def test_prometheus_unreachable_check_shows_no_credentials(tmp_path):
    """The error path of `check` in Prometheus mode: unreachable, exit 2, errors redacted."""
    url = f"http://PLANTEDUSER0:PLANTEDPW3@127.0.0.1:{free_port()}/?token=PLANTEDTOK5"
    for args in ((), ("--json",)):
        r = run_check(tmp_path, _prom_cfg(url, timeout_s=0.5), *args)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Prometheus unreachable" in r.stderr, r.stderr
        assert_clean(f"check {args} stdout", r.stdout)
        assert_clean(f"check {args} stderr", r.stderr)


# -- the redaction itself ---------------------------------------------------------------------
@pytest.mark.parametrize(("url", "want"), [
    ("http://u:PLANTEDPW1@h:9/metrics?token=PLANTEDTOK2&x=1#PLANTEDPW3", "http://***@h:9/metrics?token=***&x=***"),
    ("https://PLANTEDTOK2@h/m", "https://***@h/m"),
    ("http://h:8000/metrics", "http://h:8000/metrics"),
    ("http://h/m?PLANTEDTOK2", "http://h/m?***"),
    ("http://u:PLANTEDPW1@[::1]:80/x?y=PLANTEDTOK2", "http://***@[::1]:80/x?y=***"),
    # garbage: what no URL parser accepts must not leak either
    ("http://[::1:9/x?tok=PLANTEDTOK2", "http://[::1:9/x?tok=***"),
    ("PLANTEDUSER0:PLANTEDPW1@host/metrics", "***@host/metrics"),
    ("http://u:PLANTED/PW1@h/x", "http://***@h/x"),
    ("http://u:PLANTED#PW1@h/x", "http://***@h/x"),
    ("http://u:PLANTED?PW1@h/x", "http://***@h/x"),
    ("not a url ://PLANTEDUSER0:PLANTEDPW1@x?a=PLANTEDTOK2", "not a url ://***@x?a=***"),
    ("", ""),
])
def test_redact_url(url, want):
    assert redact_url(url) == want


def test_redact_url_non_string_and_text():
    assert redact_url(None) == "***"  # type: ignore[arg-type]
    text = "GET http://u:PLANTEDPW1@h/x?t=PLANTEDTOK2 \"HTTP/1.1 200 OK\", then 'https://PLANTEDTOK5@y/z'"
    assert redact_text(text) == "GET http://***@h/x?t=*** \"HTTP/1.1 200 OK\", then 'https://***@y/z'"
    assert strip_userinfo("http://us%40er:p%3APLANTEDPW1@h:1/p?q=1") == ("http://h:1/p?q=1",
                                                                          ("us@er", "p:PLANTEDPW1"))


def test_redact_record_covers_args_and_tracebacks():
    try:
        raise ValueError("cannot reach http://u:PLANTEDPW1@h/m")
    except ValueError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "scraping %s", ("http://h/m?token=PLANTEDTOK2",),
                                sys.exc_info())
    redact_record(rec)
    out = logging.Formatter().format(rec)
    assert "scraping http://h/m?token=***" in out and "cannot reach http://***@h/m" in out
    assert_clean("formatted record", out)


def test_unnamed_targets_differing_only_in_secrets_keep_distinct_names():
    """Redacted default names could collide (``?engine=0`` and ``?engine=1`` both show as
    ``?engine=***``); the later one is numbered, so the two are never scraped into one target."""
    import asyncio

    from sla_guard.config import ScrapeSource
    from sla_guard.ingest.scrape import Scraper
    from sla_guard.store import SeriesStore

    srv = Served(lambda: "x_total 1\n")
    try:
        cfg = ScrapeSource(targets=[{"url": f"{srv.url}?engine={i}", "model": "m", "pool": "decode"}
                                    for i in range(3)], timeout_s=2)
        store = SeriesStore()
        scraper = Scraper(cfg, store)

        async def once():
            try:
                await scraper.collect(1.0)
            finally:
                await scraper.aclose()

        asyncio.run(once())
    finally:
        srv.stop()
    base = f"{srv.url}?engine=***"
    assert [t.name for t in scraper.targets()] == [base, f"{base}#2", f"{base}#3"]
    assert all(t.up for t in scraper.targets()) and srv.hits == 3
    assert len(store.range("x_total", {}, 0, 1e12)) == 3  # three series, one per target


def test_config_errors_never_echo_a_secret(tmp_path):
    """A config error shows the bad value; a password or token in a URL must not be in it."""
    import subprocess
    import sys

    bad_url = "source:\n  targets:\n    - {url: 'ftp://u:PLANTEDPW7@h:1/metrics?token=PLANTEDTOK8'}\n"
    dup = ("source:\n  targets:\n    - {url: 'http://u:PLANTEDPW7@h:1/metrics'}\n"
           "    - {url: 'http://u:PLANTEDPW7@h:1/metrics'}\n")
    for text, field in ((bad_url, "targets.0.url"), (dup, "targets.1.name")):
        f = tmp_path / "g.yaml"
        f.write_text(text)
        r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "validate-config", str(f)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and field in r.stderr, r.stderr
        assert "PLANTED" not in r.stdout + r.stderr and "***" in r.stderr


# -- outbound parts beyond the guard's own ingest: the webhook, the P/D proxy, the sidecar ------
def test_webhook_failure_shows_no_credentials():
    """A refused webhook's ActuationError becomes the decision record's ``actuated`` (decision log,
    /v1/status): it quoted the webhook URL whole, userinfo and ?token= included."""
    from sla_guard.scale.actuators import ActuationError, WebhookActuator
    from sla_guard.settings.advisor import Webhook

    url = f"http://PLANTEDUSER0:PLANTEDPW1@127.0.0.1:{free_port()}/scale?token=PLANTEDTOK2"
    act = WebhookActuator(Webhook(url=url, retries=0, backoff_s=0.01), token="PLANTEDTOK4")
    with pytest.raises(ActuationError) as err:
        act.set_replicas("m", "decode", 2, "k")
    assert "127.0.0.1" in str(err.value) and "/scale" in str(err.value)  # still says which webhook
    assert_clean("the webhook's ActuationError", str(err.value))


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An engine that answers every POST with 400: the proxy still sends (and httpx logs) a request."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b'{"error": "no"}'
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _stderr_until(proc: subprocess.Popen, marker: str) -> str:
    """Lines of ``proc``'s stderr up to and including the first that contains ``marker``."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if marker in line:
            break
    return "".join(lines)


@pytest.mark.parametrize("level", ["info", "debug"])
def test_pd_proxy_logs_show_no_engine_credentials(level):
    """httpx logs each request's URL whole at INFO: with engine URLs carrying credentials, every
    proxied request wrote them to the proxy's log."""
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    base = f"http://PLANTEDUSER0:PLANTEDPW1@127.0.0.1:{engine.server_port}"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pd_proxy", "--prefill", base + "?key=PLANTEDTOK2", "--decode",
                             base, "--listen", f"127.0.0.1:{port}", "--log-level", level],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out = _stderr_until(proc, "Uvicorn running")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=30,
                       headers={"Authorization": "Bearer PLANTEDTOK5"})
        assert r.status_code == 400
        assert_clean("the proxy's error body", r.text)
        assert_clean("the proxy's /health", httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).text)
        assert_clean("the proxy's /readyz", httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=30).text)
    finally:
        proc.send_signal(signal.SIGINT)
        stdout, rest = proc.communicate(timeout=60)
        engine.shutdown()
    out += rest + stdout
    assert "/v1/completions" in out  # the request was logged, redacted
    assert_clean(f"the proxy's log at {level}", out)


def test_sidecar_logs_show_no_metrics_url_credentials():
    """The sidecar's startup line and its first fetch error quoted ``--metrics-url`` whole."""
    url = f"http://PLANTEDUSER0:PLANTEDPW1@127.0.0.1:{free_port()}/metrics?token=PLANTEDTOK2"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exporters.sidecar", "--metrics-url", url, "--pool", "decode",
                             "--model", "m", "--listen", f"127.0.0.1:{port}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out = _stderr_until(proc, "serving")
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text  # a scrape: the fetch fails
        assert_clean("the sidecar's /metrics", page)
    finally:
        proc.terminate()
        stdout, rest = proc.communicate(timeout=60)
    out += rest + stdout
    assert "sidecar" in out and "127.0.0.1" in out
    assert_clean("the sidecar's log", out)


def test_every_bearer_token_from_the_environment_loses_its_trailing_newline(monkeypatch, caplog):
    """A Secret written with ``echo`` ends in a newline. Prometheus mode dropped it; the Alertmanager
    push and the scaling webhook sent it, and httpx refused the header quoting the token into the log."""
    from sla_guard.compose import build_actuator
    from sla_guard.config import parse_config
    from sla_guard.detect.alertmanager import AlertPublisher
    from sla_guard.detect.findings import FindingsBook
    from sla_guard.outbound import env_value

    monkeypatch.setenv("AM_TOKEN", "PLANTEDAM7\n")
    monkeypatch.setenv("HOOK_TOKEN", " PLANTEDHOOK8\n")
    monkeypatch.setenv("BAD_TOKEN", "two\nlines")
    cfg = parse_config({"alertmanager": {"url": "http://127.0.0.1:9", "bearer_token_env": "AM_TOKEN"},
                        "advisor": {"mode": "active", "model": "m", "actuation": {
                            "webhook": {"url": "http://127.0.0.1:9/scale", "bearer_token_env": "HOOK_TOKEN"}}}})
    pub = AlertPublisher.from_settings(FindingsBook(), cfg.alertmanager)
    assert pub.client._headers == {"Authorization": "Bearer PLANTEDAM7"}
    act = build_actuator(cfg.advisor)
    try:
        assert act._headers == {"Authorization": "Bearer PLANTEDHOOK8"}
    finally:
        act.close()
    with caplog.at_level(logging.WARNING):
        assert env_value("x.bearer_token_env", "BAD_TOKEN", "calling x without a bearer token") is None
    assert "BAD_TOKEN" in caplog.text and "two" not in caplog.text
