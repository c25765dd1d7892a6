"""Scrape + parse of real-sized vLLM pages: the embedded guard vs a real Prometheus.

Targets are loopback HTTP servers serving the whole /metrics page recorded from the real CPU
vLLM engine with the sla-guard hooks (tests/fixtures/vllm_server_metrics.txt, ~84 KB,
~590 samples). First a real Prometheus (Debian package) scrapes them every second and we read
its own ``scrape_duration_seconds``; then, with Prometheus stopped, the guard scrapes the same
targets: one target at a time (the same per-target measure: request + parse + store) and all at
once (round throughput). The page servers run in a child process, so each side's CPU time is its
own process's only. Printed as ratios guard / Prometheus, plus the parser alone against
prometheus_client's reference parser.

Usage: .venv/bin/python bench/bench_guard_scrape.py [--targets 20] [--seconds 25]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from sla_guard.config import ScrapeSource, Target
from sla_guard.exposition import _reference, parse_exposition
from sla_guard.ingest.scrape import Scraper
from sla_guard.store import SeriesStore

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "tests" / "fixtures" / "vllm_server_metrics.txt"
sys.path.insert(0, str(ROOT / "tests"))


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""
    protocol_version = "HTTP/1.0"  # --keep-alive switches to HTTP/1.1, as vLLM's uvicorn serves

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


class _Srv(http.server.ThreadingHTTPServer):
    daemon_threads = True


def serve(n: int, body: bytes) -> list[_Srv]:
    _Handler.body = body
    out = []
    for _ in range(n):
        s = _Srv(("127.0.0.1", 0), _Handler)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        out.append(s)
    return out


def serve_elsewhere(n: int) -> tuple[subprocess.Popen, list[int]]:
    """The page servers in a child process, so that the guard's CPU time (``process_time``)
    counts only the guard -- as Prometheus's own process_cpu_seconds_total counts only it."""
    keep = ["--keep-alive"] if _Handler.protocol_version == "HTTP/1.1" else []
    proc = subprocess.Popen([sys.executable, __file__, "--serve-only", str(n), *keep], stdout=subprocess.PIPE,
                            text=True)
    ports = [int(p) for p in proc.stdout.readline().split()]
    return proc, ports


def _cpu_seconds(url: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    raise RuntimeError("no process_cpu_seconds_total")


def prometheus_side(ports: list[int], seconds: float) -> tuple[float, float] | None:
    """(median scrape_duration_seconds, Prometheus CPU seconds per scraped page)."""
    from prometheus_support import PrometheusProcess, prometheus_binary

    if prometheus_binary() is None:
        print("prometheus not installed (scripts/setup.sh --full): no baseline")
        return None
    prom = PrometheusProcess([f"127.0.0.1:{p}" for p in ports], interval_s=1.0)
    try:
        prom.wait_ready()
        prom.wait_up(len(ports), samples=2)
        t0, c0 = time.time(), _cpu_seconds(prom.url)
        time.sleep(seconds)
        t1, c1 = time.time(), _cpu_seconds(prom.url)
        res = prom.query(f'quantile(0.5, quantile_over_time(0.5, scrape_duration_seconds{{job="engines"}}'
                         f'[{int(seconds)}s]))', t1)
        samples = prom.query('avg(scrape_samples_scraped{job="engines"})', t1)
        print(f"prometheus: {float(samples[0]['value'][1]):.0f} samples per page (incl. _created)")
        return float(res[0]["value"][1]), (c1 - c0) / ((t1 - t0) * len(ports))
    finally:
        prom.stop()


def guard_side(ports: list[int], rounds: int) -> tuple[float, float, float]:
    targets = [Target(url=f"http://127.0.0.1:{p}/metrics", name=f"t{i}", model="tiny", pool="mixed")
               for i, p in enumerate(ports)]
    store = SeriesStore(slots=64)
    scr = Scraper(ScrapeSource(targets=targets, timeout_s=5, concurrency=64), store)

    async def run():
        per: list[float] = []
        for _ in range(2):  # warm: series created, caches filled
            await scr.collect()
        for _ in range(rounds):
            for t in targets:  # one at a time: Prometheus's per-target measure
                st = await scr.scrape_target(t)
                per.append(st.last_duration_s)
        a = time.perf_counter()
        c0 = time.process_time()
        for _ in range(rounds):
            await scr.collect()  # all at once
        wall = time.perf_counter() - a
        cpu = time.process_time() - c0
        await scr.aclose()
        return per, wall, cpu

    per, wall, cpu = asyncio.run(run())
    assert all(t.up for t in scr.targets())
    pages = rounds * len(targets)
    return statistics.median(per), pages / wall, cpu / pages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=25)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--keep-alive", action="store_true", help="serve HTTP/1.1 keep-alive (default HTTP/1.0: a "
                    "connection per scrape, as the figures in docs/guard.md were measured)")
    ap.add_argument("--serve-only", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    body = PAGE.read_bytes()
    if args.keep_alive:
        _Handler.protocol_version = "HTTP/1.1"
    if args.serve_only:  # child: serve the page until killed
        servers = serve(args.serve_only, body)
        print(" ".join(str(s.server_address[1]) for s in servers), flush=True)
        threading.Event().wait()
        return
    text = body.decode()
    samples, _ = parse_exposition(text)
    server_proc, ports = serve_elsewhere(args.targets)
    try:
        print(f"page: {len(body) / 1024:.0f} KiB, {len(samples)} samples (without _created), {args.targets} targets; "
              f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        prom = prometheus_side(ports, args.seconds)
        per, pages_s, cpu_page = guard_side(ports, args.rounds)
    finally:
        server_proc.kill()
        server_proc.wait()
    # the parser alone, fast path vs the reference parser, same page
    a = time.perf_counter()
    for _ in range(20):
        parse_exposition(text)
    fast = (time.perf_counter() - a) / 20
    a = time.perf_counter()
    for _ in range(5):
        _reference(text, True)
    ref = (time.perf_counter() - a) / 5
    print(f"guard: scrape+parse+store per page {per * 1000:.2f} ms (median, one target at a time); "
          f"all targets at once {pages_s:.0f} pages/s = {pages_s * len(body) / 2**20:.1f} MiB/s, "
          f"{cpu_page * 1000:.2f} ms CPU per page")
    if prom is not None:
        dur, cpu = prom
        print(f"prometheus: scrape_duration_seconds {dur * 1000:.2f} ms per page (median); whole-process CPU "
              f"{cpu * 1000:.2f} ms per page scraped")
        print(f"ratio guard / prometheus: scrape duration {per / dur:.2f}, CPU per page {cpu_page / cpu:.2f}")
    print(f"parser alone: fast path {fast * 1000:.2f} ms vs prometheus_client parser {ref * 1000:.2f} ms "
          f"-> x{ref / fast:.1f}")


if __name__ == "__main__":
    main()
