"""Evaluation harness for the leak and drift detectors, side by side with baselines.

    .venv/bin/python bench/detectors/run.py [--seeds N] [--out DIR] [--quick]
    .venv/bin/python bench/detectors/run.py --only rates --no-plots [--rate-seeds 400 --step-seeds 40]
        [--rate-param arl_rule=gaussian --rate-param refine_s=0 ...]    # the rate part alone, ~3 s (extended ~40 s)
    .venv/bin/python bench/detectors/run.py --only leaks --no-plots [--leak-seed-offset 5000]
        [--leak-param confirm=1 ...]    # the leak part alone, ~4 min; held-out seeds; LeakParams variants

Corpus: labelled series from fixed seeds (sla_guard.detect.synthetic, noise model stated
there and in docs/detectors.md). Every detector is replayed causally, as it would run live.

Leak baselines: the Prometheus rule ``predict_linear(rss[1h], 4h) > limit`` (held ``for: 15m``,
evaluated every minute), a static ``rss > 0.85 * limit`` (``for: 5m``), and river's PageHinkley
(mode "up") and ADWIN on RSS in MiB. Drift baselines: PageHinkley and ADWIN on the per-minute
acceptance rate. Reports detection delay, false alarms per series-day, precision and recall;
writes PNG plots to --out (not committed).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import defaultdict
from multiprocessing import Pool
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sla_guard.detect import drift, leak
from sla_guard.detect import synthetic as sy

MIB = sy.MIB
HOUR = sy.HOUR
DAY = sy.DAY


# --- leak detectors: each returns alarm start times (rising edges) ---------------------------

def _edges(times: np.ndarray, flags: np.ndarray) -> list[float]:
    prev = np.concatenate([[False], flags[:-1]])
    return times[flags & ~prev].tolist()


LEAK_PARAMS = leak.LeakParams()  # --leak-param overrides (set before the worker pool forks)
RATE_PARAMS = drift.RateDriftParams()  # --rate-param overrides


def _params(cls, overrides: list[str], flag: str):
    """``KEY=VALUE`` strings -> a params dataclass, each value parsed as its field's default type."""
    p = cls()
    kw = {}
    for item in overrides:
        key, sep, val = item.partition("=")
        if not sep or not hasattr(p, key):
            raise SystemExit(f"{flag} {item!r}: expected FIELD=VALUE with a {cls.__name__} field")
        cur = getattr(p, key)
        if isinstance(cur, bool):
            kw[key] = val.lower() in ("1", "true", "yes")
        elif isinstance(cur, tuple):
            kw[key] = tuple(float(x) for x in val.split(","))
        else:
            kw[key] = type(cur)(val)
    return dataclasses.replace(p, **kw)


def det_slaguard(c: sy.RssCase, use_load: bool) -> list[float]:
    p = LEAK_PARAMS
    vs = leak.scan(c.t, c.v, p, limit_bytes=c.limit_bytes, load=(c.t, c.load) if use_load else None)
    return [start for start, _ in leak.episodes(vs, min(p.windows_s))]  # the guard's hysteresis


def _rule_eval_times(c: sy.RssCase) -> np.ndarray:
    return np.arange(c.t[0] + 60, c.t[-1], 60.0)


def _held(times: np.ndarray, cond: np.ndarray, for_s: float) -> np.ndarray:
    """Prometheus ``for:``: firing once the condition held continuously for for_s."""
    out = np.zeros_like(cond)
    since = None
    for i, (t, ok) in enumerate(zip(times, cond, strict=True)):
        since = (since if since is not None else t) if ok else None
        out[i] = since is not None and t - since >= for_s
    return out


def det_predict_linear(c: sy.RssCase) -> list[float]:
    ev = _rule_eval_times(c)
    cs_t, cs_v = np.cumsum(c.t), np.cumsum(c.v)
    cs_tt, cs_tv = np.cumsum(c.t * c.t), np.cumsum(c.t * c.v)
    hi = np.searchsorted(c.t, ev, side="right")
    lo = np.searchsorted(c.t, ev - 3600, side="left")
    cond = np.zeros(len(ev), bool)
    for k, (a, b) in enumerate(zip(lo, hi, strict=True)):
        n = b - a
        if n < 2:
            continue
        st = cs_t[b - 1] - (cs_t[a - 1] if a else 0)
        sv = cs_v[b - 1] - (cs_v[a - 1] if a else 0)
        stt = cs_tt[b - 1] - (cs_tt[a - 1] if a else 0)
        stv = cs_tv[b - 1] - (cs_tv[a - 1] if a else 0)
        den = n * stt - st * st
        if den == 0:
            continue
        slope = (n * stv - st * sv) / den
        icpt = (sv - slope * st) / n
        cond[k] = icpt + slope * (ev[k] + 4 * 3600) > c.limit_bytes
    return _edges(ev, _held(ev, cond, 900))


