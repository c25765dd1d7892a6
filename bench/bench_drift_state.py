"""What the drift detectors write to the state file each interval, at fleet scale, before and
after one part per model/pool group written once per ``DRIFT_SAVE_S``: bytes per interval and per
day, the time of a save, how many groups' state changed since the last save, and what a restart
restores.

``--groups`` model/pool groups (one engine each; default 100 and 1,000) report spec-decode draft
and accepted tokens (overall and at 3 positions), local prefix-cache queries and hits, TPOT sum
and count and running requests, with random increments, into the guard's own store every 60 s
(the drift interval) for ``--hours`` (4 h: the 1 h warm-up, then the reference hold and trend
windows filled, so each CUSUM's lists are at their steady length). The guard's drift evaluators
(``build_evaluators`` with the default ``detectors:``) evaluate each tick. Over the last
``--measure`` intervals (a full save, then ``--measure`` incremental ones) their state is saved
after each tick to two real state files (``sla_guard.state.StateStore``, WAL,
``synchronous=normal``), side by side in this process from the same evaluators:

- **old**: one part of all groups each time an interval closes, as ``_DriftState.state_dump``
  wrote it before (``old_dump`` below is that code);
- **new**: ``_DriftState.state_dump`` now.

Printed for each: bytes written per interval (the JSON ``save`` stores; median) and per day
(1,440 intervals), the save's wall time (dump + ``save``: encode, JSON, CRC, SQLite commit;
median and max); the CUSUMs whose encoded state differs from the interval before; and after the
last save each file restored into fresh evaluators: the groups back, and whether each is the
state last written for it (old: the state at the last save; new: at its group's last write).

    .venv/bin/python bench/bench_drift_state.py [--groups 100 1000] [--hours 4] [--measure 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from exporters import contract as c
from sla_guard.config import parse_config
from sla_guard.detect.evaluators import DRIFT_SAVE_S, _DriftState, build_evaluators
from sla_guard.detect.findings import FindingsBook
from sla_guard.ingest import build_store
from sla_guard.settings.detectors import DetectorsConfig
from sla_guard.state import StateStore, encode

TICK = 60.0
T0 = 1.7e9


def fleet(groups: int, seed: int = 0):
    """``scrape(t)``: one page per group into ``store``, counters growing by random increments."""
    store = build_store(parse_config({}))
    rng = np.random.default_rng(seed)
    cum = np.zeros((groups, 12))
    labels = [{"model": f"model{g // 2}", "pool": ("prefill", "decode")[g % 2], "engine": "0"} for g in range(groups)]
    draft, acc = c.SPEC_DRAFT_TOKENS.exposed, c.SPEC_ACCEPTED_TOKENS.exposed
    dpos, apos = c.SPEC_DRAFT_TOKENS_POS.exposed, c.SPEC_ACCEPTED_TOKENS_POS.exposed
    q, h = c.PREFIX_CACHE_QUERIES.exposed, c.PREFIX_CACHE_HITS.exposed
    tsum, tcnt = c.REQUEST_TPOT.series("_sum"), c.REQUEST_TPOT.series("_count")

    def scrape(t: float) -> None:
        n = rng.poisson(3000, size=(groups, 3)).astype(float)  # draft tokens at positions 0..2
        a = rng.binomial(n.astype(int), [0.8, 0.65, 0.5]).astype(float)
        qq = rng.poisson(50000, size=groups).astype(float)
        hh = rng.binomial(qq.astype(int), 0.4).astype(float)
        reqs = rng.poisson(40, size=groups).astype(float)
        running = 8 + rng.normal(0, 1, size=groups)
        tpot = reqs * 0.02 * (1 + 0.01 * rng.normal(size=groups))
        cum[:, 0:3] += n
        cum[:, 3:6] += a
        cum[:, 6] += qq
        cum[:, 7] += hh
        cum[:, 8] += tpot
        cum[:, 9] += reqs
        for g, lab in enumerate(labels):
            x = cum[g]
            rows = [(draft, lab, float(x[0:3].sum())), (acc, lab, float(x[3:6].sum())),
                    *((dpos, {**lab, "position": str(p)}, float(x[p])) for p in range(3)),
                    *((apos, {**lab, "position": str(p)}, float(x[3 + p])) for p in range(3)),
                    (q, {**lab, "cache": "local"}, float(x[6])), (h, {**lab, "cache": "local"}, float(x[7])),
                    (tsum, lab, float(x[8])), (tcnt, lab, float(x[9])),
                    (c.REQUESTS_RUNNING.name, lab, float(running[g]))]
            store.ingest_samples(rows, t, group=f"e{g}")

    return store, scrape


def old_dump(ev, dumped: dict, full: bool) -> dict:
    """``_DriftState.state_dump`` before one part per group: all CUSUMs in one part, each time an
    interval closed (``dumped``: the interval-close time of each evaluator's last dump)."""
    if not full and ev._next == dumped.get(ev.name):
        return {}
    dumped[ev.name] = ev._next
    return {"s": encode({"next": ev._next, "cusums": ev.cusums})}


def text(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def restored(evs, path: Path, last: dict) -> tuple[int, int, int]:
    """(groups restored from ``path``, of them equal to what was last written, groups now)."""
    fresh = [ev for ev in build_evaluators(FindingsBook(), DetectorsConfig()) if isinstance(ev, _DriftState)]
    state = StateStore(path)
    saved = state.load()
    state.close()
    back = same = 0
    for ev in fresh:
        ev.state_load(saved.get(ev.name, {}), [])
        for k, cus in ev.cusums.items():
            back += 1
            same += text(json.loads(text(encode(cus)))) == last[ev.name].get(k)
    return back, same, sum(len(ev.cusums) for ev in evs)


def run(groups: int, hours: float, measure: int) -> None:
    store, scrape = fleet(groups)
    evs = [ev for ev in build_evaluators(FindingsBook(), DetectorsConfig()) if isinstance(ev, _DriftState)]
    ticks = int(hours * 3600 / TICK)
    t_cpu = time.process_time()
    sides = ("old", "new")
    rows: dict[str, list[tuple[int, float]]] = {side: [] for side in sides}
    last: dict[str, dict[str, dict]] = {side: {ev.name: {} for ev in evs} for side in sides}  # as last written
    changed: list[str] = []
    prev: dict[tuple, str] = {}
    dumped: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {side: Path(tmp) / f"{side}.db" for side in sides}
        states = {side: StateStore(files[side]) for side in sides}
        for k in range(ticks + 1):
            t = T0 + k * TICK
            scrape(t)
            for ev in evs:
                ev.evaluate(store, t)
            if k < ticks - measure:
                continue
            full = k == ticks - measure
            now = {(ev.name, g): text(encode(cus)) for ev in evs for g, cus in ev.cusums.items()}
            if not full:
                changed.append(f"{sum(prev.get(g) != v for g, v in now.items())}/{len(now)}")
            prev = now
            for side in sides:
                t0 = time.perf_counter()
                parts = {ev.name: old_dump(ev, dumped, full) if side == "old" else ev.state_dump(full) for ev in evs}
                assert states[side].save(parts, now=t)
                save_s = time.perf_counter() - t0
                if not full:  # the first measured save is a full one (as after a start)
                    rows[side].append((sum(len(text(v)) for ps in parts.values() for v in ps.values()
                                           if v is not None), save_s))
                for ev in evs:  # what the file now holds for each group, as JSON
                    ps, mine = parts[ev.name], last[side][ev.name]
                    if "s" in ps:
                        mine.clear()
                        mine.update({g: now[(ev.name, g)] for g in ev.cusums})
                    for p, v in ps.items():
                        if p.startswith("g/"):
                            g = tuple(json.loads(p[2:]))
                            if v is None:
                                mine.pop(g, None)
                            else:
                                mine[g] = text(v)
        for st in states.values():
            st.close()
        print(f"{groups} groups: {sum(len(ev.cusums) for ev in evs)} CUSUMs in {len(evs)} drift evaluators, "
              f"{hours:g} h fed in {time.process_time() - t_cpu:.0f} s CPU; DRIFT_SAVE_S {DRIFT_SAVE_S:.0f} s")
        print(f"  CUSUMs changed since the interval before: {', '.join(changed)}")
        med = {}
        for side in sides:
            nb = statistics.median(r[0] for r in rows[side])
            sv = [r[1] for r in rows[side]]
            med[side] = (nb, statistics.median(sv), sum(r[0] for r in rows[side]), sum(sv))
            back, same, n = restored(evs, files[side], last[side])
            print(f"  {side}: written per interval {nb / 2**20:7.2f} MiB median, {nb * 86400 / TICK / 2**30:6.2f} "
                  f"GiB a day; save {1e3 * statistics.median(sv):7.1f} ms median, max {1e3 * max(sv):7.1f} ms; "
                  f"restored {back}/{n} groups, {same} as last written")
        o, n = med["old"], med["new"]
        print(f"  old/new over {len(rows['new'])} intervals: bytes {o[2] / n[2]:5.1f}x, save time {o[3] / n[3]:5.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--measure", type=int, default=10, help="intervals measured at the end (after a full save)")
    a = ap.parse_args()
    for g in a.groups:
        run(g, a.hours, a.measure)


if __name__ == "__main__":
    main()
