"""Helpers for the guard's tests: engines that emit the contract through the real
``EngineRecorder`` on their own prometheus_client registry, optionally served over real
loopback HTTP. Observations are driven by the test, so every expected value is computed from
what was recorded, not hard-coded."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.server
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import uvicorn
import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from exporters.contract import Component
from exporters.prometheus import ContractMetrics, EngineRecorder, FinishedRequest
from sla_guard.config import GuardConfig, parse_config
from sla_guard.ingest import build_store
from sla_guard.ingest.scrape import Scraper
from sla_guard.ingest.source import UP, TargetState
from sla_guard.slo import PoolResult, SLOEvaluator, SLOResult
from sla_guard.store import SeriesStore

T0 = 1_700_000_000.0


class Engine:
    """One simulated engine = one registry + recorder; ``restart()`` models an engine restart
    (new registry: every counter back to zero)."""

    def __init__(self, model: str = "m", pool: str = "decode", engine: str = "0",
                 components: tuple[Component, ...] = (Component.ENGINE,)) -> None:
        self.model, self.pool, self.engine = model, pool, engine
        self.components = components
        self.lock = threading.Lock()
        self.restart()

    def restart(self) -> None:
        with getattr(self, "lock", threading.Lock()):
            self.registry = CollectorRegistry()
            self.rec = EngineRecorder(ContractMetrics(self.registry, components=self.components),
                                      self.model, self.pool, self.engine)
            self.sent_ttft: list[float] = []
            self.sent_tpot: list[float] = []

    def request(self, ttft: float, tpot: float, tokens: int = 8) -> None:
        with self.lock:
            self.rec.observe_ttfts([ttft])
            self.rec.finished(FinishedRequest(e2e_s=ttft + tpot * tokens, queue_s=0.01, prefill_s=ttft,
                                              decode_s=tpot * tokens, tpot_s=tpot, prompt_tokens=64,
                                              cached_tokens=0, generated_tokens=tokens))
            self.rec.tokens(tokens, computed=64)
            self.rec.scheduler(running=1, waiting=0, kv_usage=0.3)
            self.sent_ttft.append(ttft)
            self.sent_tpot.append(tpot)

    def exposition(self) -> str:
        with self.lock:
            return generate_latest(self.registry).decode()


class Router:
    """A P/D router's client scope, emitted with prometheus_client from the contract's client
    families (what sla-guard-proxy exposes): the guard addresses it as pool="client"."""

    def __init__(self, model: str = "m", router: str = "proxy-0") -> None:
        from exporters import contract as c

        self.registry = CollectorRegistry()
        labels = {"model": model, "pool": c.Pool.CLIENT.value, "route": c.Route.PD.value, "router": router}
        self.model, self.pool, self.engine = model, c.Pool.CLIENT.value, router

        def hist(m):
            return Histogram(m.name, m.help, list(m.labels), registry=self.registry, buckets=m.buckets)

        self._ttft = hist(c.CLIENT_TTFT).labels(**labels)
        self._tpot = hist(c.CLIENT_TPOT).labels(**labels)
        stage = hist(c.CLIENT_STAGE)
        self._stage = {s.value: stage.labels(**labels, stage=s.value) for s in c.Stage}
        self._failed = [Counter(m.name, m.help, list(m.labels), registry=self.registry).labels(**labels)
                        for m in (c.CLIENT_FAILED_BEFORE_FIRST_TOKEN, c.CLIENT_FAILED_AFTER_FIRST_TOKEN)]
        outcomes = Counter(c.CLIENT_REQUESTS.name, c.CLIENT_REQUESTS.help, list(c.CLIENT_REQUESTS.labels),
                           registry=self.registry)
        self._outcome = {o.value: outcomes.labels(**labels, outcome=o.value) for o in c.Outcome}
        self.sent_ttft: list[float] = []

    def request(self, ttft: float, tpot: float, prefill_leg: float | None = None,
                decode_first_leg: float | None = None) -> None:
        """One client request; with both legs, the router's stages too (proxy = the rest)."""
        self._ttft.observe(ttft)
        self._tpot.observe(tpot)
        if prefill_leg is not None and decode_first_leg is not None:
            self._stage["prefill_leg"].observe(prefill_leg)
            self._stage["decode_first_leg"].observe(decode_first_leg)
            self._stage["proxy"].observe(ttft - prefill_leg - decode_first_leg)
        self.sent_ttft.append(ttft)
        self._outcome["ok"].inc()

    def failed(self, before_first_token: int, after_first_token: int) -> None:
        """Streamed requests the service failed before / after their first token (no TTFT / no TPOT)."""
        self._failed[0].inc(before_first_token)
        self._failed[1].inc(after_first_token)
        self._outcome["error"].inc(before_first_token + after_first_token)

    def ended(self, outcome: str, n: int = 1) -> None:
        """``n`` more requests with ``outcome`` and nothing else observed (non-streamed, or the client's)."""
        self._outcome[outcome].inc(n)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def half_open(port: int, requests: list[bytes]) -> list[socket.socket]:
    """One loopback connection to ``port`` per request in ``requests``, each sent and never finished
    (a slowloris client: headers cut, or a body promised and not sent); the caller closes them."""
    socks = []
    for data in requests:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(data)
        socks.append(s)
    return socks


