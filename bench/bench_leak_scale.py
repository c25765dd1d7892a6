"""CPU of the guard's leak checks at fleet scale: the detector before and after the change that cut
it, side by side in one process, on the same store, with every verdict compared.

``--engines`` engines (default 250) of 4 processes each (API server, EngineCore, two workers: 1,000
RSS series) are scraped every 15 s for ``--hours`` (13 h) into the guard's own store, built as
``serve`` builds it (a 720-slot ring and the 5-min tier for RSS and load), or with ``--slots`` big
enough for every 15 s sample of the lookback (what a Prometheus source's range answers). RSS and
load come from ``sla_guard.detect.synthetic`` (its five kinds in turn, a 48 MiB/h leak from 8 h in
one process of 20); ``process_info`` gives each process's start.

Printed, old and new side by side:

1. **one check**: ``leak.assess`` of every process on the series the evaluator reads (its
   ``lookback_s`` of RSS, its engine's load, its start), CPU per check (median of ``--rounds``
   rounds) and per bucket cycle (every process once), and whether the verdicts are identical
   (``as_dict``, to the last bit).
2. **the evaluator**: ``LeakEvaluator.evaluate`` over the first tick (every process is new: all
   checked at once) and the next bucket_s / 15 s ticks (each process checked once, spread by its
   hash), store reads included: CPU per tick (max) and per cycle.

The old detector is ``sla_guard/detect/leak.py`` as of ``--before`` (default: the last commit
before the change), read with ``git show``; run from a git checkout.

    .venv/bin/python bench/bench_leak_scale.py [--engines 250] [--hours 13] [--slots 0] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from exporters import contract as c
from sla_guard.config import parse_config
from sla_guard.detect import evaluators, leak, synthetic
from sla_guard.detect.findings import FindingsBook
from sla_guard.ingest import build_store
from sla_guard.settings.detectors import LeakConfig

REPO = Path(__file__).resolve().parent.parent
BEFORE = "1c33dff"  # the last commit before the leak checks got faster
INTERVAL = 15.0
T0 = 1.7e9
PROCS = (
    ("api_server", "APIServer"),
    ("engine_core", "EngineCore_DP0"),
    ("worker", "VllmWorker-0"),
    ("worker", "VllmWorker-1"),
)


def old_leak(rev: str):
    """``sla_guard/detect/leak.py`` at ``rev`` as a module of its own."""
    try:
        src = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:sla_guard/detect/leak.py"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        sys.exit(
            f"--before {rev}: cannot read sla_guard/detect/leak.py at {rev} with git ({err}); run from a "
            "git checkout that holds that commit, or name another with --before REV"
        )
    spec = importlib.util.spec_from_loader("leak_before", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["leak_before"] = mod  # dataclasses look their module up
    exec(compile(src, f"leak.py@{rev}", "exec"), mod.__dict__)
    return mod


def fill(engines: int, hours: float, slots: int):
    """The guard's store with ``hours`` of 15 s scrapes of every engine; (store, scrape(t), last t)."""
    cfg = {"retention": {"slots": slots}} if slots else {}
    store = build_store(parse_config(cfg))
    n = int(hours * 3600 / INTERVAL) + 40  # and the ticks of part 2
    series, loads = [], []
    for e in range(engines):
        for p in range(len(PROCS)):
            i = e * len(PROCS) + p
            case = synthetic.rss_case(
                synthetic.RSS_KINDS[i % len(synthetic.RSS_KINDS)],
                i,
                dt=INTERVAL,
                days=n * INTERVAL / 86400 + 1e-3,
                leak_mib_h=48.0 if i % 20 == 7 else 0.0,
                onset_h=8.0,
            )
            series.append(case.v[:n])
            if p == 0:
                loads.append(case.load[:n])
    rss, run, info = c.PROCESS_RSS.name, c.REQUESTS_RUNNING.name, c.PROCESS_INFO.name
    pages = []
    for e in range(engines):
        eng = {
            "model": f"model{e % 10}",
            "pool": ("prefill", "decode")[(e // 10) % 2],
            "engine": "0",
            "instance": f"e{e}:8000",
        }
        procs = [{**eng, "role": role, "process": proc} for role, proc in PROCS]
        infos = [
            (info, {**lab, "process_pid": str(100 + k), "start_time": f"{T0 - 60:.0f}"}, 1.0)
            for k, lab in enumerate(procs)
        ]
        pages.append((eng, procs, infos))

    def scrape(k: int) -> None:
        t = T0 + k * INTERVAL
        for e, (eng, procs, infos) in enumerate(pages):
            rows = [(rss, lab, float(series[e * len(PROCS) + p][k])) for p, lab in enumerate(procs)]
            store.ingest_samples([*rows, (run, eng, float(loads[e][k])), *infos], t, group=eng["instance"])

    last = int(hours * 3600 / INTERVAL)
    for k in range(last + 1):
        scrape(k)
    return store, scrape, last


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def one_check(store, now: float, old, rounds: int) -> None:
    ev = evaluators.LeakEvaluator(FindingsBook(), LeakConfig(limit_bytes=64e9))
    rss = store.range(c.PROCESS_RSS.name, {}, now - ev.lookback_s, now)
    runs, starts = ev._context(store, now)
    jobs = []
    for s in rss:
        lab = dict(s.labels)
        engine = tuple(lab.get(k, "") for k in evaluators.ENGINE_KEYS)
        jobs.append((s.t, s.v, runs.get(engine), starts.get((*engine, lab.get("process", "")))))
    n_samples = statistics.median(len(j[0]) for j in jobs)
    print(f"{len(jobs)} processes, {n_samples:.0f} RSS samples each (median) over {ev.lookback_s / 3600:.1f} h")
    times: dict[str, list[float]] = {"old": [], "new": []}
    verdicts: dict[str, list] = {}
    for _ in range(rounds):
        for side, mod in (("old", old), ("new", leak)):
            p = mod.LeakParams()
            t0 = time.process_time()
            out = [mod.assess(t, v, p, limit_bytes=64e9, load=load, start_time=st) for t, v, load, st in jobs]
            times[side].append(time.process_time() - t0)
            verdicts[side] = [x.as_dict() for x in out]
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    ident = sum(same(a, b) for a, b in zip(verdicts["old"], verdicts["new"], strict=True))
    leaks = sum(d["detected"] for d in verdicts["new"])
    print(
        f"one check      old {1e3 * o / len(jobs):7.2f} ms   new {1e3 * n / len(jobs):7.2f} ms   old/new {o / n:5.2f}x"
    )
    print(f"per cycle      old {o:7.2f} s    new {n:7.2f} s    (every process once, CPU)")
    print(f"verdicts identical: {ident}/{len(jobs)} ({leaks} leaks)")


@contextlib.contextmanager
def detector(mod):
    """The evaluator running ``mod`` as its leak detector."""
    keep = evaluators.leak
    evaluators.leak = mod
    try:
        yield
    finally:
        evaluators.leak = keep


def evaluator_cycle(store, scrape, last: int, old) -> None:
    evs = {}
    for side, mod in (("old", old), ("new", leak)):
        with detector(mod):
            evs[side] = evaluators.LeakEvaluator(FindingsBook(), LeakConfig(limit_bytes=64e9))
    ticks = int(leak.LeakParams().bucket_s / INTERVAL)
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    for k in range(last, last + ticks + 1):
        if k > last:
            scrape(k)
        for side, mod in (("old", old), ("new", leak)):
            with detector(mod):
                t0 = time.process_time()
                evs[side].evaluate(store, T0 + k * INTERVAL)
                cpu[side].append(time.process_time() - t0)
    ident = sum(same(evs["old"].verdicts[k].as_dict(), v.as_dict()) for k, v in evs["new"].verdicts.items())
    for side in ("old", "new"):
        first, rest = cpu[side][0], cpu[side][1:]
        print(
            f"evaluator {side}  first tick (all new) {first:6.2f} s   next {len(rest)} ticks: "
            f"{sum(rest):6.2f} s in all, max {1e3 * max(rest):6.0f} ms a tick"
        )
    print(
        f"evaluator old/new per cycle {sum(cpu['old'][1:]) / sum(cpu['new'][1:]):5.2f}x; "
        f"verdicts identical {ident}/{len(evs['new'].verdicts)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=250)
    ap.add_argument("--hours", type=float, default=13.0)
    ap.add_argument("--slots", type=int, default=0, help="main ring slots (0: the config's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=BEFORE, help="git revision of the old detector")
    a = ap.parse_args()
    old = old_leak(a.before)
    t0 = time.perf_counter()
    store, scrape, last = fill(a.engines, a.hours, a.slots)
    print(
        f"store: {a.engines} engines x {len(PROCS)} processes, {a.hours:g} h of 15 s scrapes, "
        f"{a.slots or 'default'} slots (filled in {time.perf_counter() - t0:.0f} s); old = leak.py@{a.before}"
    )
    one_check(store, T0 + last * INTERVAL, old, a.rounds)
    evaluator_cycle(store, scrape, last, old)


if __name__ == "__main__":
    main()
