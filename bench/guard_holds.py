"""Where the guard holds replicas above what its sizing asks for, by the rule that holds them.

For each workload the guard policy is replayed (as ``bench_policies.py`` runs it) and every
decision tick is recorded. On a tick where a pool is held (desired == current) above its raw
desire, the replicas over the raw desire, times the tick's length and the GPUs per replica, are
counted against the first ``hold_*`` reason; for ``hold_n_minus_1_would_not_fit`` the tests N-1
failed (the ``n_minus_1_*`` reasons) are appended. Held replicas are not all waste: the windows
are what keeps reversals at 0. The table says which rule to look at, not what to cut.

Tuning data only (the suite's tuning half, or the blind generator's tuning-more half): reading
the sealed half rule by rule is tuning to it.

    .venv/bin/python bench/guard_holds.py --seeds 0 1 2 3 4 5 6 7 8 9 --jobs 2   # 72 workloads
    .venv/bin/python bench/guard_holds.py --generator blind
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _workloads(generator: str, seeds: tuple[int, ...] = ()) -> dict:
    """The tuning half, plus every family at each of ``seeds`` (seeds 0-9 give 72 workloads, of
    which docs/scaling.md's 45 comparison cells are a subset)."""
    if generator == "blind":
        import workloads_blind  # bench/workloads_blind.py, beside this script

        return {w.name: w for w in workloads_blind.suite("tuning-more")}
    from sla_guard.sim.workloads import suite

    out = {w.name: w for w in suite("tuning")}
    for s in seeds:
        for w in suite("tuning", seeds=(s,), traces=False):
            out.setdefault(w.name, w)
    return out


def cause(pool: str, reasons: list[str]) -> str:
    """The first hold reason, with the failed N-1 tests where that is the hold."""
    hold = next((r for r in reasons if r.startswith("hold_")), "none")
    if hold == "hold_n_minus_1_would_not_fit":
        failed = [r.removeprefix("n_minus_1_") for r in reasons if r.startswith("n_minus_1_")]
        hold += ":" + "+".join(failed or ["?"])
    return f"{pool} {hold}"


def held(generator: str, seeds: tuple[int, ...], name: str) -> tuple[str, float, float, dict[str, float]]:
    """Replay ``name`` under the guard; GPU-hours held above the raw desire, by cause."""
    import bench_policies as bp

    import sla_guard.scale.advisor as advisor
    from sla_guard.sim.profile import load_profile

    ticks: list[tuple[float, str, int, int, int | None, list[str]]] = []
    step = advisor.Advisor.step

    def recording_step(self, view, now, *args, **kwargs):
        decs, restarts = step(self, view, now, *args, **kwargs)
        for pool, d in decs.items():
            ticks.append((now, pool, d.current, d.desired, d.numbers.get("raw_desired"), list(d.reasons)))
        return decs, restarts

    advisor.Advisor.step = recording_step  # this worker process only
    w = _workloads(generator, seeds)[name]
    row = bp.run_one(w, "guard", metrics=True)
    gpus = w.profile(load_profile("default")).gpus_per_replica
    by_cause: dict[str, float] = defaultdict(float)
    last: dict[str, float] = {}
    for now, pool, current, desired, raw, reasons in ticks:
        dt, last[pool] = now - last.get(pool, now), now
        if raw is not None and desired == current and raw < current and dt > 0:
            by_cause[cause(pool, reasons)] += (current - raw) * dt / 3600.0 * gpus
    return name, row["gpu_hours"], row["attainment"], dict(by_cause)


def _held(args: tuple[str, tuple[int, ...], str]) -> tuple[str, float, float, dict[str, float]]:
    return held(*args)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generator", choices=("suite", "blind"), default="suite")
    ap.add_argument("--workloads", nargs="*", help="only workloads whose name contains one of these")
    ap.add_argument("--seeds", type=int, nargs="*", default=[],
                    help="suite only: the generated families at these tuning seeds too (never 100-199, sealed)")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    if any(100 <= s < 200 for s in args.seeds) or (args.seeds and args.generator == "blind"):
        ap.error("--seeds adds the suite's tuning seeds: outside 100-199 (sealed), and not with --generator blind")
    seeds = tuple(args.seeds)
    names = list(_workloads(args.generator, seeds))
    if args.workloads:
        names = [n for n in names if any(k in n for k in args.workloads)]
    total: dict[str, float] = defaultdict(float)
    gpu_h = 0.0
    with Pool(args.jobs) as pool:
        for name, g, att, by_cause in pool.imap(_held, [(args.generator, seeds, n) for n in names]):
            gpu_h += g
            for k, v in by_cause.items():
                total[k] += v
            top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_cause.items(), key=lambda kv: -kv[1])[:3])
            print(f"{name:32s} {att * 100:6.2f} % {g:7.1f} GPU-h | held: {top}", flush=True)
    print(f"\n{len(names)} workloads, {gpu_h:.1f} GPU-h; held above the raw desire, by the rule that held:")
    for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"  {k:70s} {v:8.1f}")


if __name__ == "__main__":
    main()
