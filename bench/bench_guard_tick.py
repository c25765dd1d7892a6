"""One evaluation tick over 1,000 engines with the full signal set per engine.

Every engine's page is the contract's engine + KV-transfer + per-process metrics, as the real
EngineRecorder writes them (~300 series per engine after dropping _created), with counters that
grow from scrape to scrape. 1,000 such engines (10 models x prefill/decode) are ingested into
the embedded store every 15 s for 5+ minutes of simulated time; then the guard ticks (the SLO
evaluator: means, p90, attainment with burn-rate ledger, goodput) after each further scrape.

Printed: time per tick (median, max) against the 100 ms goal, the process RSS against the
300 MB goal, and side by side the same window math done the obvious way (one
promql.extrapolated_rate call per series) on the same store, as a ratio.

With ``--state PATH``: two guards with the same evaluators (SLO, detectors, advisor) tick the
same store at the same instants, one persisting to a state file (sla_guard.state) after every
tick; printed side by side: tick time, the save's time, their ratio, and the file's size.

Usage: .venv/bin/python bench/bench_guard_tick.py [--engines 1000] [--ticks 8] [--state /tmp/s.db]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time

import numpy as np
import psutil
from prometheus_client import CollectorRegistry, generate_latest

from exporters import contract as c
from exporters.contract import Component
from exporters.prometheus import ContractMetrics, EngineRecorder, FinishedRequest
from sla_guard import promql
from sla_guard.config import parse_config
from sla_guard.exposition import parse_exposition
from sla_guard.ingest import build_store
from sla_guard.service import Guard
from sla_guard.store import SeriesStore

INTERVAL = 15.0


def template() -> list[tuple[str, dict, float]]:
    """One engine's full page, parsed: (name, labels, value)."""
    reg = CollectorRegistry()
    cm = ContractMetrics(reg, components=(Component.ENGINE, Component.KV_TRANSFER, Component.PROCESS))
    rec = EngineRecorder(cm, "M", "P", "E")
    rng = np.random.default_rng(0)
    for _ in range(200):
        ttft = float(rng.lognormal(-1, 0.7))
        rec.observe_ttfts([ttft])
        rec.finished(FinishedRequest(1.0, 0.05, ttft, 0.8, float(rng.uniform(0.005, 0.018)), 900, 400, 60))
        rec.tokens(60, computed=500, local_hit=400)
        rec.spec_decode(10, 30, 20, [8, 7, 5], [10, 10, 10])
        rec.prefix_cache("local", 900, 400)
        rec.scheduler(12, 3, 0.6)
    rec.kv_transfer(durations=list(rng.uniform(0.001, 0.1, 50)), post_durations=list(rng.uniform(0, 0.01, 50)),
                    nbytes=list(rng.uniform(1e6, 1e8, 50)), descriptors=list(rng.integers(1, 64, 50)))
    for role, proc in (("api_server", "api"), ("engine_core", "core"), ("worker", "w0"), ("worker", "w1")):
        labels = ("M", "P", "E", role, proc)
        cm[c.PROCESS_RSS].labels(*labels).set(6e9)
        for kind in ("anon", "file", "shmem"):
            cm[c.PROCESS_MEMORY].labels(*labels, kind).set(2e9)
        for g in ("0", "1", "2"):
            cm[c.PROCESS_GC_COLLECTIONS].labels(*labels, g).inc(10)
        cm[c.PROCESS_THREADS].labels(*labels).set(40)
        cm[c.PROCESS_OPEN_FDS].labels(*labels).set(200)
    samples, _ = parse_exposition(generate_latest(reg).decode())
    return samples


