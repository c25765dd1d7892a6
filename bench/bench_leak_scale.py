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
3. **the reads**: the evaluator before the change that reads only the due processes' RSS
   (``sla_guard/detect/evaluators.py`` as of ``--before-reads``: every process's ``lookback_s`` of
   RSS and every engine's load at every tick) and now, both on the current detector, over the same
   store and ticks (``--cycles`` bucket cycles after the first tick): CPU per tick, the reads alone
   (``range``/``last_times`` of RSS and load) per tick, and the verdicts, bucket clocks, hysteresis
   clocks and findings of the two compared after every tick.

The old detector is ``sla_guard/detect/leak.py`` as of ``--before`` (default: the last commit
before the change), read with ``git show``; run from a git checkout.

    .venv/bin/python bench/bench_leak_scale.py [--engines 250] [--hours 13] [--slots 0] [--rounds 3]
        [--cycles 2] [--skip-detector]
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
BEFORE_READS = "9348e39"  # the last commit before the evaluator read only the due processes' RSS
INTERVAL = 15.0
T0 = 1.7e9
PROCS = (
    ("api_server", "APIServer"),
    ("engine_core", "EngineCore_DP0"),
    ("worker", "VllmWorker-0"),
    ("worker", "VllmWorker-1"),
)


def old_leak(rev: str, path: str = "sla_guard/detect/leak.py", name: str = "leak_before"):
    """``path`` (default ``sla_guard/detect/leak.py``) at ``rev`` as a module of its own."""
    try:
        src = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:{path}"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        sys.exit(
            f"{rev}: cannot read {path} at {rev} with git ({err}); run from a git checkout that holds "
            "that commit, or name another with --before REV / --before-reads REV"
        )
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(src, f"{Path(path).name}@{rev}", "exec"), mod.__dict__)
    return mod


def fill(engines: int, hours: float, slots: int, extra: int = 40):
    """The guard's store with ``hours`` of 15 s scrapes of every engine; (store, scrape(t), last t).
    ``extra``: how many scrapes past the last ``scrape(k)`` can add (the ticks of parts 2 and 3)."""
    cfg = {"retention": {"slots": slots}} if slots else {}
    store = build_store(parse_config(cfg))
    n = int(hours * 3600 / INTERVAL) + extra
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


class Reads:
    """``store`` as the evaluator sees it, with the CPU of its RSS and load reads counted."""

    def __init__(self, store) -> None:
        self.store, self.cpu = store, 0.0

    def __getattr__(self, name: str):
        attr = getattr(self.store, name)
        if name not in ("range", "last_times"):
            return attr

        def timed(metric, *args, **kw):
            t0 = time.process_time()
            try:
                return attr(metric, *args, **kw)
            finally:
                if metric in (c.PROCESS_RSS.name, c.REQUESTS_RUNNING.name):
                    self.cpu += time.process_time() - t0

        return timed


def state_of(ev) -> dict:
    """What a tick leaves behind: verdicts, bucket and hysteresis clocks, findings."""
    from sla_guard.detect.findings import finding_json

    return {
        "verdicts": {k: v.as_dict() for k, v in ev.verdicts.items()},
        "last_bucket": dict(ev._last_bucket),
        "ok_since": dict(ev._ok_since),
        "findings": [finding_json(f) for f in ev.book.all()],
    }


def reads_cycle(store, scrape, first: int, cycles: int, old_ev) -> None:
    """Part 3: the evaluator before and after reading only the due processes, same store, same
    ticks; everything it leaves compared after every tick."""
    evs = {
        "old": old_ev.LeakEvaluator(FindingsBook(), LeakConfig(limit_bytes=64e9)),
        "new": evaluators.LeakEvaluator(FindingsBook(), LeakConfig(limit_bytes=64e9)),
    }
    views = {side: Reads(store) for side in evs}
    ticks = cycles * int(leak.LeakParams().bucket_s / INTERVAL)
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    reads: dict[str, list[float]] = {"old": [], "new": []}
    same_ticks, checked = 0, 0
    for k in range(first, first + ticks + 1):
        if k > first:
            scrape(k)
        for side, ev in evs.items():
            views[side].cpu = 0.0
            t0 = time.process_time()
            ev.evaluate(views[side], T0 + k * INTERVAL)
            cpu[side].append(time.process_time() - t0)
            reads[side].append(views[side].cpu)
        a, b = state_of(evs["old"]), state_of(evs["new"])
        same_ticks += same(a, b)
        checked += len(a["verdicts"])
    n = len(evs["new"].verdicts)
    for side in ("old", "new"):
        rest, rd = cpu[side][1:], reads[side][1:]
        print(
            f"reads {side}  {ticks} ticks after the first: evaluator {1e3 * sum(rest) / ticks:6.1f} ms a tick "
            f"(max {1e3 * max(rest):4.0f}), of which RSS/load reads {1e3 * sum(rd) / ticks:6.1f} ms a tick"
        )
    print(
        f"reads old/new: reads {sum(reads['old'][1:]) / sum(reads['new'][1:]):5.1f}x, evaluator "
        f"{sum(cpu['old'][1:]) / sum(cpu['new'][1:]):5.2f}x per tick; ticks with identical verdicts, clocks "
        f"and findings {same_ticks}/{ticks + 1} ({n} processes, "
        f"{sum(f['state'] == 'open' for f in state_of(evs['new'])['findings'])} findings open)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=250)
    ap.add_argument("--hours", type=float, default=13.0)
    ap.add_argument("--slots", type=int, default=0, help="main ring slots (0: the config's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=BEFORE, help="git revision of the old detector")
    ap.add_argument("--before-reads", default=BEFORE_READS, help="git revision of the evaluator reading every process")
    ap.add_argument("--cycles", type=int, default=2, help="bucket cycles of part 3")
    ap.add_argument("--skip-detector", action="store_true", help="only part 3 (the reads)")
    a = ap.parse_args()
    old = old_leak(a.before)
    old_ev = old_leak(a.before_reads, "sla_guard/detect/evaluators.py", "evaluators_before")
    t0 = time.perf_counter()
    part3 = a.cycles * int(leak.LeakParams().bucket_s / INTERVAL)
    store, scrape, last = fill(a.engines, a.hours, a.slots, 40 + part3)
    print(
        f"store: {a.engines} engines x {len(PROCS)} processes, {a.hours:g} h of 15 s scrapes, "
        f"{a.slots or 'default'} slots (filled in {time.perf_counter() - t0:.0f} s); old = leak.py@{a.before}"
    )
    if not a.skip_detector:
        one_check(store, T0 + last * INTERVAL, old, a.rounds)
        evaluator_cycle(store, scrape, last, old)
        last += int(leak.LeakParams().bucket_s / INTERVAL)
    reads_cycle(store, scrape, last, a.cycles, old_ev)


if __name__ == "__main__":
    main()
