"""`sla-guard analyze leak|drift|prefix|tpot FILE...`: run a detector offline over a recorded series, as the
guard would have run it live, for post-mortems and CI. FILE is a CSV with the kind's columns, or
what the tools export: a Prometheus answer saved as JSON (curl .../api/v1/query_range, promtool
query range -o json) or Grafana's Inspect > Data > Download CSV. Prints one JSON object; exit code
0 whether or not something was detected, 2 when the input cannot be read."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from sla_guard.commands import number
from sla_guard.commands.analyze_input import (
    COLUMNS,
    RSS_UNITS,
    SERIES_NAMES,
    InputError,
    check_counters,
    check_not_rounded,
    memory_limit,
    read_series,
    rss_in_bytes,
)
from sla_guard.detect import census, drift, leak
from sla_guard.epoch import SECONDS_PER
from sla_guard.settings.detectors import DetectorsConfig

# option types: finite and in range (--time-scale 0, --interval-s 0 or --tolerance -1 used to end in a traceback,
# --arl0-days 0 or --warmup-s nan in a verdict)
POS, NONNEG = number(0), number(0, above=False)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("analyze", help="detect leaks / rate drifts in a recorded CSV (post-mortem, CI)",
                       description=__doc__)
    kinds = p.add_subparsers(dest="kind", required=True)
    lk = _kind(kinds, "leak", "CSV columns: timestamp,rss_bytes[,limit_bytes][,running_requests] "
                                       "(running requests make it load-aware, as in the guard)")
    _input_args(lk)
    lk.add_argument("--rss-unit", choices=tuple(RSS_UNITS), default=None,
                    help="unit of the rss_bytes column when not bytes (KiB: ps -o rss, /proc/<pid>/status VmRSS); "
                         "default: bytes, and a median under 64 MiB is refused as another unit")
    lk.add_argument("--limit-bytes", type=NONNEG, default=None,
                    help="memory limit when the CSV has none (0: no limit)")
    lk.add_argument("--time-scale", type=POS, default=1.0,
                    help="compress the detector's time constants by this factor (tests; default 1 = production)")
    lk.add_argument("--census", type=Path, default=None, metavar="FILE",
                    help="the process's object census (census-<pid>.json from the plugin's run directory): "
                         "name the growing containers and the share of the RSS slope they explain")
    dr = _kind(kinds, "drift", "CSV columns: timestamp,draft_tokens,accepted_tokens (cumulative)")
    _input_args(dr)
    _increments_arg(dr)
    d = drift.RateDriftParams()  # the guard's defaults: offline and online verdicts agree
    dr.add_argument("--arl0-days", type=POS, default=d.arl0_s / 86400, help="mean time between false alarms (days)")
    dr.add_argument("--shift", type=POS, default=d.shift, help="design shift beyond the tolerance band")
    dr.add_argument("--tolerance", type=NONNEG, default=d.tolerance, help="rate wander (+-) that is not drift")
    dr.add_argument("--sides", choices=("down", "up", "both"), default=d.sides)
    dr.add_argument("--warmup-s", type=POS, default=d.warmup_s, help="baseline learning span (s)")
    dr.add_argument("--interval-s", type=POS, default=d.interval_s, help="CUSUM step (s)")
    dr.add_argument("--arl-rule", choices=("gaussian", "lorden"), default=d.arl_rule,
                    help="threshold: exact Gaussian run length or Lorden's bound (docs/detectors.md)")
    dr.add_argument("--jitter-blocks", type=int, default=d.jitter_blocks,
                    help="re-estimate jitter over this many blocks after warm-up (0: warm-up only)")
    dr.add_argument("--refine-s", type=NONNEG, default=d.refine_s,
                    help="keep learning the baseline until this long after the start (0: warm-up only)")
    px = _kind(kinds, "prefix", "CSV columns: timestamp,queries_tokens,hits_tokens (the prefix cache's "
                                         "query and hit counters, cumulative; judged downward, as in the guard)")
    _input_args(px)
    _increments_arg(px)
    pc = DetectorsConfig().prefix_hit  # the guard's defaults for the prefix-cache hit rate
    px.add_argument("--arl0-days", type=POS, default=pc.arl0_days, help="mean time between false alarms (days)")
    px.add_argument("--warmup-s", type=POS, default=pc.warmup_s, help="baseline learning span (s)")
    px.add_argument("--interval-s", type=POS, default=pc.interval_s, help="one interval of the test (s)")
    px.add_argument("--reset-hold-s", type=NONNEG, default=pc.reset_hold_s,
                    help="after a counter reset (an engine restart: an empty cache) this long is not judged (s)")
    tp = _kind(kinds, "tpot", "CSV columns: timestamp,tpot_sum_seconds,tpot_count,running_requests "
                                       "(the TPOT histogram's _sum and _count, cumulative; the pool's running "
                                       "requests per engine)")
    _input_args(tp)
    _increments_arg(tp)
    t = drift.LatencyDriftParams()
    tp.add_argument("--arl0-days", type=POS, default=t.arl0_s / 86400, help="mean time between false alarms (days)")
    tp.add_argument("--warmup-s", type=POS, default=t.warmup_s, help="reference learning span (s)")
    tp.add_argument("--interval-s", type=POS, default=t.interval_s, help="one interval of the test (s)")
    return p


def _kind(kinds, name: str, text: str) -> argparse.ArgumentParser:
    """A kind's parser, its --help naming the columns and the metric names they are found under."""
    required, optional = COLUMNS[name]
    found = "; ".join(f"{col}: {' or '.join(SERIES_NAMES[col])}" for col in (*required, *optional)
                      if col in SERIES_NAMES)
    return kinds.add_parser(name, help=text, description=f"{text}. In Prometheus JSON or a Grafana CSV export, the "
                            f"series are found by metric name ({found}) or a legend named as the column.")


