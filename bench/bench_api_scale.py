"""The guard's HTTP API at fleet scale: every /v1 endpoint's size, time and memory per request.

The guard is composed as ``serve`` composes it (SLO, detectors, advisor) and its state is
built directly in the real evaluators and stores at the size of a big deployment: 1,000 engines
(4,000 processes: leak verdicts and census), 5,000 open findings (+500 resolved), 2,000 drift
groups per drift evaluator, 200 model/pool pairs judged by the SLO evaluator, 1,000 scrape
targets, 256 decisions. It is served by a real uvicorn on 127.0.0.1 and asked with httpx.

Printed per endpoint: bytes of the answer, seconds to answer (median of 3), the peak Python
memory allocated while answering (tracemalloc); then 50 concurrent clients (in a process of their
own) on /v1/status and on the largest answer, twice: traced, the peak memory; untraced, the wall
time, the latency of /healthz asked meanwhile, and how much slower a pure-Python stand-in for the
tick runs in the server's process meanwhile than idle (a ratio: the machine is shared and noisy;
tracemalloc alone makes the stand-in about 11x slower, so it is off for that). Last, the autoscalers'
reads (KEDA's ``/v1/scale/keda``, ``/v1/recommendations``; the advisor's decision for 64 models,
one rolling restart per open leak finding) and ``/healthz``, polled while 50 clients ask
``/v1/status``: served with every /v1 request in one queue (``V1Limit`` as it was) and with the
autoscaler reads' own lane (as it is), side by side. The answers that carry the advisor's last
decision are also sized with its rolling restarts whole, as they were before they were paged
(without the ``finding`` key each names now).

Usage: .venv/bin/python bench/bench_api_scale.py [--engines 1000] [--findings 5000] [--autoscaler-only]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import statistics
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
from starlette.middleware import Middleware

from exporters import contract as c

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from guard_support import UvicornThread

from sla_guard.api import AUTOSCALER_READS, V1Limit, create_app
from sla_guard.compose import compose
from sla_guard.config import parse_config
from sla_guard.detect import drift, leak
from sla_guard.ingest.source import StoreSource, TargetState
from sla_guard.model import PoolRecommendation, Status, jsonable
from sla_guard.scale.advisor import leak_restarts
from sla_guard.slo import PoolResult, SLOResult
from sla_guard.store import SeriesStore

TOKEN = "t"
NOW = 1_800_000_000.0


class FleetSource(StoreSource):
    """The store source with ``n`` scrape targets' states (what /v1/targets shows)."""

    def __init__(self, store: SeriesStore, n: int) -> None:
        super().__init__(store)
        self._t = [TargetState(f"engine-{i}", f"http://10.0.{i // 250}.{i % 250}:8000/metrics", f"model-{i % 100}",
                               "prefill" if i % 2 else "decode", up=True, last_scrape=NOW, last_duration_s=0.05,
                               samples=300, errors={"timeout": 1}) for i in range(n)]

    def targets(self) -> list[TargetState]:
        return list(self._t)


def build(engines: int, findings: int):
    """The composed guard with its state at fleet scale."""
    cfg = parse_config({"advisor": {"model": "*"}})
    comp = compose(cfg, source=FleetSource(SeriesStore(), engines), clock=lambda: NOW)
    g, book = comp.guard, comp.findings
    procs = [(f"model-{i % 100}", "prefill" if i % 2 else "decode", f"engine-{i}", role, str(1000 + j))
             for i in range(engines) for j, role in enumerate(("api_server", "engine_core", "worker", "worker"))]
    lk = g.evaluator("leak")
    for p in procs:
        lk.verdicts["/".join(p)] = leak.LeakVerdict("ok", "no growth", at=NOW, z=0.3)
    census = g.evaluator("census")
    if census is not None:
        census.by_process = {p: [{"type": "dict", "count": 1000 + i, "growth": 5} for i in range(5)] for p in procs}
    for name in ("acceptance_drift", "prefix_hit_drift"):
        ev = g.evaluator(name)
        for i in range(2000):
            ev.cusums[(f"model-{i % 100}", "decode", f"engine-{i}")] = drift.RateCusum(drift.RateDriftParams())
    for i in range(findings):
        p = procs[i % len(procs)]
        book.raise_("leak", f"leak/{'/'.join(p)}/{i}", "warning", f"RSS of {p[2]} grows 12 MiB/h",
                    {"model": p[0], "pool": p[1], "engine": p[2], "role": p[3], "process_pid": p[4]},
                    {"slope_mib_per_h": 12.0, "z": 4.2, "eta_s": 86400.0}, NOW)
    for i in range(500):
        book.raise_("tpot_drift", f"r/{i}", "warning", "x", {"model": "m", "pool": "decode"}, {}, NOW)
        book.resolve(f"r/{i}", NOW)
    slo = g.evaluator("slo")
    slo.evaluated_at = NOW
    slo.pools = {(f"model-{i // 2}", "prefill" if i % 2 else "decode"): PoolResult(
        f"model-{i // 2}", "prefill" if i % 2 else "decode", Status.OK, 5, 5, slos=[
            SLOResult(f"model-{i // 2}", "p", s, "ttft", "mean", 1.0, Status.OK, 0.5, 1000.0, "5m")
            for s in ("ttft_mean", "tpot_mean", "ttft_p90")]) for i in range(200)}
    adv = comp.advisor
    # the advisor's last decision: both pools of every model it advises (max_models), and one
    # rolling restart per open leak finding of those models (what /v1/recommendations carries)
    models = [f"model-{i}" for i in range(min(100, adv.max_models))]
    adv._seen = dict.fromkeys(models, NOW)
    adv._recs = [PoolRecommendation(m, pool, 3, 4, ["prefill_ttft_headroom"], 0.8, {"utilisation": 0.9})
                 for m in models for pool in ("prefill", "decode")]
    adv._restarts = [r for m in models for r in leak_restarts(book.open_findings(), m)]
    adv.updated_at = NOW
    for i in range(300):
        adv.history.append({"t": NOW + i, "model": f"model-{i % 100}", "pool": "decode", "action": "hold",
                            "desired": 3, "current": 3, "reasons": ["within band"]})
    slo._export()  # the SLO series /metrics carries for the 200 pools
    m = g.metrics
    for i, p in enumerate(procs):  # what the leak evaluator and the scraper export per process / target
        m[c.GUARD_LEAK_SLOPE].labels(p[0], p[1], p[2], f"{p[3]}-{p[4]}").set(0.0)
        if i < engines:
            m[c.GUARD_TARGET_UP].labels(f"engine-{i}", p[0], p[1]).set(1)
            m[c.GUARD_SCRAPE_ERRORS].labels(f"engine-{i}", "timeout").inc()
    g.last_tick = None
    return comp


