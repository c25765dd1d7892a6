"""`sla-guard analyze leak|drift|prefix|tpot FILE.csv`: run a detector offline over a recorded series, as the
guard would have run it live, for post-mortems and CI. Prints one JSON object; exit code 0
whether or not something was detected, 2 when the input cannot be read."""

from __future__ import annotations

import argparse
import array
import csv
import gzip
import json
import math
import sys
from datetime import datetime
from pathlib import Path

import numpy as np

from sla_guard.commands import number
from sla_guard.detect import census, drift, leak
from sla_guard.settings.detectors import DetectorsConfig

# option types: finite and in range (--time-scale 0, --interval-s 0 or --tolerance -1 used to end in a traceback,
# --arl0-days 0 or --warmup-s nan in a verdict)
POS, NONNEG = number(0), number(0, above=False)


class InputError(ValueError):
    """Unreadable input; the message names the file, row and column and how to fix it."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("analyze", help="detect leaks / rate drifts in a recorded CSV (post-mortem, CI)",
                       description=__doc__)
    kinds = p.add_subparsers(dest="kind", required=True)
    lk = kinds.add_parser("leak", help="CSV columns: timestamp,rss_bytes[,limit_bytes][,running_requests] "
                                       "(running requests make it load-aware, as in the guard)")
    lk.add_argument("file", type=Path)
    _unit_arg(lk)
    lk.add_argument("--limit-bytes", type=NONNEG, default=None,
                    help="memory limit when the CSV has none (0: no limit)")
    lk.add_argument("--time-scale", type=POS, default=1.0,
                    help="compress the detector's time constants by this factor (tests; default 1 = production)")
    lk.add_argument("--census", type=Path, default=None, metavar="FILE",
                    help="the process's object census (census-<pid>.json from the plugin's run directory): "
                         "name the growing containers and the share of the RSS slope they explain")
    dr = kinds.add_parser("drift", help="CSV columns: timestamp,draft_tokens,accepted_tokens (cumulative)")
    dr.add_argument("file", type=Path)
    _unit_arg(dr)
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
    px = kinds.add_parser("prefix", help="CSV columns: timestamp,queries_tokens,hits_tokens (the prefix cache's "
                                         "query and hit counters, cumulative; judged downward, as in the guard)")
    px.add_argument("file", type=Path)
    _unit_arg(px)
    _increments_arg(px)
    pc = DetectorsConfig().prefix_hit  # the guard's defaults for the prefix-cache hit rate
    px.add_argument("--arl0-days", type=POS, default=pc.arl0_days, help="mean time between false alarms (days)")
    px.add_argument("--warmup-s", type=POS, default=pc.warmup_s, help="baseline learning span (s)")
    px.add_argument("--interval-s", type=POS, default=pc.interval_s, help="one interval of the test (s)")
    px.add_argument("--reset-hold-s", type=NONNEG, default=pc.reset_hold_s,
                    help="after a counter reset (an engine restart: an empty cache) this long is not judged (s)")
    tp = kinds.add_parser("tpot", help="CSV columns: timestamp,tpot_sum_seconds,tpot_count,running_requests "
                                       "(the TPOT histogram's _sum and _count, cumulative; the pool's running "
                                       "requests per engine)")
    tp.add_argument("file", type=Path)
    _unit_arg(tp)
    _increments_arg(tp)
    t = drift.LatencyDriftParams()
    tp.add_argument("--arl0-days", type=POS, default=t.arl0_s / 86400, help="mean time between false alarms (days)")
    tp.add_argument("--warmup-s", type=POS, default=t.warmup_s, help="reference learning span (s)")
    tp.add_argument("--interval-s", type=POS, default=t.interval_s, help="one interval of the test (s)")
    return p


def _unit_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timestamp-unit", choices=("auto", *TIME_UNITS), default="auto",
                   help="unit of numeric timestamps (default auto: epoch seconds, ms, us or ns by their size; "
                        "give it for timestamps counted from 0 in ms)")


def _increments_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--increments", action="store_true",
                   help="the counter columns hold per-interval counts (an increase() export), not cumulative counters")


def _ts(text: str) -> tuple[float, bool]:
    """(seconds or a number in the file's unit, whether it was ISO 8601)."""
    try:
        return float(text), False
    except ValueError:
        return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp(), True


# seconds per unit of a numeric timestamp
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def epoch_unit(t: np.ndarray) -> str:
    """The unit of numeric epoch timestamps, from their size. Grafana's CSV export and most
    databases write milliseconds (1.7e12 in 2026), some micro- or nanoseconds; read as seconds, a
    12 h series spans 500 days between samples a minute apart, and every detector stays silent.
    Seconds reach 1e11 only in the year 5138, milliseconds were past it by 1973."""
    m = float(np.median(np.abs(t)))
    return "ns" if m >= 1e17 else "us" if m >= 1e14 else "ms" if m >= 1e11 else "s"


# the widest median sample spacing taken as seconds from numbers counted from 0 without --timestamp-unit
MAX_RELATIVE_SPACING_S = 600.0


def _relative_seconds(path: Path, t: np.ndarray) -> None:
    """Numbers counted from 0 (not epoch times) have no size that tells their unit, and were read as
    seconds: milliseconds 15 s apart became samples 4 h apart, a 6 h series 250 days long, and the
    verdict was made up (a false upward drift). Samples over 10 minutes apart are no scrape
    interval: refused, the unit to pass named."""
    if len(t) < 2 or float(t[0]) >= 1e9:  # epoch seconds (2001 on): the unit is known
        return
    steps = np.diff(t)
    gap = float(np.median(steps[steps > 0])) if np.any(steps > 0) else 0.0
    if gap > MAX_RELATIVE_SPACING_S:
        raise InputError(f"{path}: column timestamp counts from {t[0]:g}, not an epoch time, and read as seconds its "
                         f"samples are {gap / 3600:.3g} h apart (the series {float(t[-1] - t[0]) / 3600:,.1f} h long): "
                         f"if these are milliseconds, pass --timestamp-unit ms; if seconds, --timestamp-unit s")


def _open_text(path: Path):
    """The file as text. A UTF-8 byte-order mark (Excel's "CSV UTF-8") is taken off, or the header's
    first name is not ``timestamp``; a gzip file (an export compressed on its way off a cluster) is
    read through, not refused as undecodable bytes."""
    with path.open("rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    if gz:
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return path.open(encoding="utf-8-sig", newline="")


def read_csv(path: Path, required: tuple[str, ...], optional: tuple[str, ...] = (),
             timestamp_unit: str = "auto") -> tuple[dict[str, np.ndarray], dict]:
    """Numeric columns of a CSV with a header (timestamps as unix seconds, milliseconds, micro- or
    nanoseconds, or ISO 8601), and what reading them did: the timestamp unit and the rows left
    out because a cell was empty (a missed scrape in an export; the detectors treat it as a hole).
    A cell that is not a number is an error: that is a wrong file, not a gap. The file (gzip too) is
    read row by row into 8-byte doubles: in lists of Python floats a 115 MiB export took 675 MiB."""
    skipped: dict[str, int] = {}
    try:
        with _open_text(path) as fh:
            reader = csv.DictReader(fh)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in required if c not in header]
            if missing:
                raise InputError(f"{path}: missing column(s) {', '.join(missing)}; the header must contain "
                                 f"{','.join(required)}" + (f" (optional: {','.join(optional)})" if optional else "")
                                 + f", got {','.join(header) or 'no header'}")
            cols: dict[str, array.array] = {c: array.array("d") for c in (*required, *optional) if c in header}
            iso = False
            for row_no, row in enumerate(reader, start=2):
                row = {(k or "").strip(): v for k, v in row.items()}
                empty = [c for c in required if not (row.get(c) or "").strip()]
                if empty:
                    for c in empty:
                        skipped[c] = skipped.get(c, 0) + 1
                    continue
                for c in cols:
                    raw = (row.get(c) or "").strip()
                    if c in optional and raw == "":
                        cols[c].append(math.nan)
                        continue
                    try:
                        if c == "timestamp":
                            val, was_iso = _ts(raw)
                            iso = iso or was_iso
                        else:
                            val = float(raw)
                    except ValueError:
                        raise InputError(f"{path}: row {row_no}, column {c}: {raw!r} is not a number"
                                         + (" or ISO 8601 time" if c == "timestamp" else "")) from None
                    if not math.isfinite(val):
                        raise InputError(f"{path}: row {row_no}, column {c}: {raw!r} is not finite")
                    cols[c].append(val)
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, csv.Error, EOFError) as err:  # EOFError: a truncated gzip file
        raise InputError(f"{path} is not a readable CSV: {err}") from None
    out = {c: np.frombuffer(v, dtype=float) for c, v in cols.items()}  # no copy
    if len(out["timestamp"]) < 2:
        raise InputError(f"{path}: need at least 2 data rows, got {len(out['timestamp'])}"
                         + (f" ({sum(skipped.values())} rows had an empty cell)" if skipped else ""))
    unit = "s" if iso else epoch_unit(out["timestamp"]) if timestamp_unit == "auto" else timestamp_unit
    out["timestamp"] = out["timestamp"] * TIME_UNITS[unit]
    # in time order: an export written newest first (ORDER BY time DESC) has counters that fall in
    # every row, refused as per-interval counts, and with --increments summed backwards
    if np.any(np.diff(out["timestamp"]) < 0):  # (sorted already: no copy)
        order = np.argsort(out["timestamp"], kind="stable")
        out = {c: v[order] for c, v in out.items()}
    if not iso and timestamp_unit == "auto":
        _relative_seconds(path, out["timestamp"])
    return out, {"timestamp_unit": "iso8601" if iso else unit, "rows_skipped": sum(skipped.values()),
                 "rows_skipped_by_column": skipped}


