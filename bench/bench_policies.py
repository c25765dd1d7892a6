"""Closed-loop comparison of scaling policies on the shared traces (issue: P/D rescaling).

Every policy replays the same trace on the same simulated deployment from the same start
(2 prefill + 2 decode replicas, the default profile, seed 0, 15 s scrapes: what
``sla-guard replay --policy NAME`` runs), and the script prints, per trace, one row per policy:
SLO attainment (share of requests meeting both TTFT and TPOT targets), the same share among the
requests the ceiling run (below) serves in SLO ("feasible attainment"), GPU-hours, scaling
actions, reversals inside the stabilisation window (flapping), TTFT p90, TPOT p90, and the
ratio of GPU-hours to the static baseline. A "ceiling" row replays the trace on a deliberately
oversized static deployment (8 prefill + 4 decode): requests it still fails (very long uncached prompts, 2-3 token
outputs) fail under any policy, so it bounds the attainment any scaler can reach.

A PNG per trace (replicas over time for each policy against the load) goes to ``--out``
(default out/bench_policies, not committed).

    .venv/bin/python bench/bench_policies.py [--traces mooncake azure] [--speeds 1 2 ...] [--duration S] [--out DIR]

``--speeds`` replays the same trace with its arrivals compressed (x2 = twice the request rate,
half the duration): the load at which a policy's choices start to matter.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACES = {
    "mooncake": str(SHARED / "mooncake_conversation_trace.jsonl"),
    "azure": str(SHARED / "azure_llm_2023_conv.csv"),
}


def trace_path(name: str) -> str | None:
    """The shared trace, else the bundled copy (Mooncake only), else None."""
    p = Path(TRACES[name])
    if p.exists():
        return str(p)
    if name == "mooncake":
        from sla_guard.sim.traces import BUNDLED_MOONCAKE

        return str(BUNDLED_MOONCAKE)
    return None
POLICIES = ("static", "queue", "planner", "guard")
WINDOW_S = 300.0  # stabilisation window the flapping count uses (the guard's scale-down window)


def reversals(actions: list[dict], window_s: float = WINDOW_S) -> int:
    """Direction changes of one pool within ``window_s`` of the previous action on that pool."""
    last: dict[str, tuple[float, int]] = {}
    n = 0
    for a in actions:
        if "pool" not in a:
            continue
        d = 1 if a["to"] > a["from"] else -1
        prev = last.get(a["pool"])
        if prev is not None and prev[1] != d and a["t"] - prev[0] < window_s:
            n += 1
        last[a["pool"]] = (a["t"], d)
    return n


def run_one(trace_path: str, policy: str, duration: float | None, speed: float = 1.0, **spec_kw) -> dict:
    from sla_guard.sim.profile import load_profile
    from sla_guard.sim.run import ReplaySpec, replay
    from sla_guard.sim.traces import load_trace

    trace = load_trace(trace_path).scaled(1.0 / speed, duration)
    spec = ReplaySpec(profile=load_profile("default"), trace=trace, policy=policy, scrape_interval_s=15.0,
                      eval_interval_s=15.0, with_guard=False, **spec_kw)
    t0 = time.perf_counter()
    res = replay(spec)
    s = res.summary
    dep = res.dep
    ok = {r.rid for r in dep.done
          if r.first_token - r.arrival <= dep.slo_ttft_s
          and (r.generated <= 1 or (r.finish - r.first_token) / (r.generated - 1) <= dep.slo_tpot_s)}
    return {
        "policy": policy, "attainment": s.slo_attainment, "gpu_hours": s.gpu_hours,
        "actions": s.scaling_actions, "reversals": reversals(res.loop.actions), "ttft_p90": s.ttft_p90_s,
        "tpot_p90": s.tpot_p90_s, "wall_s": round(time.perf_counter() - t0, 1),
        "timeline": list(res.dep.timeline), "arrivals": [r.t for r in trace.requests],
        "prompt": [r.input_len for r in trace.requests], "end": res.dep.now, "ok": ok,
    }


def table(name: str, rows: list[dict]) -> str:
    """``feasible``: attainment over the requests the oversized ceiling run serves within SLO
    (what any scaler could possibly save), next to plain attainment over all requests."""
    base = next((r for r in rows if r["policy"] == "static"), None)
    feasible = next((r["ok"] for r in rows if r["policy"] == "ceiling"), None)
    out = [f"\n## {name}",
           "| policy | attainment | feasible att. | GPU-hours | vs static | actions | reversals<300s "
           "| TTFT p90 s | TPOT p90 ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['gpu_hours'] / base['gpu_hours']:.3f}" if base and base["gpu_hours"] else "-"
        feas = f"{100 * len(r['ok'] & feasible) / len(feasible):.2f}%" if feasible else "-"
        out.append(f"| {r['policy']} | {100 * r['attainment']:.2f}% | {feas} | {r['gpu_hours']:.1f} | {ratio} | "
                   f"{r['actions']} | {r['reversals']} | {r['ttft_p90']:.3f} | {1000 * r['tpot_p90']:.2f} |")
    return "\n".join(out)


def verdict(rows: list[dict], target: float = 0.99) -> str:
    g = next(r for r in rows if r["policy"] == "guard")
    ok = [r for r in rows if r["policy"] not in ("guard", "ceiling") and r["attainment"] >= target]
    cheaper = all(g["gpu_hours"] < r["gpu_hours"] for r in ok)
    parts = [f"guard attainment {'>=' if g['attainment'] >= target else '<'} {100 * target:.0f}%",
             f"baselines reaching it: {[r['policy'] for r in ok] or 'none'}",
             f"guard cheaper than all of them: {cheaper}", f"guard reversals: {g['reversals']}"]
    return "; ".join(parts)


def plot(name: str, rows: list[dict], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return None
    shown = [r for r in rows if r["policy"] != "ceiling"]
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.2 * len(shown)), sharex=True)
    arr = np.asarray(shown[0]["arrivals"])
    prompt = np.asarray(shown[0]["prompt"], dtype=float)
    bins = np.arange(0, shown[0]["end"] + 60, 60)
    load, _ = np.histogram(arr, bins=bins, weights=prompt)
    for ax, r in zip(np.atleast_1d(axes), shown, strict=True):
        tl = np.asarray(r["timeline"], dtype=float)
        t = np.append(tl[:, 0], r["end"])
        for col, label, style in ((3, "prefill (ready+starting)", "-"), (4, "decode (ready+starting)", "-"),
                                  (1, "prefill ready", ":"), (2, "decode ready", ":")):
            ax.step(t / 60, np.append(tl[:, col], tl[-1, col]), where="post", ls=style, label=label)
        ax.set_ylabel("replicas")
        ax.set_title(f"{r['policy']}: {100 * r['attainment']:.2f}% attainment, {r['gpu_hours']:.1f} GPU-h",
                     fontsize=9)
        tw = ax.twinx()
        tw.fill_between(bins[:-1] / 60, load / 60 / 1000, step="post", alpha=0.15, color="gray")
        tw.set_ylabel("prompt ktok/s", fontsize=8)
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="upper right", ncol=2)
    np.atleast_1d(axes)[-1].set_xlabel("minutes")
    fig.suptitle(f"replicas over time vs load: {name}")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"replicas_{name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--duration", type=float, default=None, help="replay only the first N trace seconds")
    ap.add_argument("--speeds", type=float, nargs="+", default=[1.0],
                    help="arrival-rate multipliers (2 = the trace's arrivals twice as fast), one table each")
    ap.add_argument("--out", type=Path, default=Path("out/bench_policies"))
    ap.add_argument("--json", action="store_true", help="also print one JSON line per run")
    args = ap.parse_args(argv)
    for name in args.traces:
        path = trace_path(name)
        if path is None:
            print(f"\n## {name}\nskipped: {TRACES[name]} not found (the shared traces are not in the repo)")
            continue
        for speed in args.speeds:
            label = name if speed == 1.0 else f"{name}_x{speed:g}"
            rows = [run_one(path, pol, args.duration, speed) for pol in args.policies]
            ceiling = run_one(path, "static", args.duration, speed, prefill=8, decode=4, metrics=False)
            ceiling["policy"] = "ceiling"
            rows.append(ceiling)
            print(table(label, rows))
            if "guard" in args.policies:
                print("verdict:", verdict(rows))
            png = plot(label, rows, args.out)
            if png:
                print(f"plot: {png}")
            if args.json:
                for r in rows:
                    print(json.dumps({k: v for k, v in r.items()
                                      if k not in ("timeline", "arrivals", "prompt", "ok")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