def _input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, nargs="+",
                   help="a CSV with these columns (any order and case); or series: a Prometheus answer saved as "
                        "JSON (curl .../api/v1/query_range, promtool query range -o json) or Grafana's "
                        "Inspect > Data > Download CSV, the columns found by metric name or legend; "
                        "several series files are joined by time")
    p.add_argument("--series", action="append", default=[], metavar="LABEL=VALUE",
                   help="where a column has several series (one per process or engine), the one whose labels "
                        "match (e.g. pid=1, or 'engine=\"0\",model_name=\"m\"'), or the Grafana column of that "
                        "header; repeat it for columns told apart by other labels")
    p.add_argument("--timestamp-unit", choices=("auto", *SECONDS_PER), default="auto",
                   help="unit of numeric timestamps (default auto: epoch s, ms, us or ns, whichever makes them dates "
                        "of 2000-2100; "
                        "give it for timestamps counted from 0 in ms)")


def _increments_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--increments", action="store_true",
                   help="the counter columns hold per-interval counts (an increase() export), not cumulative counters")


def analyze_leak(cols: dict[str, np.ndarray], limit_bytes: float | None, time_scale: float = 1.0) -> dict:
    params = leak.LeakParams().scaled(time_scale)
    if limit_bytes is None and "limit_bytes" in cols:
        lim = cols["limit_bytes"][np.isfinite(cols["limit_bytes"])]
        limit_bytes = float(lim[-1]) if len(lim) else None
    t, v = cols["timestamp"], cols["rss_bytes"]
    load = None
    if "running_requests" in cols:
        ok = np.isfinite(cols["running_requests"])
        load = (t[ok], cols["running_requests"][ok]) if ok.sum() >= 2 else None
    verdicts = leak.scan(t, v, params, limit_bytes=limit_bytes, load=load)
    first = leak.first_detection(verdicts)
    last = verdicts[-1][1] if verdicts else leak.LeakVerdict("unknown", "too_short")
    shown = first[1] if first else last
    episodes = len(leak.episodes(verdicts, min(params.windows_s)))
    return {
        "detected": first is not None,
        "detected_at": first[0] if first else None,
        "status_at_end": last.status,
        "reason": shown.reason,
        "slope_mib_per_h": round(shown.slope_mib_per_h, 3),
        "confidence": shown.confidence,
        "z": shown.z,
        "window_s": shown.window_s,
        "onset": shown.onset,
        "floor_bytes": shown.floor_bytes,
        "limit_bytes": limit_bytes,
        "eta_s": shown.eta_s,
        # the periodic (hourly) swing taken out of the floor before the tests, half-amplitude
        "hourly_swing_mib": round(shown.hourly_swing_bytes / leak.MIB, 1),
        # > 0: after repeated excursions (a climb, then a fall back to an earlier level) the 4 h
        # window read the floor's running minimum over this many minutes: the levels it falls back to
        "excursion_envelope_min": round(shown.excursion_envelope_s / 60, 1),
        "alarms": episodes,
        "samples": len(t),
        "span_s": float(t.max() - t.min()),
        "time_scale": time_scale,
        "load_aware": load is not None,
    }


def analyze_drift(cols: dict[str, np.ndarray], args) -> dict:
    try:
        params = drift.RateDriftParams(
            interval_s=args.interval_s, warmup_s=args.warmup_s, shift=args.shift, tolerance=args.tolerance,
            sides=args.sides, arl0_s=args.arl0_days * drift.DAY, arl_rule=args.arl_rule,
            jitter_blocks=args.jitter_blocks, refine_s=args.refine_s)
    except ValueError as err:
        raise InputError(f"bad option: {err}") from None
    return _rate_result(cols["timestamp"], cols["draft_tokens"], cols["accepted_tokens"], params, args.arl0_days)


