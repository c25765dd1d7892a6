"""A real Prometheus (Debian package) on 127.0.0.1 with temporary storage, for tests and
benchmarks that compare the guard with it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from sla_guard.config import parse_config
from sla_guard.ingest.prometheus import PrometheusView
from sla_guard.slo import SLOEvaluator


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusProcess:
    """``prometheus`` scraping ``targets`` (host:port) every ``interval_s`` (``extra``: more
    top-level configuration, e.g. ``remote_read``; ``history``: OpenMetrics text with timestamps,
    backfilled into its storage with ``promtool tsdb create-blocks-from openmetrics`` before it
    starts: hours of a fleet's samples in seconds; ``route_prefix``: served under that path, as
    with ``--web.route-prefix`` behind an Ingress, ``url`` then ends with it; ``web_config``: its
    ``--web.config.file``, e.g. ``basic_auth_users``, with ``auth`` the credentials this harness
    queries with; ``block``: the longest block promtool writes, e.g. "720h" for weeks of history,
    which in 2 h blocks took minutes; ``flags``: more of Prometheus's, e.g. a retention longer than
    its 15 days); stop() kills it and removes its storage."""

    def __init__(self, targets: list[str], interval_s: float = 1.0, job: str = "engines",
                 metrics_path: str = "/metrics", extra: dict | None = None, history: str | None = None,
                 route_prefix: str = "", web_config: dict | None = None,
                 auth: tuple[str, str] | None = None, block: str | None = None,
                 flags: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sla-guard-prom-"))
        if history is not None:
            (self.dir / "history.om").write_text(history)
            longest = [f"--max-block-duration={block}"] if block else []
            subprocess.run([shutil.which("promtool") or "promtool", "tsdb", "create-blocks-from", "openmetrics",
                            *longest, str(self.dir / "history.om"), str(self.dir / "data")],
                           check=True, capture_output=True, timeout=120)
        self.port = _free_port()
        cfg = {
            "global": {"scrape_interval": f"{int(interval_s * 1000)}ms",
                       "scrape_timeout": f"{int(interval_s * 900)}ms",
                       "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "metrics_path": metrics_path,
                                "static_configs": [{"targets": targets}]}],
            **(extra or {}),
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.log = open(self.dir / "log.txt", "w")  # noqa: SIM115 (closed in stop)
        self.url = f"http://127.0.0.1:{self.port}{route_prefix}"
        flags = [*flags, *([f"--web.route-prefix={route_prefix}", f"--web.external-url={self.url}"]
                           if route_prefix else [])]
        if web_config is not None:
            (self.dir / "web.yml").write_text(yaml.safe_dump(web_config))
            flags.append(f"--web.config.file={self.dir / 'web.yml'}")
        self.proc = subprocess.Popen(
            [prometheus_binary() or "prometheus", f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--web.enable-lifecycle", "--log.level=warn", *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(timeout=10, auth=auth)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'log.txt').read_text()[-2000:]}")
            try:
                if self.client.get(f"{self.url}/-/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("prometheus not ready")

    def wait_up(self, n: int, samples: int = 3, timeout: float = 60) -> None:
        """Until ``n`` targets are up with at least ``samples`` scrapes each."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = self.query(f"count_over_time(up[{samples + 2}s]) >= {samples}", time.time())
            if len(r) >= n:
                return
            time.sleep(0.25)
        raise TimeoutError("targets not scraped")

    def query(self, promql: str, at: float) -> list[dict]:
        r = self.client.get(f"{self.url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"})
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def backfilled(history: str, **kw) -> Iterator[PrometheusProcess]:
    """A Prometheus scraping nothing, holding ``history`` (OpenMetrics text with timestamps, ended
    by ``# EOF``) backfilled with promtool, ready to query; stopped on leaving. Timestamps hours
    back are taken as history: every sample is the test's own, so each expected value is exact.
    ``kw``: PrometheusProcess's ``block`` and ``flags``."""
    prom = PrometheusProcess([], interval_s=15.0, history=history, **kw)
    try:
        prom.wait_ready(60)
        yield prom
    finally:
        prom.stop()


class Recording(httpx.HTTPTransport):
    """The real transport, recording each query sent; ``fail`` (a query prefix) answers that
    query with a connection error, as a store that fails one query among many; with ``nth``,
    only the nth query with that prefix (``matched`` counts them), as one piece of a long read."""

    def __init__(self, fail: str | None = None, nth: int | None = None) -> None:
        super().__init__()
        self.sent: list[str] = []
        self.fail = fail
        self.nth = nth
        self.matched = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        query = request.url.params.get("query", "")
        self.sent.append(query)
        if self.fail is not None and query.startswith(self.fail):
            self.matched += 1
            if self.nth is None or self.matched == self.nth:
                raise httpx.ConnectError("store unavailable", request=request)
        return super().handle_request(request)


def judged(prom: PrometheusProcess, slos: list[dict], at: float,
           transport: httpx.BaseTransport | None = None) -> tuple[dict, PrometheusView]:
    """``slos`` judged at ``at`` through ``prom`` as Prometheus mode reads it (``transport``: e.g.
    a Recording that fails a query): (the evaluator's pools by (model, pool), the closed view,
    which keeps its error counts)."""
    view = PrometheusView(prom.url, timeout_s=30, transport=transport)
    ev = SLOEvaluator(parse_config({"slos": slos}))
    try:
        ev.evaluate(view, at)
    finally:
        view.close()
    return ev.pools, view


def tpot_attainment(period: str) -> list[dict]:
    """One SLO set: 99 % of decode TPOTs within 20 ms over ``period`` (5-min window, 5 requests), the
    objective whose threshold bucket the bucket-change tests add to an engine mid-history."""
    return [{"model": "*", "pool": "decode", "objectives": [{
        "name": "att", "indicator": "tpot", "objective": "attainment", "threshold_s": 0.02, "target": 0.99,
        "period": period, "window": "5m", "min_requests": 5}]}]
