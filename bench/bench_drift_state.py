"""What the drift detectors write to the state file each interval at fleet scale, with each
group's CUSUM encoded as before (``encode``: JSON, tuple by tuple) and as now (``_pack``: its
windows as float64 columns, zlib, base64): bytes per interval and per day, the time of a save, and
what a restart restores and then decides.

``--groups`` model/pool groups (one engine each; default 100 and 1,000) report spec-decode draft
and accepted tokens (overall and at 3 positions), local prefix-cache queries and hits, TPOT sum
and count and running requests, with random increments, into the guard's own store every 60 s
(the drift interval) for ``--hours`` (4 h: the 1 h warm-up, then the reference hold and trend
windows filled, so each CUSUM's lists are at their steady length). The guard's drift evaluators
(``build_evaluators`` with the default ``detectors:``) evaluate each tick. Over the last
``--measure`` intervals (a full save, then ``--measure`` incremental ones) their state is saved
after each tick to two real state files (``sla_guard.state.StateStore``, WAL,
``synchronous=normal``), side by side in this process from the same evaluators, both with one
part per group written once per ``DRIFT_SAVE_S`` (``_DriftState.state_dump``):

- **old**: each group's part as ``encode(cusum)`` (the encoding before ``_pack``);
- **new**: ``_DriftState.state_dump`` now (``_pack``).

Printed for each: bytes written per interval (the JSON ``save`` stores; median) and per day
(1,440 intervals), the save's wall time (dump + ``save``: encode, JSON, CRC, SQLite commit;
median and max), and old/new ratios. After the last save each file is restored into fresh
evaluators (the old file by today's ``state_load``: a file written before still loads): the
groups back, and whether each is the CUSUM as last written (compared as ``encode`` writes it, so
exact to the bit). Then one group in 10 drifts (acceptance x0.75 at each position, prefix hits
0.4 -> 0.3, TPOT x1.3) for ``--after`` intervals, fed to both restored sets and to the evaluators
that never stopped: the alarms and findings of the two restored sets must be the same, and so must
every CUSUM at the end.

    .venv/bin/python bench/bench_drift_state.py [--groups 100 1000] [--hours 4] [--measure 10] [--after 30]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from exporters import contract as c
from sla_guard.config import parse_config
from sla_guard.detect import evaluators
from sla_guard.detect.evaluators import DRIFT_SAVE_S, _DriftState, build_evaluators
from sla_guard.detect.findings import FindingsBook, finding_json
from sla_guard.ingest import build_store
from sla_guard.settings.detectors import DetectorsConfig
from sla_guard.state import StateStore, encode

TICK = 60.0
T0 = 1.7e9


def fleet(groups: int, seed: int = 0, drift_from: float = math.inf):
    """``scrape(t)``: one page per group into ``store``, counters growing by random increments;
    from ``drift_from`` one group in 10 drifts (acceptance x0.75, prefix hits 0.4 -> 0.3, TPOT x1.3)."""
    store = build_store(parse_config({}))
    rng = np.random.default_rng(seed)
    cum = np.zeros((groups, 12))
    labels = [{"model": f"model{g // 2}", "pool": ("prefill", "decode")[g % 2], "engine": "0"} for g in range(groups)]
    drifts = np.arange(groups) % 10 == 0
    draft, acc = c.SPEC_DRAFT_TOKENS.exposed, c.SPEC_ACCEPTED_TOKENS.exposed
    dpos, apos = c.SPEC_DRAFT_TOKENS_POS.exposed, c.SPEC_ACCEPTED_TOKENS_POS.exposed
    q, h = c.PREFIX_CACHE_QUERIES.exposed, c.PREFIX_CACHE_HITS.exposed
    tsum, tcnt = c.REQUEST_TPOT.series("_sum"), c.REQUEST_TPOT.series("_count")

    def scrape(t: float) -> None:
        on = drifts if t >= drift_from else np.zeros(groups, bool)
        n = rng.poisson(3000, size=(groups, 3)).astype(float)  # draft tokens at positions 0..2
        a = rng.binomial(n.astype(int), np.outer(np.where(on, 0.75, 1.0), [0.8, 0.65, 0.5])).astype(float)
        qq = rng.poisson(50000, size=groups).astype(float)
        hh = rng.binomial(qq.astype(int), np.where(on, 0.3, 0.4)).astype(float)
        reqs = rng.poisson(40, size=groups).astype(float)
        running = 8 + rng.normal(0, 1, size=groups)
        tpot = reqs * 0.02 * np.where(on, 1.3, 1.0) * (1 + 0.01 * rng.normal(size=groups))
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


def drift_evaluators() -> list:
    """The guard's drift evaluators with the default ``detectors:``, on a findings book of their own."""
    return [ev for ev in build_evaluators(FindingsBook(), DetectorsConfig()) if isinstance(ev, _DriftState)]


def dump(ev, full: bool, side: str) -> dict:
    """``ev.state_dump(full)`` with each group encoded as ``side`` does (old: ``encode``)."""
    if side == "new":
        return ev.state_dump(full)
    with mock.patch.object(evaluators, "_pack", encode):
        return ev.state_dump(full)