def closed_by_server(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the server closed (end of stream read within their 10 s timeout)."""
    n = 0
    for s in socks:
        with contextlib.suppress(TimeoutError):
            n += s.recv(1024) == b""
    return n


class _Server(http.server.ThreadingHTTPServer):
    allow_reuse_address = True  # a "restarted engine" binds the same port again
    daemon_threads = True


class Served:
    """A real HTTP server on 127.0.0.1 answering GET /metrics with ``body()``; ``mode`` switches
    behaviour at run time (ok, down, slow, error, huge, garbage...)."""

    def __init__(self, body: Callable[[], str | bytes], port: int | None = None) -> None:
        self.body = body
        self.mode = "ok"
        self.slow_s = 5.0
        self.hits = 0
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.hits += 1
                if outer.mode == "slow":
                    import time

                    time.sleep(outer.slow_s)
                if outer.mode == "error":
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"boom")
                    return
                data = outer.body()
                if isinstance(data, str):
                    data = data.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                if outer.mode in ("gzip", "gzipped"):  # gzipped: body() is compressed already
                    data = gzip.compress(data) if outer.mode == "gzip" else data
                    self.send_header("Content-Encoding", "gzip")
                if outer.mode != "chunked":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.port = port or free_port()
        self.server = _Server(("127.0.0.1", self.port), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def scrape_into(store, engines, t, up=True):
    for e in engines:
        name = f"{e.model}/{e.pool}/{e.engine}"
        labels = {"instance": name, "model": e.model, "pool": e.pool}
        if up:
            store.ingest_text(e.exposition(), t, labels, group=name)
        else:
            store.mark_stale(name, t)
        store.append(UP, labels, t, 1.0 if up else 0.0, group=name + "#up")


def drive(engines, seconds, per_tick, *, store=None, ev=None, cfg=None, t0=T0, rng=None):
    """Every 5 s: each engine serves per_tick(rng) requests, then is scraped; evaluate every 15 s."""
    cfg = cfg or parse_config({"evaluation_interval_s": 15, "staleness_s": 60})
    store = store or SeriesStore(slots=400, lookback_s=cfg.staleness_s)
    ev = ev or SLOEvaluator(cfg)
    rng = rng or np.random.default_rng(0)
    t = t0
    for step in range(int(seconds // 5) + 1):
        t = t0 + step * 5
        for e in engines:
            for ttft, tpot in per_tick(rng, e):
                e.request(ttft, tpot)
        scrape_into(store, engines, t)
        if step % 3 == 0:
            ev.evaluate(store, t)
    return store, ev, t


class ScrapeRig:
    """The real Scraper on ``cfg``'s targets into ``store`` (else the store ``cfg`` sizes) and the
    real SLOEvaluator, on an event loop of its own, stamped with a clock the test moves (``now``):
    real servers scraped and judged step by step, each verdict read at a time the test chose.
    close() closes the scraper and the loop; the servers are the test's."""

    def __init__(self, cfg: GuardConfig, store: SeriesStore | None = None, now: float = T0) -> None:
        self.cfg, self.now = cfg, now
        self.store = build_store(cfg) if store is None else store
        self.scraper = Scraper(cfg.source, self.store, clock=lambda: self.now)
        self.ev = SLOEvaluator(cfg)
        self.loop = asyncio.new_event_loop()

    def collect(self, dt: float = 0.0) -> None:
        """``dt`` seconds on, every target scraped (as the guard's loop does)."""
        self.now += dt
        self.loop.run_until_complete(self.scraper.collect())

    def scrape(self, dt: float = 0.0, target: int = 0) -> TargetState:
        """``dt`` seconds on, the ``target``-th configured target scraped: its state."""
        self.now += dt
        return self.loop.run_until_complete(self.scraper.scrape_target(self.cfg.source.targets[target]))

    def judge(self, model: str, pool: str, view=None) -> PoolResult:
        """Every pool evaluated now on ``view`` (default: the store): the verdict of ``model``/``pool``."""
        self.ev.evaluate(self.store if view is None else view, self.now)
        return self.ev.pools[(model, pool)]

    def slos(self, model: str, pool: str, view=None) -> dict[str, SLOResult]:
        """judge(), its objectives by name."""
        return {s.slo: s for s in self.judge(model, pool, view).slos}

    def close(self) -> None:
        self.loop.run_until_complete(self.scraper.aclose())
        self.loop.close()


class UvicornThread:
    """A real uvicorn serving ``app`` on a free 127.0.0.1 port in a thread."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(5)


class Trickle:
    """A real TCP server on 127.0.0.1 answering every request with ``body`` one byte every
    ``gap_s`` seconds -- the page (``what='body'``) or already the headers (``what='headers'``).
    A whole answer takes minutes; a per-read timeout alone never fires."""

    def __init__(self, body: str, what: str = "body", gap_s: float = 0.2) -> None:
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(body.encode())}\r\n\r\n").encode()
        payload = head + body.encode()
        split = 0 if what == "headers" else len(head)
        self.closed = threading.Event()
        outer = self

        class H(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.recv(65536)
                try:
                    self.request.sendall(payload[:split])
                    for i in range(split, len(payload)):
                        if outer.closed.is_set():
                            return
                        self.request.sendall(payload[i:i + 1])
                        time.sleep(gap_s)
                except OSError:
                    return

        class S(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = S(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def stop(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()


ROOT_DIR = Path(__file__).resolve().parent.parent
GUARD_TOKEN = "api-token-for-tests"  # GuardProcess's API bearer token


# -- a real `sla-guard serve` process ---------------------------------------------------------
class GuardProcess:
    """``sla-guard serve`` on a free loopback port, its output in a file."""

    def __init__(self, tmp: Path, cfg: dict, *, log_level: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {**cfg, "api": {"listen": f"127.0.0.1:{self.port}", "token_env": "SLA_GUARD_TEST_API_TOKEN"}}
        f = tmp / f"guard-{self.port}.yaml"
        f.write_text(yaml.safe_dump(cfg))
        self.log = tmp / f"guard-{self.port}.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f), "--log-level", log_level],
            env={**os.environ, **(env or {}), "SLA_GUARD_TEST_API_TOKEN": GUARD_TOKEN}, cwd=ROOT_DIR,
            stdout=self._out, stderr=subprocess.STDOUT)

    def get(self, path: str, auth: bool = True) -> httpx.Response:
        headers = {"Authorization": f"Bearer {GUARD_TOKEN}"} if auth else {}
        return httpx.get(self.url + path, headers=headers, timeout=5)

    def wait_for(self, what: str, predicate, limit_s: float = 60.0):
        """Poll ``predicate()`` until it returns something truthy (the process must stay up)."""
        deadline = time.monotonic() + limit_s
        while True:
            assert self.proc.poll() is None, f"guard exited: {self.log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError, ValueError):  # not up yet, or not JSON yet
                got = predicate()
                if got:
                    return got
            if time.monotonic() > deadline:
                raise AssertionError(f"guard never got to: {what}\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def surfaces(self) -> dict[str, str]:
        """Everything the API serves (each must answer 200)."""
        out = {}
        for path, auth in (("/metrics", False), ("/v1/targets", True), ("/v1/status", True), ("/v1/slo", True),
                           ("/v1/findings?state=all", True)):
            r = self.get(path, auth)
            assert r.status_code == 200, (path, r.status_code, r.text[:300])
            out[path] = r.text
        return out

    def stop(self) -> str:
        """SIGTERM, wait, and the whole log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()
        return self.log.read_text()