def det_static(c: sy.RssCase) -> list[float]:
    ev = _rule_eval_times(c)
    last = c.v[np.searchsorted(c.t, ev, side="right") - 1]
    return _edges(ev, _held(ev, last > 0.85 * c.limit_bytes, 300))


def det_river(c: sy.RssCase, which: str) -> list[float]:
    from river import drift as rd

    d = rd.PageHinkley(mode="up") if which == "ph" else rd.ADWIN()
    out = []
    for t, v in zip(c.t, c.v / MIB, strict=True):
        d.update(float(v))
        if d.drift_detected:
            out.append(float(t))
    return out


LEAK_DETECTORS = {
    "sla-guard leak (load-aware)": lambda c: det_slaguard(c, True),
    "sla-guard leak (RSS only)": lambda c: det_slaguard(c, False),
    "predict_linear(1h,4h)>limit": det_predict_linear,
    "static 85% of limit": det_static,
    "river PageHinkley": lambda c: det_river(c, "ph"),
    "river ADWIN": lambda c: det_river(c, "adwin"),
}


def leak_job(args):
    kind, seed, rate, onset_h, work = args
    c = sy.rss_case(kind, seed, leak_mib_h=rate, onset_h=onset_h, work_proportional=work)
    res = {name: f(c) for name, f in LEAK_DETECTORS.items()}
    variant = "start" if onset_h == 0 else ("work" if work else "")
    return {"name": c.name, "kind": kind, "rate": rate, "onset": c.onset, "days": (c.t[-1] - c.t[0]) / DAY,
            "alarms": res, "variant": variant}


# --- rate drift -----------------------------------------------------------------------------

def _minute_rates(c: sy.RateCase):
    ti, dn = drift.counter_increments(c.t, c.drafts)
    _, dx = drift.counter_increments(c.t, c.accepted)
    te, nn, xx = drift.bin_counts(ti, dn, dx, 60.0)
    return te, xx / nn


def rate_job(args):
    kind, seed, change = args
    c = sy.rate_case(kind, seed, change=change, baseline=0.6 if kind in ("step", "gradual") else None)
    alarms, _ = drift.scan_rate(c.t, c.drafts, c.accepted, RATE_PARAMS)
    res = {"sla-guard binomial CUSUM": [a.at for a in alarms]}
    from river import drift as rd

    te, r = _minute_rates(c)
    for name, d in (("river PageHinkley", rd.PageHinkley()), ("river ADWIN", rd.ADWIN())):
        out = []
        for t, x in zip(te, r, strict=True):
            d.update(float(x))
            if d.drift_detected:
                out.append(float(t))
        res[name] = out
    return {"name": c.name, "kind": kind, "rate": change, "onset": c.onset, "days": (c.t[-1] - c.t[0]) / DAY,
            "alarms": res, "variant": ""}


# --- scoring --------------------------------------------------------------------------------

def score(results: list[dict], detector: str) -> dict:
    fa, days, tp, delays = 0, 0.0, 0, defaultdict(list)
    positives, missed = defaultdict(int), defaultdict(int)
    for r in results:
        alarms = r["alarms"][detector]
        if r["onset"] is None:
            fa += len(alarms)
            days += r["days"]
            continue
        pre = [a for a in alarms if a < r["onset"]]
        post = [a for a in alarms if a >= r["onset"]]
        fa += len(pre)
        days += r["onset"] / DAY
        key = (r["rate"], r["variant"])
        positives[key] += 1
        if post:
            tp += 1
            delays[key].append((post[0] - r["onset"]) / HOUR)
        else:
            missed[key] += 1
    n_pos = sum(positives.values())
    return {"fa": fa, "days": days, "fa_per_day": fa / days if days else float("nan"),
            "precision": tp / (tp + fa) if tp + fa else float("nan"), "recall": tp / n_pos if n_pos else float("nan"),
            "delays": dict(delays), "positives": dict(positives)}


def _fmt_delay(ds: list[float], unit: float) -> str:
    if not ds:
        return "-"
    return f"{np.median(ds) * unit:.1f}/{np.max(ds) * unit:.1f}"