def analyze_prefix(cols: dict[str, np.ndarray], args) -> dict:
    """The prefix-cache hit rate as the guard's ``prefix_hit_drift`` evaluator judges it: downward,
    with its wander and its hold after a counter reset (docs/detectors.md)."""
    if not (args.arl0_days > 0 and args.warmup_s > 0 and args.interval_s > 0 and args.reset_hold_s >= 0):
        raise InputError("bad option: --arl0-days, --warmup-s and --interval-s must be > 0, --reset-hold-s >= 0")
    from sla_guard.detect.evaluators import rate_params

    cfg = DetectorsConfig().prefix_hit.model_copy(update={
        "interval_s": args.interval_s, "warmup_s": args.warmup_s, "arl0_days": args.arl0_days,
        "reset_hold_s": args.reset_hold_s})
    params = rate_params(cfg, "down")
    return _rate_result(cols["timestamp"], cols["queries_tokens"], cols["hits_tokens"], params, args.arl0_days)


def _rate_result(t, trials, successes, params: drift.RateDriftParams, arl0_days: float) -> dict:
    alarms, cus = drift.scan_rate(t, trials, successes, params)
    first = alarms[0] if alarms else None
    return {
        "detected": first is not None,
        "detected_at": first.at if first else None,
        "direction": first.direction if first else None,
        "baseline_rate": first.baseline if first else cus.p0,  # p0 keeps learning after the alarm's
        "rate_after": first.after if first else cus.recent_rate(),
        "change_at": first.change_at if first else None,
        "alarms": len(alarms),
        # which test fired: the step CUSUM (statistic and threshold in nats) or the slow-drift
        # window test (|z| against its z threshold, in standard errors)
        "test": first.test if first else None,
        "statistic": first.statistic if first else None,
        "test_threshold": first.threshold if first else None,
        "threshold_nats": cus.threshold,
        "arl0_days": arl0_days,
        "tau": math.sqrt(cus.tau2) if cus.p0 is not None else None,
        "baseline_learned": cus.p0 is not None,
        "intervals_skipped": cus.skipped,
        "intervals_after_restarts_not_judged": cus.cold,
    }


def analyze_tpot(cols: dict[str, np.ndarray], args) -> dict:
    if not (args.arl0_days > 0 and args.warmup_s > 0 and args.interval_s > 0):
        raise InputError("bad option: --arl0-days, --warmup-s and --interval-s must be > 0")
    params = drift.LatencyDriftParams(interval_s=args.interval_s, warmup_s=args.warmup_s,
                                      arl0_s=args.arl0_days * drift.DAY)
    alarms, det = drift.scan_latency(cols["timestamp"], cols["tpot_sum_seconds"], cols["tpot_count"],
                                     cols["running_requests"], params)
    first = alarms[0] if alarms else None
    snap = det.snapshot()
    return {
        "detected": first is not None,
        "detected_at": first.at if first else None,
        "slowdown": first.after if first else None,  # TPOT / reference at the same batch, after change_at
        "change_at": first.change_at if first else None,
        "alarms": len(alarms),
        "z": first.statistic if first else None,
        "z_threshold": params.threshold,
        "arl0_days": args.arl0_days,
        "reference_learned": det.ready,
        "reference": snap["reference"],
        "intervals_unknown": det.unknown,
    }


def _finite(v):
    """JSON has no NaN/inf: report them as null."""
    if isinstance(v, float | np.floating):
        return float(v) if math.isfinite(v) else None
    return v


def run(args) -> int:
    unit = getattr(args, "timestamp_unit", "auto")
    files = args.file if isinstance(args.file, list) else [args.file]
    where = ", ".join(map(str, files))
    required, optional = COLUMNS[args.kind]
    try:
        cols, read = read_series(files, required, optional, unit, getattr(args, "series", []))
        if args.kind == "leak":
            cols["rss_bytes"] = rss_in_bytes(where, "rss_bytes", cols["rss_bytes"], args.rss_unit)
            result = analyze_leak(cols, memory_limit(where, cols, args.limit_bytes), args.time_scale)
            result["rss_unit"] = args.rss_unit or "B"
            if getattr(args, "census", None) is not None:
                try:
                    data = census.read_census_file(args.census)
                except ValueError as err:
                    raise InputError(str(err)) from None
                slope = result["slope_mib_per_h"] * 2**20 if result["detected"] else None
                result.update(census.census_summary(data, slope))
        elif args.kind == "prefix":
            check_counters(where, cols, ("queries_tokens", "hits_tokens"), args.increments,
                      ("hits_tokens", "queries_tokens"))
            result = analyze_prefix(cols, args)
        elif args.kind == "tpot":
            check_not_rounded(where, cols["tpot_sum_seconds"])
            check_counters(where, cols, ("tpot_sum_seconds", "tpot_count"), args.increments)
            result = analyze_tpot(cols, args)
        else:
            check_counters(where, cols, ("draft_tokens", "accepted_tokens"), args.increments,
                      ("accepted_tokens", "draft_tokens"))
            result = analyze_drift(cols, args)
    except InputError as err:
        print(f"sla-guard analyze: {err}", file=sys.stderr)
        return 2
    result |= read
    print(json.dumps({k: _finite(v) for k, v in result.items()}))
    return 0