def _one(url: str, h: dict) -> int:
    with httpx.Client(timeout=300) as c:
        return c.get(url, headers=h).status_code


def storm(url: str, h: dict, n: int) -> list[int]:
    """``n`` clients asking ``url`` at once (run in a process of its own)."""
    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        return list(ex.map(_one, [url] * n, [h] * n))


def polled_storm(url: str, h: dict, n: int, polls: list[str]) -> tuple[list[int], dict[str, list[float]]]:
    """``storm`` while one autoscaler per URL of ``polls`` polls it (every 50 ms), as KEDA's
    metrics-api scaler would: each poll's seconds (run in a process of its own)."""
    stop = threading.Event()
    lat: dict[str, list[float]] = {p: [] for p in polls}

    def poll(p: str) -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = c.get(p, headers=h)
                lat[p].append(time.perf_counter() - t)
                assert r.status_code == 200, (p, r.status_code, r.text)
                time.sleep(0.05)

    pollers = [threading.Thread(target=poll, args=(p,)) for p in polls]
    for t in pollers:
        t.start()
    try:
        codes = storm(url, h, n)
    finally:
        stop.set()
        for t in pollers:
            t.join()
    return codes, lat


POLLED = ["/v1/scale/keda?model=model-1", "/v1/scale/keda/decode?model=model-1",
          "/v1/recommendations?model=model-1", "/healthz"]


def autoscaler_part(comp, clients: int) -> None:
    """The autoscalers' reads during ``clients`` clients on /v1/status, served with /v1's one
    queue (as before) and with their own lane (now), one after the other in this run."""
    h = {"Authorization": f"Bearer {TOKEN}"}
    print(f"autoscaler reads, idle and during {clients} clients on /v1/status (s; storm max / idle median):")
    for name, lane in (("one /v1 queue", ()), ("own lane", AUTOSCALER_READS)):
        app = create_app(comp.guard, token=TOKEN, extra_routers=comp.routers)
        # the one-queue V1Limit is V1Limit without autoscaler reads: every /v1 request waits in one queue
        app.user_middleware = [Middleware(V1Limit, autoscaler_reads=lane) if m.cls is V1Limit else m
                               for m in app.user_middleware]
        srv = UvicornThread(app)
        with httpx.Client(timeout=60) as cl:
            idle = {}
            for p in POLLED:
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    assert cl.get(srv.url + p, headers=h).status_code == 200
                    times.append(time.perf_counter() - t0)
                idle[p] = statistics.median(times)
        t0 = time.perf_counter()
        with multiprocessing.get_context("fork").Pool(1) as mp:
            codes, lat = mp.apply(polled_storm, (srv.url + "/v1/status", h, clients,
                                                 [srv.url + p for p in POLLED]))
        wall = time.perf_counter() - t0
        srv.stop()
        print(f"  {name}: storm {wall:.1f} s wall, statuses {sorted(set(codes))}")
        for p in POLLED:
            got = lat[srv.url + p]
            print(f"    {p:40} idle {idle[p]:.4f}  storm median {statistics.median(got):.3f} "
                  f"max {max(got):.3f} ({len(got)} polls)  {max(got) / idle[p]:,.0f}x")


