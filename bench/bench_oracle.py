"""How far below the best static size any scaling policy could go: a clairvoyant estimate per
workload of the issue-15 suite.

The done-when of issue 15 asks the guard, on workloads with >= 2x load swings, for the best
static size's attainment (less 0.2 point) at <= 85% of its GPU-hours. Whether that is reachable
at all depends on the workload, not on the policy: a burst shorter than the cold start can only
be met by capacity that was already standing. This bench answers it with a policy that knows
the whole trace in advance:

- every fixed size P x D of a grid is replayed once (``sla-guard replay --policy static``, as
  ``bench_policies.best_static`` does), and each request's outcome (client TTFT and TPOT inside
  the SLA) is kept;
- time is cut into 5-minute slots; a schedule picks one size per slot, and a slot's misses are
  those of the static run of that size over the requests arriving in it;
- GPU cost: the size's replicas over the slot, plus the cold start (``cold_start_s``, replicas
  paid while they start) of every replica added; removing replicas is free and instant (a drain
  that loses nothing, as the simulator's scale-down does); the run starts at 2P2D, as the suite's;
- dynamic programming over slots, sizes and misses finds the cheapest schedule whose attainment
  reaches each Pareto static size's attainment less 0.2 point.

It is an estimate, not a strict bound. It favours the schedule by knowing the future, and it
takes each slot's outcome from the static run of that size, which ignores what earlier slots
leave behind: a backlog after a smaller slot (the estimate is then too kind) or an empty queue
after a larger one (then too harsh). Sizes change only at slot edges (too harsh). A ratio well
above 0.85 says the done-when's static check is out of reach on that workload for any policy with
this cold start; one below says only that it may be reachable.

    .venv/bin/python bench/bench_oracle.py --split tuning|sealed [--only NAME]

No tuning happens here (nothing is chosen from the figures), so both halves may be printed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from sla_guard.sim.profile import load_profile
from sla_guard.sim.run import ReplaySpec, replay
from sla_guard.sim.workloads import suite

SLOT_S = 300.0
SIZES = [(p, d) for d in (1, 2, 3) for p in range(1, 7)]
START = (2, 2)
STATIC_TOL = 0.002  # "the best static's attainment less 0.2 point"
RATIO = 0.85


def outcomes(workload, trace, p: int, d: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Arrival times and per-request SLA outcome (unfinished and aborted requests are misses)
    of one static run, its end and its GPU-hours."""
    prof = workload.profile(load_profile("default"))
    spec = ReplaySpec(profile=prof, trace=trace, policy="static", prefill=p, decode=d, scrape_interval_s=15.0,
                      eval_interval_s=15.0, with_guard=False, with_detectors=False, metrics=False)
    dep = replay(spec).dep
    ok = np.zeros(len(dep.requests), dtype=bool)
    for r in dep.done:
        ttft = r.first_token + dep.to_client_s - r.arrival
        tpot = (r.finish - r.first_token) / (r.generated - 1) if r.generated > 1 else 0.0
        ok[r.rid] = ttft <= dep.slo_ttft_s and tpot <= dep.slo_tpot_s
    arrival = np.array([r.arrival for r in dep.requests])
    return arrival, ok, float(dep.now), float(dep.gpu_hours())


def bound(miss: np.ndarray, cost: np.ndarray, start_cost: np.ndarray, max_miss: float,
          bins: int = 4000) -> tuple[float, float, list[int]]:
    """Cheapest schedule (one size per slot, from the 2P2D start) with misses <= ``max_miss``:
    (GPU-seconds, misses, sizes per slot). Exact dynamic programming over slots, sizes and the
    misses spent so far, counted in ``bins`` units of the budget rounded up, so what it returns
    is within the budget and at most one unit per slot short of the cheapest."""
    n_slots, n_sizes = miss.shape
    unit = max_miss / bins if max_miss > 0 else 1.0
    units = np.ceil(miss / unit - 1e-9).astype(int)
    if max_miss <= 0:
        bins = 0
    inf = math.inf
    best = np.full((n_sizes, bins + 1), inf)
    s0 = SIZES.index(START)
    for t in range(n_sizes):
        if units[0, t] <= bins:
            best[t, units[0, t]] = start_cost[s0, t] + cost[0, t]
    back = np.zeros((n_slots, n_sizes, bins + 1), dtype=np.int16)
    for j in range(1, n_slots):
        new = np.full_like(best, inf)
        for t in range(n_sizes):
            via = best + start_cost[:, t][:, None]  # from every size, per budget spent
            frm = np.argmin(via, axis=0)
            val = via[frm, np.arange(bins + 1)]
            u = units[j, t]
            if u <= bins:
                new[t, u:] = val[: bins + 1 - u] + cost[j, t]
                back[j, t, u:] = frm[: bins + 1 - u]
        best = new
    t, b = np.unravel_index(int(np.argmin(best)), best.shape)
    total = float(best[t, b])
    if not math.isfinite(total):
        raise ValueError("no schedule within the miss budget (the largest size misses more)")
    path = [int(t)]
    for j in range(n_slots - 1, 0, -1):
        prev = int(back[j, t, b])
        b -= units[j, t]
        t = prev
        path.append(t)
    path = path[::-1]
    return total, float(sum(miss[j, k] for j, k in enumerate(path))), path