def _bytes_column(path: Path, name: str, v: np.ndarray) -> None:
    """RSS exported in MiB or GiB (a dashboard's unit) read as bytes is a process of a few kB: no
    leak could reach any threshold, and the answer would be a silent "no leak"."""
    med = float(np.median(v))
    if 0 < med < 2**20:
        raise InputError(f"{path}: column {name} must hold bytes, but its median is {med:g} (under 1 MiB): "
                         f"convert it (MiB x 1048576, GiB x 1073741824)")


def _limit_bytes(path: Path, cols: dict[str, np.ndarray], option: float | None) -> float | None:
    """The memory limit: ``--limit-bytes``, else the column's last value (0: none). A limit under the
    RSS it bounds is in another unit (GiB or MiB from a dashboard): read as bytes, the time to the
    limit of any leak is 0, an out-of-memory "now" that is not coming."""
    where = "--limit-bytes"
    if option is None and "limit_bytes" in cols:
        lim = cols["limit_bytes"][np.isfinite(cols["limit_bytes"])]
        option, where = (float(lim[-1]) if len(lim) else None), f"{path}: column limit_bytes"
    med = float(np.median(cols["rss_bytes"]))
    if option is not None and (option < 0 or 0 < option < med):
        raise InputError(f"{where}: the limit {option:g} is under the RSS it bounds (median {med:g} bytes): it must "
                         f"hold bytes (MiB x 1048576, GiB x 1073741824), or 0 for no limit")
    return option


