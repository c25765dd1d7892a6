"""Soak: the guard's serve loop scraping 200 engines for a while; is its memory flat?

200 engines (EngineRecorder, contract metrics, live traffic: each scrape first records a few
requests on that engine) are served over loopback HTTP; the guard runs its real asyncio loop
(scrape every 5 s, evaluate every 15 s) for ``--minutes`` (the issue asks for 10). RSS is
sampled every 5 s; the slope is fitted (least squares) over the second half of the run and
printed per hour, with the ratio of the final RSS to the RSS at half-time and the RSS at every
minute. The engines and their HTTP server run in a child process, so only the guard is measured.

Usage: .venv/bin/python bench/bench_guard_soak.py [--minutes 10] [--targets 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import os
import threading
import time

import numpy as np
import psutil
from prometheus_client import CollectorRegistry, generate_latest

from exporters.contract import Component
from exporters.prometheus import ContractMetrics, EngineRecorder, FinishedRequest
from sla_guard.compose import compose
from sla_guard.config import parse_config


class Engines:
    def __init__(self, n: int) -> None:
        self.regs, self.recs, self.rngs = [], [], []
        self.locks = [threading.Lock() for _ in range(n)]
        for i in range(n):
            reg = CollectorRegistry()
            rec = EngineRecorder(ContractMetrics(reg, components=(Component.ENGINE,)), f"model{i % 4}",
                                 ("prefill", "decode")[i % 2], str(i))
            self.regs.append(reg)
            self.recs.append(rec)
            self.rngs.append(np.random.default_rng(i))

    def page(self, i: int) -> bytes:
        with self.locks[i]:
            rec, rng = self.recs[i], self.rngs[i]
            for _ in range(int(rng.integers(1, 6))):
                ttft = float(rng.lognormal(-1.2, 0.6))
                rec.observe_ttfts([ttft])
                rec.finished(FinishedRequest(1.0, 0.02, ttft, 0.5, float(rng.uniform(0.005, 0.02)), 500, 100, 40))
                rec.tokens(40, computed=400, local_hit=100)
            rec.scheduler(int(rng.integers(0, 16)), int(rng.integers(0, 3)), float(rng.uniform()))
            return generate_latest(self.regs[i])


def serve(engines: Engines) -> http.server.ThreadingHTTPServer:
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            try:
                i = int(self.path.rsplit("/", 1)[1])
                body = engines.page(i)
            except (ValueError, IndexError):
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the guard timed out
                self.wfile.write(body)

        def log_message(self, *a):
            pass

    class S(http.server.ThreadingHTTPServer):
        daemon_threads = True

    srv = S(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _engine_server(n: int, port_q) -> None:
    """Child process: the engines and their HTTP server (kept out of the guard's RSS)."""
    srv = serve(Engines(n))
    port_q.put(srv.server_address[1])
    threading.Event().wait()


def main() -> None:
    import multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--trace", action="store_true", help="print tracemalloc growth (slow)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_engine_server, args=(args.targets, q), daemon=True)
    child.start()
    port = q.get(timeout=60)
    cfg = parse_config({
        "source": {"mode": "scrape", "interval_s": 5, "timeout_s": 4.5, "concurrency": 16,
                   "targets": [{"url": f"http://127.0.0.1:{port}/metrics/{i}", "model": f"model{i % 4}",
                                "pool": ("prefill", "decode")[i % 2], "name": f"e{i}"}
                               for i in range(args.targets)]},
        "evaluation_interval_s": 15,
        "retention": {"slots": 360},
    })
    guard = compose(cfg, detectors=False, advisor=False).guard
    proc = psutil.Process()
    samples: list[tuple[float, float]] = []
    duration = args.minutes * 60

    snaps = []

    async def run():
        stop = asyncio.Event()
        task = asyncio.create_task(guard.run(stop))
        t0 = time.time()
        if args.trace:
            import tracemalloc

            tracemalloc.start(8)
        while time.time() - t0 < duration:
            await asyncio.sleep(5)
            samples.append((time.time() - t0, proc.memory_info().rss / 2**20))
            if args.trace and len(samples) in (int(duration / 5 / 5), int(duration / 5) - 1):
                import tracemalloc

                snaps.append(tracemalloc.take_snapshot())
        stop.set()
        await task

    asyncio.run(run())
    child.terminate()
    child.join(5)
    if len(snaps) == 2:
        for stat in snaps[1].compare_to(snaps[0], "traceback")[:6]:
            print(stat)
            for line in stat.traceback.format()[-6:]:
                print("   ", line)
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples])
    warm = t >= duration / 2  # after the first half: arenas, pools and caches have settled
    slope = float(np.polyfit(t[warm] / 3600, rss[warm], 1)[0]) if warm.sum() >= 3 else float("nan")
    st = guard.status()
    down = [x.name for x in guard.source.targets() if not x.up]
    print(f"soak: {args.targets} targets for {args.minutes:g} min (load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs): {guard.source.rounds} scrape rounds, {guard.ticks} ticks, "
          f"{st['store']['series']} series, {len(down)} targets down at the end, "
          f"slo={st['evaluators']['slo']['status']}")
    print(f"RSS after warm-up {rss[warm][0]:.0f} MiB, final {rss[-1]:.0f} MiB, max {rss.max():.0f} MiB; "
          f"slope {slope:+.1f} MiB/h after warm-up; final/warm ratio {rss[-1] / rss[warm][0]:.3f}")
    per_min = [f"{rss[(t >= m * 60)][0]:.0f}" for m in range(int(duration // 60)) if (t >= m * 60).any()]
    print(f"RSS at each minute (MiB): {' '.join(per_min)}")
    if guard.last_tick:
        print(f"last tick {guard.last_tick.duration_s * 1000:.1f} ms, evaluator errors {guard.last_tick.errors}")


if __name__ == "__main__":
    main()