def analyse(workload) -> dict:
    trace = workload.trace()
    prof = workload.profile(load_profile("default"))
    g, cold = prof.gpus_per_replica, prof.cold_start_s
    runs = {s: outcomes(workload, trace, *s) for s in SIZES}
    end = max(r[2] for r in runs.values())
    n_slots = math.ceil(end / SLOT_S)
    n_req = len(next(iter(runs.values()))[0])
    miss = np.zeros((n_slots, len(SIZES)))
    for k, s in enumerate(SIZES):
        arrival, ok, _, _ = runs[s]
        slot = np.minimum((arrival // SLOT_S).astype(int), n_slots - 1)
        np.add.at(miss[:, k], slot[~ok], 1.0)
    reps = np.array([p + d for p, d in SIZES], float)
    cost = np.tile(reps * g * SLOT_S, (n_slots, 1))
    pp = np.array([p for p, _ in SIZES])
    dd = np.array([d for _, d in SIZES])
    added = np.maximum(0, pp[None, :] - pp[:, None]) + np.maximum(0, dd[None, :] - dd[:, None])
    start_cost = added * g * cold
    # Pareto static sizes: cheapest for their attainment
    statics = sorted(((reps[k], 1 - miss[:, k].sum() / n_req, s) for k, s in enumerate(SIZES)),
                     key=lambda x: (x[0], -x[1]))
    front, best_att = [], -1.0
    for r, att, s in statics:
        if att > best_att + 1e-9:
            front.append((r, att, s))
            best_att = att
    rows = []
    for r, att, s in front:
        static_cost = r * g * n_slots * SLOT_S
        try:
            c, m, path = bound(miss, cost, start_cost, (1 - (att - STATIC_TOL)) * n_req)
        except ValueError:  # the budget's rounding left no schedule: report the static size itself
            c, m, path = static_cost, (1 - att) * n_req, [SIZES.index(s)] * n_slots
        rows.append({"size": f"{s[0]}P{s[1]}D", "static_att": att, "static_gpu_h": static_cost / 3600,
                     "oracle_att": 1 - m / n_req, "oracle_gpu_h": c / 3600, "ratio": c / static_cost,
                     "path": "".join(f"{SIZES[k][0]}{SIZES[k][1]} " for k in path).strip()})
    return {"workload": workload.name, "swing": workload.swing, "requests": n_req, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("tuning", "sealed"), default="tuning")
    ap.add_argument("--only", help="one workload by name")
    ap.add_argument("--paths", action="store_true", help="print the oracle's sizes per 5-minute slot")
    a = ap.parse_args(argv)
    t0 = time.time()
    print(f"clairvoyant estimate, {a.split} half: per Pareto static size, the cheapest schedule reaching its "
          f"attainment - 0.2 point (GPU-h in the same slot accounting); ratio <= {RATIO} is the done-when's bar")
    for w in suite(a.split):
        if a.only and w.name != a.only:
            continue
        res = analyse(w)
        print(f"\n## {res['workload']} (swing {res['swing']:g}x, {res['requests']} requests)")
        print("| static | static att | static GPU-h | oracle att | oracle GPU-h | ratio |")
        print("|---|---|---|---|---|---|")
        for r in res["rows"]:
            print(f"| {r['size']} | {100 * r['static_att']:.2f}% | {r['static_gpu_h']:.1f} | "
                  f"{100 * r['oracle_att']:.2f}% | {r['oracle_gpu_h']:.1f} | {r['ratio']:.3f} |")
            if a.paths:
                print(f"  path (P D per slot): {r['path']}")
        sys.stdout.flush()
    print(f"\n{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