def table(title: str, results: list[dict], detectors, keys, unit: float, unit_name: str) -> str:
    lines = [f"\n== {title} ==",
             f"delay = median/max {unit_name} after onset over detected cases (n detected of n)"]
    head = f"{'detector':30s} {'FA/series-day':>13s} {'FA per 30d':>10s} {'precision':>9s} {'recall':>6s}"
    for k in keys:
        head += f" {k[2]:>17s}"
    lines.append(head)
    for d in detectors:
        s = score(results, d)
        row = (f"{d:30s} {s['fa_per_day']:13.4f} {s['fa_per_day'] * 30:10.2f} {s['precision']:9.3f} "
               f"{s['recall']:6.3f}")
        for k in keys:
            ds = s["delays"].get(k[:2], [])
            cell = f"{_fmt_delay(ds, unit)} ({len(ds)}/{s['positives'].get(k[:2], 0)})"
            row += f" {cell:>17s}"
        lines.append(row)
    s0 = score(results, detectors[0])
    lines.append(f"non-leaking / pre-onset exposure: {s0['days']:.1f} series-days")
    return "\n".join(lines)


def plots(out: Path, leak_results: list[dict], rate_results: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots")
        return
    out.mkdir(parents=True, exist_ok=True)
    for kind, seed, rate in (("sawtooth", 1000, 48.0), ("plateaus", 1, 0.0), ("load_swings", 2, 0.0)):
        c = sy.rss_case(kind, seed, leak_mib_h=rate)
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.plot(c.t / HOUR, c.v / 2**30, lw=0.4, label="RSS")
        tf, yf = leak.floor_series(c.t, c.v, 300, 900)
        ax.plot(tf / HOUR, yf / 2**30, lw=1.2, label="floor")
        marks = {"sla-guard": det_slaguard(c, True), "predict_linear": det_predict_linear(c),
                 "PageHinkley": det_river(c, "ph")}
        for (name, ts), col in zip(marks.items(), ("red", "orange", "purple"), strict=True):
            for i, a in enumerate(ts[:20]):
                ax.axvline(a / HOUR, color=col, lw=0.8, ls="--", label=name if i == 0 else None)
        if c.onset is not None:
            ax.axvline(c.onset / HOUR, color="black", lw=1.5, label="leak onset")
        ax.set_xlabel("hours")
        ax.set_ylabel("GiB")
        ax.set_title(c.name)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"leak_{c.name}.png", dpi=90)
        plt.close(fig)
    c = sy.rate_case("step", 0, change=-0.10, baseline=0.6)
    te, r = _minute_rates(c)
    alarms, _ = drift.scan_rate(c.t, c.drafts, c.accepted)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(te / HOUR, r, lw=0.5, label="acceptance per minute")
    for i, a in enumerate(alarms):
        ax.axvline(a.at / HOUR, color="red", ls="--", label="CUSUM alarm" if i == 0 else None)
    ax.axvline(c.onset / HOUR, color="black", label="onset")
    ax.legend()
    ax.set_xlabel("hours")
    fig.tight_layout()
    fig.savefig(out / "drift_step_-0.10.png", dpi=90)
    plt.close(fig)
    print(f"plots written to {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=12, help="seeds per non-leaking kind (2 days each)")
    ap.add_argument("--leak-seeds", type=int, default=8, help="seeds per leak rate")
    ap.add_argument("--rate-seeds", type=int, default=40, help="seeds per rate kind (1 day each)")
    ap.add_argument("--out", type=Path, default=Path("out/bench-detectors"))
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true", help="a few seeds only (smoke test)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--only", choices=("all", "leaks", "rates"), default="all",
                    help="run one part of the corpus only (same seeds as the full run)")
    ap.add_argument("--step-seeds", type=int, default=None,
                    help="seeds per rate step size (default: rate-seeds / 4); FA series unchanged")
    ap.add_argument("--rate-param", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a RateDriftParams field for sla-guard's rate rows (repeatable), "
                         "e.g. arl_rule=gaussian, jitter_blocks=24, refine_s=0")
    ap.add_argument("--leak-seed-offset", type=int, default=0,
                    help="add this to every leak-corpus seed: a held-out corpus (0: the fixed one)")
    ap.add_argument("--rate-seed-offset", type=int, default=0,
                    help="add this to every rate-corpus seed: a held-out corpus (0: the fixed one)")
    ap.add_argument("--leak-param", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a LeakParams field for sla-guard's leak rows (repeatable)")
    a = ap.parse_args(argv)
    global LEAK_PARAMS, RATE_PARAMS
    LEAK_PARAMS = _params(leak.LeakParams, a.leak_param, "--leak-param")
    RATE_PARAMS = _params(drift.RateDriftParams, a.rate_param, "--rate-param")
    if a.quick:
        a.seeds, a.leak_seeds, a.rate_seeds = 2, 2, 4
    t0 = time.time()
    # leaks: non-leaking kinds, then leaks on varied backgrounds (seeds offset from the FA set)
    jobs = [(k, s, 0.0, None, False) for k in sy.RSS_KINDS for s in range(a.seeds)]
    bg = ("sawtooth", "load_swings", "plateaus", "warmup")
    for rate in (10.0, 48.0, 200.0):
        jobs += [(bg[s % len(bg)], 1000 + s, rate, None, False) for s in range(a.leak_seeds)]
    jobs += [(bg[s % len(bg)], 2000 + s, 48.0, 0.0, False) for s in range(max(2, a.leak_seeds // 2))]
    jobs += [(bg[s % len(bg)], 3000 + s, 48.0, None, True) for s in range(max(2, a.leak_seeds // 2))]
    rjobs = [(k, s, 0.0) for k in ("stationary", "load_change") for s in range(a.rate_seeds)]
    n_steps = a.step_seeds if a.step_seeds is not None else max(2, a.rate_seeds // 4)
    for ch in (-0.05, -0.10, -0.15, 0.10):
        rjobs += [("step", 1000 + s, ch) for s in range(n_steps)]
    rjobs += [("gradual", 1000 + s, -0.10) for s in range(n_steps)]
    rjobs = [(k, s + a.rate_seed_offset, ch) for k, s, ch in rjobs]
    if a.only == "rates":
        jobs = []
    if a.only == "leaks":
        rjobs = []
    jobs = [(k, s + a.leak_seed_offset, *rest) for k, s, *rest in jobs]
    with Pool(a.jobs) as pool:
        leak_results = pool.map(leak_job, jobs, chunksize=1)
        rate_results = pool.map(rate_job, rjobs, chunksize=2)
    keys = [(10.0, "", "10MiB/h h"), (48.0, "", "48MiB/h h"), (200.0, "", "200MiB/h h"),
            (48.0, "start", "48@start h"), (48.0, "work", "48 per-work h")]
    if jobs:
        print(table("host-memory leak (6 GiB process, 8 GiB limit, 2-day series)", leak_results,
                    list(LEAK_DETECTORS), keys, 1.0, "hours"))
    if not rjobs:
        if not a.no_plots:
            plots(a.out, leak_results, rate_results)
        print(f"({time.time() - t0:.0f} s)")
        return 0
    rkeys = [(-0.05, "", "-0.05 min"), (-0.10, "", "-0.10 min"), (-0.15, "", "-0.15 min"),
             (0.10, "", "+0.10 min")]
    steps = [r for r in rate_results if r["kind"] != "gradual"]
    print(table("spec-decode acceptance drift (step at 50 draft tokens/s; 1-day series)", steps,
                ["sla-guard binomial CUSUM", "river PageHinkley", "river ADWIN"], rkeys, 60.0, "minutes"))
    grad = [r for r in rate_results if r["kind"] == "gradual"]
    gs = score(grad, "sla-guard binomial CUSUM")
    gd = [d for v in gs["delays"].values() for d in v]
    print(f"gradual -0.10 over 1 h: CUSUM detected {len(gd)}/{len(grad)}, delay median "
          f"{np.median(gd) * 60 if gd else float('nan'):.1f} min after ramp start")
    p = RATE_PARAMS
    lorden = drift.threshold_for_arl(p.arl0_s, p.interval_s, p.n_sides, p.family)
    rule = ("Lorden ln(ARL0/interval * sides)" if p.arl_rule == "lorden" else
            f"exact Gaussian-LLR ARL, worst case (Lorden: {lorden:.2f}; lower where jitter caps an interval)")
    print(f"CUSUM threshold h = {p.threshold:.2f} nats, {rule} (ARL0 {p.arl0_s / DAY:.0f} d, interval "
          f"{p.interval_s:.0f} s, sides {p.n_sides}); jitter blocks {p.jitter_blocks}, "
          f"tolerance {p.tolerance}, shift {p.shift}, baseline refined for {p.refine_s / HOUR:g} h")
    if not a.no_plots:
        plots(a.out, leak_results, rate_results)
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