def text(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def restore(path: Path) -> list:
    """Fresh drift evaluators (each set its own findings book) restored from ``path``."""
    fresh = drift_evaluators()
    state = StateStore(path)
    saved = state.load()
    state.close()
    for ev in fresh:
        ev.state_load(saved.get(ev.name, {}), [])
    return fresh


def same_as_written(fresh: list, last: dict) -> int:
    """How many restored CUSUMs are exactly (as ``encode`` writes them) the one last written."""
    return sum(text(encode(cus)) == last[ev.name].get(k) for ev in fresh for k, cus in ev.cusums.items())


def decisions(evs: list) -> tuple[list, dict]:
    """(every finding of the set's book, as the API serves it; every CUSUM as ``encode`` writes it)."""
    book = evs[0].book
    return ([finding_json(f) for f in book.all()],
            {(ev.name, k): text(encode(cus)) for ev in evs for k, cus in ev.cusums.items()})


def run(groups: int, hours: float, measure: int, after: int) -> None:
    ticks = int(hours * 3600 / TICK)
    store, scrape = fleet(groups, drift_from=T0 + (ticks + 1) * TICK)
    evs = drift_evaluators()
    t_cpu = time.process_time()
    sides = ("old", "new")
    rows: dict[str, list[tuple[int, float]]] = {side: [] for side in sides}
    last: dict[str, dict[str, dict]] = {side: {ev.name: {} for ev in evs} for side in sides}  # as last written
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
            kept = {ev.name: (set(ev._filed), set(ev._unfiling), dict(ev._marks), ev._dumped_next) for ev in evs}
            for side in sides:
                for ev in evs:  # each side dumps from the same bookkeeping: the same groups, in the same saves
                    filed, unfiling, marks, dumped = kept[ev.name]
                    ev._filed, ev._unfiling, ev._marks, ev._dumped_next = set(filed), set(unfiling), dict(marks), dumped
                t0 = time.perf_counter()
                parts = {ev.name: dump(ev, full, side) for ev in evs}
                assert states[side].save(parts, now=t)
                save_s = time.perf_counter() - t0
                if not full:  # the first measured save is a full one (as after a start)
                    rows[side].append((sum(len(text(v)) for ps in parts.values() for v in ps.values()
                                           if v is not None), save_s))
                for ev in evs:  # each group's CUSUM as last written, as ``encode`` writes it
                    for p, v in parts[ev.name].items():
                        if p.startswith("g/"):
                            g = tuple(json.loads(p[2:]))
                            last[side][ev.name][g] = None if v is None else text(encode(ev.cusums[g]))
        for st in states.values():
            st.close()
        print(f"{groups} groups: {sum(len(ev.cusums) for ev in evs)} CUSUMs in {len(evs)} drift evaluators, "
              f"{hours:g} h fed in {time.process_time() - t_cpu:.0f} s CPU; DRIFT_SAVE_S {DRIFT_SAVE_S:.0f} s; "
              f"{len(rows['new'])} intervals measured")
        stats = {}
        for side in sides:
            nb = [r[0] for r in rows[side]]
            sv = [r[1] for r in rows[side]]
            stats[side] = (statistics.median(nb), statistics.median(sv), max(sv))
        o, n = stats["old"], stats["new"]
        print(f"  {'':28s} {'old':>9s} {'new':>9s} {'old/new':>8s}")
        for name, i, scale, unit in (("written per interval", 0, 2**-20, "MiB"),
                                     ("written per day", 0, 86400 / TICK / 2**30, "GiB"),
                                     ("save, median", 1, 1e3, "ms"), ("save, max", 2, 1e3, "ms")):
            print(f"  {name + ' (' + unit + ')':28s} {o[i] * scale:9.2f} {n[i] * scale:9.2f} {o[i] / n[i]:7.1f}x")
        restored = {side: restore(files[side]) for side in sides}
        for side in sides:
            back = sum(len(ev.cusums) for ev in restored[side])
            print(f"  {side} file restored: {back}/{sum(len(ev.cusums) for ev in evs)} groups, "
                  f"{same_as_written(restored[side], last[side])} exactly as last written")
        if after:
            t1 = time.process_time()
            for k in range(ticks + 1, ticks + 1 + after):
                t = T0 + k * TICK
                scrape(t)  # one group in 10 drifts from here
                for ev in (*evs, *restored["old"], *restored["new"]):
                    ev.evaluate(store, t)
            got = {side: decisions(restored[side]) for side in sides}
            live = decisions(evs)[0]
            print(f"  after {after} intervals with one group in 10 drifted ({time.process_time() - t1:.0f} s CPU): "
                  f"findings restored old {len(got['old'][0])}, new {len(got['new'][0])}, never stopped {len(live)}; "
                  f"old and new the same: findings {got['old'][0] == got['new'][0]}, "
                  f"every CUSUM {got['old'][1] == got['new'][1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--measure", type=int, default=10, help="intervals measured at the end (after a full save)")
    ap.add_argument("--after", type=int, default=30, help="intervals fed after the restore, with drifts")
    a = ap.parse_args()
    for g in a.groups:
        run(g, a.hours, a.measure, a.after)


if __name__ == "__main__":
    main()
