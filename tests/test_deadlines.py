"""Deadlines and honest staleness, against real loopback peers: a target that trickles its page
or its headers, a real Prometheus behind a delaying proxy, a hung evaluator, half-open API
connections. Each reproduces a probe that froze the guard into serving a stale "ok" (issue 13)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml
from guard_support import Engine, Served, Trickle, UvicornThread, closed_by_server, free_port, half_open
from prometheus_support import PrometheusProcess, prometheus_binary

from sla_guard.api import create_app, server_config
from sla_guard.compose import compose
from sla_guard.config import parse_config
from sla_guard.model import Status

SLO = [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5,
                        "window": "3s", "min_requests": 3}]}]


def _scrape_cfg(targets, timeout_s=1.0, interval_s=1.0, staleness_s=4.0, eval_s=0.5, **extra):
    return {"source": {"mode": "scrape", "interval_s": interval_s, "timeout_s": timeout_s,
                       "targets": [{"url": u, "model": m, "pool": "decode", "name": n} for n, m, u in targets]},
            "staleness_s": staleness_s, "evaluation_interval_s": eval_s, "slos": SLO, **extra}


@pytest.mark.parametrize("what", ["body", "headers"])
def test_trickling_target_fails_within_its_deadline_and_others_go_on(what):
    ok = Engine(model="good")
    for _ in range(5):
        ok.request(0.2, 0.01)
    srv = Served(ok.exposition)
    slow = Trickle(Engine(model="slow").exposition(), what=what)
    cfg = parse_config(_scrape_cfg([("good", "good", srv.url), ("slow", "slow", slow.url)]))
    guard = compose(cfg, detectors=False, advisor=False).guard
    loop = asyncio.new_event_loop()
    try:
        t0 = time.monotonic()
        loop.run_until_complete(guard.collect())
        took = time.monotonic() - t0
        # the page would take minutes at this rate; the round is bounded by timeout_s (1 s)
        assert took < 10, took
        st = {t.name: t for t in guard.source.targets()}
        assert st["slow"].up is False and st["slow"].errors.get("timeout") == 1, st["slow"]
        assert st["good"].up is True
        guard.tick()
        pools = guard.evaluator("slo").pools
        assert pools[("slow", "decode")].status is Status.UNKNOWN
        assert "targets down" in pools[("slow", "decode")].reason
    finally:
        loop.run_until_complete(guard.source.aclose())
        loop.close()
        slow.stop()
        srv.stop()


def _start_serve(tmp_path, cfg: dict, token: str = "tok"):
    port = free_port()
    cfg = {**cfg, "api": {"listen": f"127.0.0.1:{port}", "token_env": "DEADLINE_TEST_TOKEN"}}
    f = tmp_path / "guard.yaml"
    f.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)],
                            env={**os.environ, "DEADLINE_TEST_TOKEN": token},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}


def _get(url, headers=None):
    try:
        return httpx.get(url, headers=headers, timeout=3)
    except httpx.HTTPError:
        return None


def test_serve_keeps_ticking_past_a_trickling_target_and_stops_on_sigterm(tmp_path):
    """The probe: one target at a byte per second froze every tick for 110+ s while /v1/slo
    served the last "ok"; SIGTERM left the process alive after 30 s."""
    ok = Engine(model="good")
    srv = Served(ok.exposition)
    slow = Trickle(Engine(model="slow").exposition(), what="body", gap_s=1.0)
    proc, url, auth = _start_serve(tmp_path, _scrape_cfg([("good", "good", srv.url), ("slow", "slow", slow.url)]))
    try:
        seen: list[float] = []
        good_status = None
        deadline = time.time() + 40
        while time.time() < deadline and (len(set(seen)) < 5 or good_status != "ok"):
            for _ in range(3):
                ok.request(0.2, 0.01)
            r = _get(f"{url}/v1/slo", auth)
            if r is not None and r.status_code == 200:
                body = r.json()
                if body["evaluated_at"] is not None:
                    seen.append(body["evaluated_at"])
                pools = {p["model"]: p for p in body["pools"]}
                good_status = pools.get("good", {}).get("status")
                if "slow" in pools:
                    assert pools["slow"]["status"] != "ok"
            time.sleep(0.5)
        assert len(set(seen)) >= 5, f"evaluations did not advance: {seen}"
        assert good_status == "ok"
        targets = {t["name"]: t for t in _get(f"{url}/v1/targets", auth).json()["targets"]}
        assert targets["slow"]["up"] is False and targets["slow"]["errors"].get("timeout", 0) >= 1
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        print(f"SIGTERM -> exit in {time.monotonic() - t0:.2f}s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        slow.stop()
        srv.stop()


class _DelayProxy:
    """A real HTTP proxy on 127.0.0.1 forwarding GETs to ``upstream`` after ``delay_s``."""

    def __init__(self, upstream: str) -> None:
        self.delay_s = 0.0
        self.upstream = upstream
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                # in flight: from arrival until the answer is ready (decremented before it is
                # sent, so a client's next request cannot overlap its previous one here)
                with outer.lock:
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    time.sleep(outer.delay_s)
                    r = httpx.get(outer.upstream + self.path, timeout=30)
                    data, code = r.content, r.status_code
                except httpx.HTTPError:
                    data, code = b"upstream down", 502
                finally:
                    with outer.lock:
                        outer.in_flight -= 1
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

            def log_message(self, *a):
                pass

        class S(http.server.ThreadingHTTPServer):
            daemon_threads = True

        self.server = S(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def _prometheus_behind_proxy(wait_up: bool = False):
    """An engine scraped by a real Prometheus, reached through a ``_DelayProxy``: (engine, proxy)."""
    eng = Engine(model="m")
    srv = Served(eng.exposition)
    prom = PrometheusProcess([f"127.0.0.1:{srv.port}"], interval_s=0.5)
    proxy = None
    try:
        prom.wait_ready()
        if wait_up:
            prom.wait_up(1, samples=2)
        proxy = _DelayProxy(prom.url)
        yield eng, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        prom.stop()
        srv.stop()


@pytest.mark.skipif(prometheus_binary() is None, reason="needs the Debian prometheus package (scripts/setup.sh --full)")
def test_slow_prometheus_turns_verdicts_unknown_within_the_staleness_bound():
    """The probe: answers took 15 s with timeout_s 10; ~75 queries ran one after another, so no
    tick completed for 83 s and the pre-incident "ok" was served (~12 min to "unknown")."""
    with _prometheus_behind_proxy() as (eng, proxy):
        cfg = parse_config({"source": {"mode": "prometheus", "url": proxy.url, "timeout_s": 2},
                            "staleness_s": 6, "evaluation_interval_s": 1, "slos": SLO})
        guard = compose(cfg, detectors=False, advisor=False).guard
        app = UvicornThread(create_app(guard))
        stop = asyncio.Event()
        loop = asyncio.new_event_loop()
        runner = threading.Thread(target=loop.run_until_complete, args=(guard.run(stop),), daemon=True)
        runner.start()
        try:
            def status_under_traffic(want: str) -> str:
                status, deadline = None, time.time() + 60
                while time.time() < deadline and status != want:
                    for _ in range(5):
                        eng.request(0.2, 0.01)
                    time.sleep(0.5)
                    status = httpx.get(f"{app.url}/v1/slo", timeout=5).json()["status"]
                return status

            assert status_under_traffic("ok") == "ok", "guard never saw the healthy pool through Prometheus"
            proxy.delay_s = 5.0  # every answer now takes longer than timeout_s
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60:
                status = httpx.get(f"{app.url}/v1/slo", timeout=5).json()["status"]
                if status == "unknown":
                    break
                time.sleep(0.25)
            to_unknown = time.monotonic() - t0
            print(f"slow Prometheus: ok -> unknown after {to_unknown:.1f}s (staleness_s 6, timeout_s 2)")
            assert status == "unknown"
            # bounded by the staleness bound plus one watchdog period, not by the query count
            assert to_unknown < 6 + 5, to_unknown
            while time.monotonic() - t0 < 60 and httpx.get(f"{app.url}/readyz", timeout=5).status_code != 503:
                time.sleep(0.25)
            to_unready = time.monotonic() - t0
            print(f"slow Prometheus: /readyz 503 after {to_unready:.1f}s")
            assert to_unready < 6 + 5, to_unready
            proxy.delay_s = 0.0
            assert status_under_traffic("ok") == "ok", "guard did not recover once Prometheus answered again"
        finally:
            loop.call_soon_threadsafe(stop.set)
            runner.join(15)
            app.stop()


class _Hang:
    """An evaluator that blocks its tick until released: a stand-in for any frozen dependency."""

    name = "hang"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.hang = False

    def evaluate(self, view, now):
        if self.hang:
            self.release.wait(60)

    def snapshot(self):
        return {}


def test_watchdog_expires_verdicts_when_ticks_stop_completing():
    eng = Engine(model="m")
    srv = Served(eng.exposition)
    cfg = parse_config(_scrape_cfg([("e", "m", srv.url)], staleness_s=2.0, eval_s=0.25, interval_s=0.25,
                                   timeout_s=0.25))
    hang = _Hang()
    guard = compose(cfg, extra_evaluators=[hang], detectors=False, advisor=False).guard
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_until_complete, args=(guard.run(stop),), daemon=True)
    runner.start()
    slo = guard.evaluator("slo")
    try:
        deadline = time.time() + 30
        while time.time() < deadline and slo.overall() is not Status.OK:
            for _ in range(5):
                eng.request(0.2, 0.01)
            time.sleep(0.2)
        assert slo.overall() is Status.OK and guard.ready()
        hang.hang = True
        deadline = time.time() + 30
        while time.time() < deadline and slo.overall() is not Status.UNKNOWN:
            time.sleep(0.2)
        assert slo.overall() is Status.UNKNOWN
        assert "stale" in slo.pools[("m", "decode")].reason and not guard.ready()
        assert guard.status()["stale"] is True
        hang.hang = False
        hang.release.set()
        deadline = time.time() + 30
        while time.time() < deadline and slo.overall() is not Status.OK:
            for _ in range(5):
                eng.request(0.2, 0.01)
            time.sleep(0.2)
        assert slo.overall() is Status.OK and guard.ready()
    finally:
        hang.release.set()
        loop.call_soon_threadsafe(stop.set)
        runner.join(15)
        srv.stop()


def test_api_closes_half_open_connections():
    """1,000 half-open connections were kept forever (no header timeout); now each must finish
    its request within the request timeout or be closed."""
    import uvicorn

    cfg = parse_config(_scrape_cfg([("e", "m", "http://127.0.0.1:9/metrics")]))
    guard = compose(cfg, detectors=False, advisor=False).guard
    port = free_port()
    server = uvicorn.Server(server_config(create_app(guard), "127.0.0.1", port, request_timeout_s=1.0))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    socks = []
    try:
        socks = half_open(port, [b"GET /healthz HTTP/1.1\r\nHost: x\r\n"] * 50)  # headers never finished
        closed = closed_by_server(socks)
        assert closed == len(socks), f"{closed} of {len(socks)} half-open connections closed"
        # a well-behaved client still gets its answer
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()
        server.should_exit = True
        th.join(10)


def test_check_honours_its_timeouts(tmp_path):
    """`sla-guard check` with timeout_s 3 was still hanging at 40 s on a trickling target."""
    slow = Trickle(Engine(model="slow").exposition(), what="headers", gap_s=1.0)
    f = tmp_path / "g.yaml"
    f.write_text(yaml.safe_dump(_scrape_cfg([("slow", "slow", slow.url)], timeout_s=2.0, interval_s=2.0)))
    try:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(f)],
                           capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and "down" in r.stderr
        print(f"check on a trickling target: exit 2 after {took:.1f}s (timeout_s 2)")
    finally:
        slow.stop()


@pytest.mark.skipif(prometheus_binary() is None, reason="needs the Debian prometheus package (scripts/setup.sh --full)")
def test_prometheus_queries_run_concurrently_and_agree_with_sequential():
    """A tick's ~dozens of queries go out ``concurrency`` at a time (last tick's set, prefetched);
    the verdicts are the same as one query at a time, at the same evaluation instant."""
    with _prometheus_behind_proxy(wait_up=True) as (eng, proxy):
        for _ in range(8):
            for _ in range(5):
                eng.request(0.3, 0.01)
            time.sleep(0.5)
        base = {"staleness_s": 30, "evaluation_interval_s": 5, "slos": SLO}
        guards = {n: compose(parse_config({**base, "source": {
            "mode": "prometheus", "url": proxy.url, "timeout_s": 5, "concurrency": n}}),
            detectors=False, advisor=False).guard for n in (1, 8)}
        at = round(time.time() - 1, 3)
        snaps = {}
        for n, g in guards.items():
            proxy.max_in_flight = 0
            g.tick(at)  # learns the query set
            g.tick(at)  # prefetches it
            snaps[n] = (g.evaluator("slo").snapshot(), proxy.max_in_flight, g.source.view.queries)
        (s1, inflight1, _), (s8, inflight8, q8) = snaps[1], snaps[8]
        assert inflight1 == 1 and inflight8 >= 2, (inflight1, inflight8)
        assert s1["pools"] == s8["pools"] and s8["status"] == "ok"
        print(f"prefetch: {q8} queries over two ticks, up to {inflight8} in flight")


def test_prometheus_trickling_its_headers_fails_the_query_at_its_deadline():
    """httpx's timeout bounds each read, not the request: a Prometheus sending its headers one
    byte every 0.2 s held a query (and the guard's tick) until the headers were in: 16 s here.
    The query now fails at its 1 s budget, counted as a timeout, and reads unknown."""
    import json

    from sla_guard.ingest.prometheus import PrometheusView

    body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"model": "m"}, "value": [1.0, "1"]}]}})
    slow = Trickle(body, what="headers")
    view = PrometheusView(f"http://127.0.0.1:{slow.port}", timeout_s=1.0)
    try:
        t0 = time.monotonic()
        got = view.instant("x", {}, 1.0)
        took = time.monotonic() - t0
        print(f"trickled headers: query failed after {took:.2f}s (budget 1 s)")
        assert got == {} and view.errors.get("timeout") == 1, view.errors
        assert took < 5, took  # the headers alone take ~16 s at this rate
    finally:
        slow.stop()
        view.close()