ADVISED = ["/v1/status", "/v1/status?evaluator=advisor", "/v1/recommendations", "/v1/recommendations?model=model-1"]


def unpaged(path: str, body: dict, adv) -> int:
    """Bytes of ``body`` (the answer to ``path``) with the advisor's restarts whole and without
    the ``finding`` each names now, as before they were paged, rendered as the API renders JSON."""
    model = httpx.URL(path).params.get("model")
    snap = jsonable(adv.snapshot(model=model if adv.wildcard else None))
    for r in snap["restarts"]:
        del r["finding"]
    if path.startswith("/v1/status"):
        body = {**body, "evaluators": {**body["evaluators"], "advisor": snap}}
        body.pop("next", None)
    else:
        body = {"models": [{"model": model or adv.model, **snap}]}
    return len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--findings", type=int, default=5000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--autoscaler-only", action="store_true", help="only the autoscaler reads' part")
    a = ap.parse_args()
    comp = build(a.engines, a.findings)
    if a.autoscaler_only:
        return autoscaler_part(comp, a.clients)
    app = create_app(comp.guard, token=TOKEN, extra_routers=comp.routers)
    srv = UvicornThread(app)
    h = {"Authorization": f"Bearer {TOKEN}"}
    paths = ["/v1/status", "/v1/findings", "/v1/findings?state=all", "/v1/findings?limit=1000",
             "/v1/status?evaluator=leak&limit=1000",
             "/v1/status?evaluator=advisor", "/v1/slo", "/v1/targets", "/v1/recommendations",
             "/v1/recommendations?model=model-1", "/v1/recommendations?limit=100",
             "/v1/scale/keda?model=model-1", "/v1/scale/keda/decode?model=model-1", "/v1/decisions?model=model-1",
             "/v1/ttft-breakdown", "/metrics"]
    sizes, bodies = {}, {}
    with httpx.Client(timeout=120) as cl:
        print(f"{'endpoint':42} {'status':>6} {'bytes':>11} {'s (median)':>11} {'peak MiB':>9}")
        for p in paths:
            times = []
            for _ in range(3):
                tracemalloc.start()
                t0 = time.perf_counter()
                r = cl.get(srv.url + p, headers=h)
                times.append(time.perf_counter() - t0)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            sizes[p] = len(r.content)
            if p in ADVISED:
                bodies[p] = r.json()
            print(f"{p:42} {r.status_code:>6} {len(r.content):>11,} {statistics.median(times):>11.4f} "
                  f"{peak / 2**20:>9.1f}")
    adv = comp.advisor
    print(f"the advisor's {len(adv.recommendations()[1]):,} rolling restarts whole (before paging) -> paged (bytes):")
    for p in ADVISED:
        print(f"  {p:40} {unpaged(p, bodies[p], adv):>11,} -> {sizes[p]:>9,}")
    big = max((p for p in paths if p != "/metrics"), key=sizes.get)

    def probe(stop):  # a kubelet's liveness probe and the event loop, while the clients ask
        lat = []
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(srv.url + "/healthz")
                lat.append(time.perf_counter() - t)
                time.sleep(0.05)
        return lat

    def work() -> float:  # a stand-in for the tick: pure-Python CPU work in its own thread
        t = time.perf_counter()
        sum(i * i for i in range(300_000))
        return time.perf_counter() - t

    def ticker(stop):
        out = []
        while not stop.is_set():
            out.append(work())
        return out

    def stormed(path: str, traced: bool):
        """One storm of the clients on ``path``: traced, its peak allocation alone; untraced, the
        probe and the tick stand-in beside it. tracemalloc hooks every allocation of every thread:
        on, it made the stand-in alone 11x slower, and the storm's 41-44x (session 35) was mostly that."""
        stop = threading.Event()
        if traced:
            tracemalloc.start()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            probing = None if traced else ex.submit(probe, stop)
            ticking = None if traced else ex.submit(ticker, stop)
            # the clients in another process: in this one they would take the GIL from the server
            with multiprocessing.get_context("fork").Pool(1) as mp:
                codes = mp.apply(storm, (srv.url + path, h, a.clients))
            stop.set()
            wall = time.perf_counter() - t0
            if traced:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                return codes, wall, peak
            return codes, wall, (probing.result(), ticking.result())

    idle = statistics.median(work() for _ in range(5))
    for p in ("/v1/status", big):
        big = p
        _, _, peak = stormed(big, traced=True)
        codes, wall, (lat, ticks) = stormed(big, traced=False)
        print(f"{a.clients} concurrent clients on {big}: {wall:.2f} s wall (untraced), peak {peak / 2**20:.1f} MiB "
              f"(traced run), statuses {sorted(set(codes))}; /healthz meanwhile: max {max(lat):.3f} s, "
              f"median {statistics.median(lat):.3f} s; tick stand-in {statistics.median(ticks) / idle:.1f}x "
              "its idle time")
    srv.stop()
    autoscaler_part(comp, a.clients)


if __name__ == "__main__":
    main()