def _counters(path: Path, cols: dict[str, np.ndarray], names: tuple[str, ...], increments: bool,
              part_of: tuple[str, str] | None = None) -> None:
    """Make ``names`` cumulative counters, as the detectors read them (a fall is an engine restart).

    ``increments`` (``--increments``): the file holds per-interval counts (an ``increase()``
    export); they are summed. Without it, a column that falls in more than 2 % of its rows is such
    an export, and is refused: read as a counter, every fall is a restart and the verdict is noise
    (a 0.10 step found 2 h late against a baseline of 0.44 instead of 0.6). ``part_of`` (part,
    whole): a part that grows faster than its whole (accepted over drafted tokens, hits over
    queries) in more than 2 % of the intervals means swapped columns, where no baseline is ever
    learned and nothing is said."""
    if increments:
        for c in names:
            cols[c] = np.cumsum(cols[c])
        return
    n = len(cols["timestamp"])
    allowed = max(3, int(0.02 * n))
    for c in names:
        falls = int((np.diff(cols[c]) < 0).sum())
        if falls > allowed:
            raise InputError(f"{path}: column {c} falls in {falls} of {n} rows: it must be the cumulative counter "
                             f"(a fall is an engine restart); for per-interval counts pass --increments")
    if part_of is not None:
        dp, dw = np.diff(cols[part_of[0]]), np.diff(cols[part_of[1]])
        over = int(((dp > dw) & (dp > 0) & (dw >= 0)).sum())
        if over > allowed:
            raise InputError(f"{path}: {part_of[0]} grows faster than {part_of[1]} in {over} of {n - 1} intervals, "
                             f"which cannot be: are the two columns swapped?")


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
    try:
        if args.kind == "leak":
            cols, read = read_csv(args.file, ("timestamp", "rss_bytes"), ("limit_bytes", "running_requests"), unit)
            _bytes_column(args.file, "rss_bytes", cols["rss_bytes"])
            result = analyze_leak(cols, _limit_bytes(args.file, cols, args.limit_bytes), args.time_scale)
            if getattr(args, "census", None) is not None:
                try:
                    data = census.read_census_file(args.census)
                except ValueError as err:
                    raise InputError(str(err)) from None
                slope = result["slope_mib_per_h"] * 2**20 if result["detected"] else None
                result.update(census.census_summary(data, slope))
        elif args.kind == "prefix":
            cols, read = read_csv(args.file, ("timestamp", "queries_tokens", "hits_tokens"), timestamp_unit=unit)
            _counters(args.file, cols, ("queries_tokens", "hits_tokens"), args.increments,
                      ("hits_tokens", "queries_tokens"))
            result = analyze_prefix(cols, args)
        elif args.kind == "tpot":
            cols, read = read_csv(args.file, ("timestamp", "tpot_sum_seconds", "tpot_count", "running_requests"),
                                  timestamp_unit=unit)
            _counters(args.file, cols, ("tpot_sum_seconds", "tpot_count"), args.increments)
            result = analyze_tpot(cols, args)
        else:
            cols, read = read_csv(args.file, ("timestamp", "draft_tokens", "accepted_tokens"), timestamp_unit=unit)
            _counters(args.file, cols, ("draft_tokens", "accepted_tokens"), args.increments,
                      ("accepted_tokens", "draft_tokens"))
            result = analyze_drift(cols, args)
    except InputError as err:
        print(f"sla-guard analyze: {err}", file=sys.stderr)
        return 2
    result |= read
    print(json.dumps({k: _finite(v) for k, v in result.items()}))
    return 0