def build(n_engines: int, rounds: int, store: SeriesStore, t0: float):
    """Ingest ``rounds`` scrapes of every engine through ``ingest_text`` (the scraper's path:
    parse + per-target scrape cache). Pages are made per round from one template per
    (model, pool) by substitution, so the harness holds almost nothing itself."""
    tpl = template()
    base = np.array([s[2] for s in tpl])
    line_fmt = []
    for name, labels, _ in tpl:
        lt = ",".join(f'{k}="{v}"' for k, v in labels.items())
        line_fmt.append((f"{name}{{{lt}}}" if lt else name).replace("{", "{{").replace("}", "}}") + " {}")
    page_fmt = "\n".join(f.replace("{}", "{" + str(i) + "}") for i, f in enumerate(line_fmt)) + "\n"
    speeds = [0.5 + (i % 7) / 7 for i in range(n_engines)]
    state = {"k": 0}

    def page(i: int, k: int) -> str:
        model, pool = f"model{i % 10}", ("prefill", "decode")[(i // 10) % 2]
        vals = (base * (1 + k * speeds[i])).tolist()
        return (page_fmt.format(*vals).replace('model="M"', f'model="{model}"')
                .replace('pool="P"', f'pool="{pool}"').replace('engine="E"', f'engine="{i}"'))

    def scrape_round(t: float) -> None:
        k = state["k"]
        for i in range(n_engines):
            store.ingest_text(page(i, k), t, {"instance": f"e{i}"}, group=f"e{i}")
        state["k"] = k + 1

    for r in range(rounds):
        scrape_round(t0 + r * INTERVAL)
    return scrape_round, len(tpl)


def naive_increase(store: SeriesStore, metric: str, window: float, at: float) -> float:
    """The obvious way: one extrapolated_rate per series from store.range()."""
    total = 0.0
    for s in store.range(metric, {}, at - window, at):
        v = promql.extrapolated_rate(s.t, s.v, at - window, at)
        if not math.isnan(v):
            total += v
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--ticks", type=int, default=8)
    ap.add_argument("--state", help="also tick a guard persisting to this SQLite file (removed first)")
    ap.add_argument("--coarse-duration", default="26h", help="downsampled tier span (config default 26h; 0s: off)")
    args = ap.parse_args()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    cfg = parse_config({"evaluation_interval_s": INTERVAL, "staleness_s": 60,
                        "retention": {"max_series": 1_000_000, "max_series_per_target": 2000, "slots": 48,
                                      "coarse_duration": args.coarse_duration}})
    store = build_store(cfg)  # as serve builds it: main ring + the downsampled tier
    t0 = 1_800_000_000.0
    warm = int(300 / INTERVAL) + 2
    t_ing = time.perf_counter()
    scrape_round, per_engine = build(args.engines, warm, store, t0)
    ingest_s = (time.perf_counter() - t_ing) / warm
    guard = Guard.for_store(cfg, store)
    pair = with_state(cfg, store, args.state) if args.state else None
    times, cpu, pair_rows = [], [], []
    t = t0 + (warm - 1) * INTERVAL
    for _ in range(args.ticks):
        t += INTERVAL
        scrape_round(t)
        gc.collect()
        c0 = time.process_time()
        res = guard.tick(t)
        cpu.append(time.process_time() - c0)
        assert not res.errors, res.errors
        times.append(res.duration_s)
        if pair is not None:
            plain, saving = pair
            a = plain.tick(t).duration_s
            b = saving.tick(t).duration_s
            pair_rows.append((a, b, saving.last_persist_ms / 1e3))
    rss = proc.memory_info().rss
    slo = guard.evaluator("slo")
    statuses = {k: p.status.value for k, p in slo.pools.items()}
    # side by side: the same increase, vectorised store vs one call per series
    metric = c.REQUEST_TTFT.series("_bucket")
    a = time.perf_counter()
    vec = sum(store.increase(metric, {}, 300, t, ()).values())
    vec_s = time.perf_counter() - a
    a = time.perf_counter()
    naive = naive_increase(store, metric, 300, t)
    naive_s = time.perf_counter() - a
    assert math.isclose(vec, naive, rel_tol=1e-9), (vec, naive)
    med, worst = statistics.median(times), max(times)
    print(f"engines={args.engines} series/engine={per_engine} store series={store.series_count()} "
          f"(+ downsampled tier: {args.coarse_duration}) "
          f"store arrays={store.nbytes() / 2**20:.0f} MiB pools={len(statuses)} "
          f"({sorted(set(statuses.values()))})")
    print(f"ingest (parse + store, no HTTP; includes making the pages): {ingest_s * 1000:.0f} ms per round "
          f"of {args.engines} pages")
    cpu_med = statistics.median(cpu)
    print(f"tick: median {med * 1000:.1f} ms wall / {cpu_med * 1000:.1f} ms CPU, max {worst * 1000:.1f} ms wall, "
          f"over {len(times)} ticks; goal 100 ms -> ratio {cpu_med / 0.1:.2f} (CPU; wall counts other "
          f"processes on a shared machine, load {os.getloadavg()[0]:.1f})")
    print(f"guard RSS {rss / 2**20:.0f} MiB (interpreter+libs before: {rss0 / 2**20:.0f} MiB); "
          f"goal 300 MiB -> ratio {rss / (300 * 2**20):.2f}")
    print(f"increase over {store.series_count() and len(store.range(metric, {}, t - 300, t))} bucket series: "
          f"vectorised {vec_s * 1000:.1f} ms vs per-series loop {naive_s * 1000:.0f} ms -> "
          f"speed-up x{naive_s / vec_s:.0f}")
    if pair is not None:
        report_state(pair[1], pair_rows)


def with_state(cfg, store, path: str):
    """Two guards, same evaluators (SLO + detectors + advisor), the second saving its state."""
    from sla_guard.compose import compose
    from sla_guard.ingest.source import StoreSource
    from sla_guard.state import StateStore

    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    out = []
    for state in (None, StateStore(path)):
        out.append(compose(cfg, source=StoreSource(store), state=state).guard)
    return out[0], out[1]


def report_state(guard, rows) -> None:
    evals = statistics.median(a for a, _, _ in rows)
    with_s = statistics.median(b for _, b, _ in rows)
    save = statistics.median(p for _, _, p in rows)
    st = guard.state
    print(f"state: {len(rows)} ticks, evaluators {evals * 1000:.1f} ms (no state) vs {with_s * 1000:.1f} ms "
          f"(state) + save {save * 1000:.1f} ms median (max {max(p for _, _, p in rows) * 1000:.1f} ms) -> "
          f"save/tick ratio {save / evals:.3f}; file {st.file_bytes() / 2**20:.2f} MiB "
          f"(live {st.live_bytes() / 2**20:.2f} MiB), integrity {st.integrity()}")


if __name__ == "__main__":
    main()
