"""`sla-guard analyze leak|drift|tpot` on generated CSVs and on bad input (the real CLI entry point
in a subprocess, as CI and post-mortems run it)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_detect import _ratchet

from sla_guard.detect import synthetic as sy

CLI = [sys.executable, "-m", "sla_guard.cli", "analyze"]


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def _leak_csv(path: Path, rate: float, seed: int, with_limit: bool = True) -> sy.RssCase:
    c = sy.rss_case("sawtooth", seed, leak_mib_h=rate, days=0.75, onset_h=5.0)
    cols = ["timestamp", "rss_bytes"] + (["limit_bytes"] if with_limit else [])
    rows = [",".join(cols)]
    for t, v in zip(c.t, c.v, strict=True):
        rows.append(f"{1.8e9 + t:.3f},{v:.0f}" + (f",{c.limit_bytes:.0f}" if with_limit else ""))
    path.write_text("\n".join(rows) + "\n")
    return c


def test_analyze_leak_detects_48_mib_per_hour(tmp_path):
    c = _leak_csv(tmp_path / "rss.csv", 48.0, seed=3)
    r = _run("leak", tmp_path / "rss.csv")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["detected"] is True
    assert 0 < out["detected_at"] - (1.8e9 + c.onset) <= 2.5 * 3600
    assert 25 < out["slope_mib_per_h"] < 80
    assert out["limit_bytes"] == pytest.approx(8 * 2**30) and out["eta_s"] > 0


def test_analyze_leak_reports_the_hourly_swing_it_took_out(tmp_path):
    """A 12 MiB hourly swing under a 5-min sawtooth, no leak: quiet, and the swing is reported."""
    rng = np.random.default_rng(7)
    t = np.arange(0, 14 * 3600, 30.0)
    v = 6e9 + 90 * 2**20 * ((t / 300.0) % 1.0) + 12 * 2**20 * np.sin(2 * np.pi * t / 3600 + 0.4)
    v += rng.normal(0, 3 * 2**20, t.size)
    (tmp_path / "rss.csv").write_text("timestamp,rss_bytes\n" + "".join(f"{1.8e9 + a:.0f},{b:.0f}\n" for a, b in
                                                                       zip(t, v, strict=True)))
    out = json.loads(_run("leak", tmp_path / "rss.csv").stdout)
    assert out["detected"] is False and out["status_at_end"] == "ok"
    assert out["hourly_swing_mib"] == pytest.approx(12, rel=0.2)
    assert out["excursion_envelope_min"] == 0  # no excursions: the 4 h window read the floor itself


def test_analyze_leak_says_when_it_read_the_levels_excursions_fall_back_to(tmp_path):
    """Survivors of partial collections pile up and fall back at each full collection: the leak
    under them is found from the levels the floor falls back to, and the output says so."""
    t, v = _ratchet(0, leak_mib_h=48.0)
    (tmp_path / "rss.csv").write_text("timestamp,rss_bytes\n" + "".join(f"{1.8e9 + a:.0f},{b:.0f}\n" for a, b in
                                                                       zip(t, v, strict=True)))
    out = json.loads(_run("leak", tmp_path / "rss.csv").stdout)
    assert out["detected"] is True and 12 * 3600 < out["detected_at"] - 1.8e9 < 15.5 * 3600
    assert 20 <= out["excursion_envelope_min"] <= 120


def test_analyze_leak_quiet_on_non_leaking_series(tmp_path):
    _leak_csv(tmp_path / "rss.csv", 0.0, seed=4, with_limit=False)
    r = _run("leak", tmp_path / "rss.csv")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["detected"] is False and out["detected_at"] is None
    assert out["status_at_end"] == "ok"


def test_analyze_leak_with_running_requests_is_load_aware(tmp_path):
    """A non-leaking series whose RSS follows a load swing (legacy generator, seed 5001): from RSS
    alone the swing reads as growth (two alarms); with the running-requests column the load part
    is removed, as the guard does live, and fewer are raised."""
    c = sy.rss_case("load_swings", 5001)
    rows = ["timestamp,rss_bytes,running_requests"] + [
        f"{t:.0f},{v:.0f},{ld:.3f}" for t, v, ld in zip(c.t, c.v, c.load, strict=True)]
    (tmp_path / "rss.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "rss_only.csv").write_text("\n".join(r.rsplit(",", 1)[0] for r in rows) + "\n")
    rss_only = json.loads(_run("leak", tmp_path / "rss_only.csv").stdout)
    aware = json.loads(_run("leak", tmp_path / "rss.csv").stdout)
    assert rss_only["load_aware"] is False and rss_only["alarms"] >= 2
    # issue 16's detector (tuned on bench/detectors/families.py) keeps one alarm here where the
    # previous one had none: 100-300 MiB load bursts are beyond the families' 10-80 MiB coupling
    assert aware["load_aware"] is True and aware["alarms"] < rss_only["alarms"]


def test_analyze_drift_detects_drop_and_iso_timestamps(tmp_path):
    c = sy.rate_case("step", 5, change=-0.10, baseline=0.6, days=0.5, onset_h=4.0)
    from datetime import UTC, datetime

    rows = ["timestamp,draft_tokens,accepted_tokens"]
    for t, n, x in zip(c.t, c.drafts, c.accepted, strict=True):
        rows.append(f"{datetime.fromtimestamp(1.8e9 + t, UTC).isoformat()},{n:.0f},{x:.0f}")
    (tmp_path / "acc.csv").write_text("\n".join(rows) + "\n")
    r = _run("drift", tmp_path / "acc.csv")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["detected"] is True and out["direction"] == "down"
    assert 0 < out["detected_at"] - (1.8e9 + c.onset) <= 600
    assert out["baseline_rate"] == pytest.approx(0.6, abs=0.03)
    assert out["test"] in ("cusum", "window") and out["statistic"] >= out["test_threshold"] > 0


def test_analyze_reads_epoch_milliseconds_as_exports_write_them(tmp_path):
    """Grafana's CSV export and most databases write epoch milliseconds. Read as seconds, 30 s
    samples are 8 h apart and the detector stays silent on a leak; read as milliseconds (their
    size gives them away) the verdict is the one the seconds give, and the unit is reported."""
    c = _leak_csv(tmp_path / "s.csv", 48.0, seed=3)
    rows = (tmp_path / "s.csv").read_text().splitlines()
    ms = [rows[0]] + [f"{float(r.split(',', 1)[0]) * 1000:.0f},{r.split(',', 1)[1]}" for r in rows[1:]]
    (tmp_path / "ms.csv").write_text("\n".join(ms) + "\n")
    sec, milli = (json.loads(_run("leak", tmp_path / f).stdout) for f in ("s.csv", "ms.csv"))
    assert sec["timestamp_unit"] == "s" and milli["timestamp_unit"] == "ms"
    assert milli["detected"] is True and milli["detected_at"] == pytest.approx(sec["detected_at"], abs=1.0)
    assert 0 < milli["detected_at"] - (1.8e9 + c.onset) <= 2.5 * 3600
    # counted from 0 in ms, the size says nothing: read as seconds the samples were 8 h apart and the
    # answer a silent "unknown" with exit 0; the spacing is refused, the option named
    rel = [rows[0]] + [f"{(float(r.split(',', 1)[0]) - 1.8e9) * 1000:.0f},{r.split(',', 1)[1]}" for r in rows[1:]]
    (tmp_path / "rel.csv").write_text("\n".join(rel) + "\n")
    r = _run("leak", tmp_path / "rel.csv")
    assert r.returncode == 2 and r.stdout == "" and "8.33 h apart" in r.stderr, r.stderr
    assert "--timestamp-unit ms" in r.stderr and "--timestamp-unit s" in r.stderr
    out = json.loads(_run("leak", tmp_path / "rel.csv", "--timestamp-unit", "ms").stdout)
    assert out["detected"] is True and out["detected_at"] == pytest.approx(sec["detected_at"] - 1.8e9, abs=1.0)


def test_analyze_refuses_milliseconds_from_0_it_would_read_as_seconds(tmp_path):
    """6 h of acceptance counters 10 s apart, a 0.2 drop at hour 2, the clock in ms from 0: read as
    seconds (exit 0) the series was 6,000 h long and the verdict an upward drift with 6 alarms.
    Refused with the option; with it, and with the same clock in seconds, the drop is found."""
    c = sy.rate_case("step", 5, change=-0.20, baseline=0.6, days=0.25, onset_h=2.0)
    for name, scale in (("ms.csv", 1000), ("s.csv", 1)):
        (tmp_path / name).write_text("timestamp,draft_tokens,accepted_tokens\n" + "".join(
            f"{(t - c.t[0]) * scale:.0f},{n:.0f},{x:.0f}\n" for t, n, x in zip(c.t, c.drafts, c.accepted, strict=True)))
    r = _run("drift", tmp_path / "ms.csv")
    assert r.returncode == 2 and r.stdout == "" and "2.78 h apart" in r.stderr and "5,997.2 h long" in r.stderr
    assert "--timestamp-unit ms" in r.stderr
    for args in (("ms.csv", "--timestamp-unit", "ms"), ("s.csv",)):
        out = json.loads(_run("drift", tmp_path / args[0], *args[1:]).stdout)
        assert out["detected"] is True and out["direction"] == "down" and out["alarms"] == 1
        assert 0 < out["detected_at"] - (c.onset - c.t[0]) <= 600
    # sparse samples really in seconds: the option takes them as they are
    r = _run("drift", tmp_path / "ms.csv", "--timestamp-unit", "s")
    assert r.returncode == 0 and json.loads(r.stdout)["timestamp_unit"] == "s"


def test_analyze_leaves_out_rows_with_an_empty_cell_and_says_how_many(tmp_path):
    """An export leaves a cell empty where a scrape was missed: that row is a hole, counted in the
    output, not a reason to refuse the file; a cell that is not a number still is."""
    _leak_csv(tmp_path / "s.csv", 48.0, seed=3)
    rows = (tmp_path / "s.csv").read_text().splitlines()
    gaps = [rows[0]] + [r if i % 40 else r.split(",")[0] + ",," + r.split(",")[2] for i, r in enumerate(rows[1:])]
    (tmp_path / "gaps.csv").write_text("\n".join(gaps) + "\n")
    full, holes = (json.loads(_run("leak", tmp_path / f).stdout) for f in ("s.csv", "gaps.csv"))
    assert holes["rows_skipped"] == holes["rows_skipped_by_column"]["rss_bytes"] == (len(rows) - 2) // 40 + 1
    assert holes["samples"] == full["samples"] - holes["rows_skipped"] and full["rows_skipped"] == 0
    assert holes["detected"] is True and abs(holes["detected_at"] - full["detected_at"]) <= 1800


def test_analyze_leak_refuses_rss_in_mib_and_says_how_to_convert(tmp_path):
    """RSS exported in a dashboard's MiB, read as bytes, is a process of a few kB in which no leak
    reaches any threshold: a silent "no leak". It is refused with the conversion."""
    (tmp_path / "mib.csv").write_text("timestamp,rss_bytes\n" + "".join(
        f"{1.8e9 + 30 * i:.0f},{6000 + i / 100:.2f}\n" for i in range(2000)))
    r = _run("leak", tmp_path / "mib.csv")
    assert r.returncode == 2 and r.stdout == ""
    assert "rss_bytes must hold bytes" in r.stderr and "1048576" in r.stderr


def test_analyze_leak_reads_rss_in_kib_when_told_and_refuses_it_unsaid(tmp_path):
    """``ps -o rss`` and /proc/<pid>/status's VmRSS give KiB: an 8 GiB worker is 8.4 million, which
    passed the 1 MiB floor as an 8 MB process whose 48 MiB/h leak grew 48 KiB/h: a silent "no leak".
    Under 64 MiB (less than any vLLM process holds) the column is refused, naming --rss-unit; with
    ``--rss-unit KiB`` the leak is found when the bytes' file finds it."""
    _leak_csv(tmp_path / "b.csv", 48.0, seed=3, with_limit=False)
    rows = (tmp_path / "b.csv").read_text().splitlines()
    kib = [rows[0]] + [f"{r.split(',')[0]},{int(r.split(',')[1]) // 1024}" for r in rows[1:]]
    (tmp_path / "kib.csv").write_text("\n".join(kib) + "\n")
    r = _run("leak", tmp_path / "kib.csv")
    assert r.returncode == 2 and r.stdout == "" and "--rss-unit KiB" in r.stderr
    told, b = (json.loads(_run("leak", *a).stdout)
               for a in ((tmp_path / "kib.csv", "--rss-unit", "KiB"), (tmp_path / "b.csv",)))
    assert told["rss_unit"] == "KiB" and b["rss_unit"] == "B"
    assert told["detected"] is b["detected"] is True and abs(told["detected_at"] - b["detected_at"]) <= 600


def test_analyze_drift_reads_microseconds(tmp_path):
    c = sy.rate_case("step", 5, change=-0.10, baseline=0.6, days=0.5, onset_h=4.0)
    rows = ["timestamp,draft_tokens,accepted_tokens"] + [
        f"{(1.8e9 + t) * 1e6:.0f},{n:.0f},{x:.0f}" for t, n, x in zip(c.t, c.drafts, c.accepted, strict=True)]
    (tmp_path / "acc.csv").write_text("\n".join(rows) + "\n")
    out = json.loads(_run("drift", tmp_path / "acc.csv").stdout)
    assert out["timestamp_unit"] == "us" and out["detected"] is True
    assert 0 < out["detected_at"] - (1.8e9 + c.onset) <= 600


def test_analyze_drift_refuses_increments_read_as_counters_and_sums_them_on_request(tmp_path):
    """An increase() export holds per-interval counts. Read as counters, every fall is a restart
    and the verdict is noise (a wrong baseline, the step found hours late); it is refused with the
    option that reads it, which gives the verdict of the counters themselves. Swapped columns
    (accepted over drafted) are refused too: no baseline would ever be learned, nothing said."""
    c = sy.rate_case("step", 5, change=-0.10, baseline=0.6, days=0.5, onset_h=4.0)

    def write(name, drafts, accepted):
        (tmp_path / name).write_text("timestamp,draft_tokens,accepted_tokens\n" + "".join(
            f"{1.8e9 + t:.0f},{n:.0f},{x:.0f}\n" for t, n, x in zip(c.t, drafts, accepted, strict=True)))

    write("cum.csv", c.drafts, c.accepted)
    write("inc.csv", np.diff(c.drafts, prepend=0.0), np.diff(c.accepted, prepend=0.0))
    write("swapped.csv", c.accepted, c.drafts)
    r = _run("drift", tmp_path / "inc.csv")
    assert r.returncode == 2 and "draft_tokens falls in" in r.stderr and "--increments" in r.stderr
    r = _run("drift", tmp_path / "swapped.csv")
    assert r.returncode == 2 and "accepted_tokens grows faster than draft_tokens" in r.stderr
    cum = json.loads(_run("drift", tmp_path / "cum.csv").stdout)
    inc = json.loads(_run("drift", tmp_path / "inc.csv", "--increments").stdout)
    assert cum["detected"] is True and 0 < cum["detected_at"] - (1.8e9 + c.onset) <= 600
    assert inc["detected_at"] == cum["detected_at"] and inc["baseline_rate"] == pytest.approx(cum["baseline_rate"])


def test_analyze_drift_no_change(tmp_path):
    c = sy.rate_case("stationary", 6, days=0.5)
    rows = ["timestamp,draft_tokens,accepted_tokens"] + [
        f"{t:.0f},{n:.0f},{x:.0f}" for t, n, x in zip(c.t, c.drafts, c.accepted, strict=True)]
    (tmp_path / "acc.csv").write_text("\n".join(rows) + "\n")
    out = json.loads(_run("drift", tmp_path / "acc.csv").stdout)
    assert out["detected"] is False and out["baseline_learned"] is True


def _prefix_csv(path, restart_h: float, drop_h: float | None, hours: float = 7.0, seed: int = 3):
    """Prefix-cache counters as a CSV (15 s samples): request-clustered hits around 0.5, an engine
    restart (counters start over, the cache refills with a 10-min time constant), a 0.2 drop."""
    rng = np.random.default_rng(seed)
    rows, q, h = ["timestamp,queries_tokens,hits_tokens"], 0.0, 0.0
    for t in np.arange(15.0, hours * 3600, 15.0):
        if t - 15.0 < restart_h * 3600 <= t:
            q = h = 0.0
        lengths = rng.integers(1000, 8000, rng.poisson(4))
        since = t - restart_h * 3600
        share = 0.555 * (1 - np.exp(-since / 600.0)) if since >= 0 else 0.555
        if drop_h is not None and t >= drop_h * 3600:
            share -= 0.222
        q += float(lengths.sum())
        h += float((0.9 * lengths * (rng.random(len(lengths)) < share)).sum())
        rows.append(f"{t:.0f},{q:.0f},{h:.0f}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_analyze_prefix_waits_out_a_restart_and_finds_a_drop(tmp_path):
    """`analyze prefix` judges as the guard's prefix_hit_drift does: the cold cache after a restart
    is not a drift (with --reset-hold-s 0 it is), a 0.2 drop two hours later is."""
    quiet = json.loads(_run("prefix", _prefix_csv(tmp_path / "a.csv", 3.0, None)).stdout)
    assert quiet["detected"] is False and quiet["intervals_after_restarts_not_judged"] > 0
    cold = json.loads(_run("prefix", tmp_path / "a.csv", "--reset-hold-s", "0").stdout)
    assert cold["detected"] is True and 3 * 3600 <= cold["detected_at"] <= 3.5 * 3600
    r = _run("prefix", _prefix_csv(tmp_path / "b.csv", 3.0, 5.0))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["detected"] is True and out["direction"] == "down" and 5 * 3600 <= out["detected_at"] <= 5.5 * 3600
    assert out["baseline_rate"] == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize(("content", "needle"), [
    ("ts,rss\n1,2\n", "missing column(s) timestamp, rss_bytes"),
    ("time,rss\n1,2\n", "need at least 2 data rows"),  # a time and one series (a Grafana legend): read as it
    ("timestamp,rss_bytes\n1,2\n2,lots\n", "row 3, column rss_bytes: 'lots' is not a number"),
    ("timestamp,rss_bytes\n1,2\n", "need at least 2 data rows"),
    ("timestamp,rss_bytes\nyesterday,2\n2,3\n", "column timestamp"),
])
def test_analyze_bad_input_exit_2_with_clear_message(tmp_path, content, needle):
    (tmp_path / "bad.csv").write_text(content)
    r = _run("leak", tmp_path / "bad.csv")
    assert r.returncode == 2
    assert needle in r.stderr
    assert r.stdout == ""


def test_analyze_drift_bad_option_exit_2(tmp_path):
    (tmp_path / "acc.csv").write_text("timestamp,draft_tokens,accepted_tokens\n1,0,0\n2,10,5\n")
    r = _run("drift", tmp_path / "acc.csv", "--jitter-blocks", "-1")
    assert r.returncode == 2 and "jitter_blocks must be >= 0" in r.stderr and r.stdout == ""


def test_analyze_missing_and_binary_file(tmp_path):
    r = _run("drift", tmp_path / "nope.csv")
    assert r.returncode == 2 and "cannot read" in r.stderr
    (tmp_path / "bin.csv").write_bytes(np.random.default_rng(0).bytes(256))
    r = _run("drift", tmp_path / "bin.csv")
    assert r.returncode == 2 and "bin.csv" in r.stderr


def _tpot_csv(path: Path, slowdown_at_h: float | None, seed: int = 4) -> None:
    """6 h of a decode pool as scraped every 15 s: the TPOT histogram's cumulative _sum and _count
    and the running requests, whose daily swing moves TPOT (a busier batch is slower, no drift)."""
    rng = np.random.default_rng(seed)
    t = np.arange(15.0, 6 * 3600.0, 15.0)
    running = 24 + 12 * np.sin(2 * np.pi * t / 14400)
    k = rng.poisson(8, len(t)).astype(float)
    tpot = (0.010 + 0.0004 * running) * rng.normal(1, 0.02, len(t))
    if slowdown_at_h is not None:
        tpot = tpot * np.where(t >= slowdown_at_h * 3600, 1.3, 1.0)
    rows = ["timestamp,tpot_sum_seconds,tpot_count,running_requests"]
    for ts, s, c, r in zip(t, np.cumsum(k * tpot), np.cumsum(k), running, strict=True):
        rows.append(f"{1.8e9 + ts:.3f},{s:.6f},{c:.0f},{r:.2f}")
    path.write_text("\n".join(rows) + "\n")


def test_analyze_tpot_finds_a_slowdown_at_the_same_batch(tmp_path):
    _tpot_csv(tmp_path / "tpot.csv", slowdown_at_h=4.0)
    r = _run("tpot", tmp_path / "tpot.csv")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["detected"] is True and out["intervals_unknown"] == 0
    assert 0 < out["detected_at"] - (1.8e9 + 4 * 3600) <= 900
    assert out["slowdown"] == pytest.approx(1.3, abs=0.08)


def test_analyze_tpot_quiet_when_only_the_load_moves(tmp_path):
    _tpot_csv(tmp_path / "tpot.csv", slowdown_at_h=None)
    r = _run("tpot", tmp_path / "tpot.csv")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["detected"] is False and out["reference_learned"] is True


def test_analyze_tpot_names_the_missing_column(tmp_path):
    (tmp_path / "x.csv").write_text("timestamp,tpot_sum_seconds,tpot_count\n1,0.1,1\n2,0.2,2\n")
    r = _run("tpot", tmp_path / "x.csv")
    assert r.returncode == 2 and "running_requests" in r.stderr


def test_analyze_drift_reads_a_file_written_newest_first(tmp_path):
    """An export ordered newest first (ORDER BY time DESC): its counters fall in every row. It was
    refused as per-interval counts, and with the --increments it was told to pass, summed backwards
    into a verdict hours off. Read in time order, it gives the verdict of the same rows in order."""
    c = sy.rate_case("step", 5, change=-0.10, baseline=0.6, days=0.5, onset_h=4.0)
    rows = [f"{1.8e9 + t:.0f},{n:.0f},{x:.0f}" for t, n, x in zip(c.t, c.drafts, c.accepted, strict=True)]
    (tmp_path / "asc.csv").write_text("timestamp,draft_tokens,accepted_tokens\n" + "\n".join(rows) + "\n")
    (tmp_path / "desc.csv").write_text("timestamp,draft_tokens,accepted_tokens\n" + "\n".join(rows[::-1]) + "\n")
    asc = json.loads(_run("drift", tmp_path / "asc.csv").stdout)
    r = _run("drift", tmp_path / "desc.csv")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == asc and asc["detected"] is True


def test_analyze_reads_a_byte_order_mark_and_gzip(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark: the header's first name was not
    ``timestamp`` and the file was refused, the message naming the very column it had. A gzip
    export was refused as undecodable bytes. Both are read as the plain file."""
    _leak_csv(tmp_path / "s.csv", 48.0, seed=3)
    text = (tmp_path / "s.csv").read_text()
    (tmp_path / "bom.csv").write_text("\ufeff" + text.replace("\n", "\r\n"), newline="")
    (tmp_path / "s.csv.gz").write_bytes(gzip.compress(text.encode()))
    plain = json.loads(_run("leak", tmp_path / "s.csv").stdout)
    for f in ("bom.csv", "s.csv.gz"):
        r = _run("leak", tmp_path / f)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == plain and plain["detected"] is True


def test_analyze_reads_a_gzip_export_row_by_row_as_the_plain_file(tmp_path):
    """The columns are gathered row by row into doubles (lists of Python floats took 6x the file):
    a gzip export with holes, a blank optional cell and rows newest first gives the plain file's
    answer, and a gzip file cut short is refused, not read as the rows before the cut."""
    _leak_csv(tmp_path / "s.csv", 48.0, seed=3)
    lines = (tmp_path / "s.csv").read_text().splitlines()
    rows = [r + ("," if i % 7 else ",200") for i, r in enumerate(lines[1:])]  # running_requests, mostly blank
    rows = [r if i % 50 else r.split(",")[0] + ",," + r.split(",", 2)[2] for i, r in enumerate(rows)]  # holes
    text = lines[0] + ",running_requests\n" + "\n".join(rows) + "\n"
    (tmp_path / "plain.csv").write_text(text)
    desc = lines[0] + ",running_requests\n" + "\n".join(rows[::-1]) + "\n"
    (tmp_path / "desc.csv.gz").write_bytes(gzip.compress(desc.encode()))
    plain = json.loads(_run("leak", tmp_path / "plain.csv").stdout)
    r = _run("leak", tmp_path / "desc.csv.gz")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == plain and plain["detected"] is True and plain["rows_skipped"] > 0
    (tmp_path / "cut.csv.gz").write_bytes(gzip.compress(desc.encode())[:-2000])
    r = _run("leak", tmp_path / "cut.csv.gz")
    assert r.returncode == 2 and "is not a readable CSV" in r.stderr and r.stdout == ""


def test_analyze_into_a_reader_that_closes_early_ends_quietly(tmp_path):
    """`sla-guard analyze ... | head -c 0`: the JSON line met a closed pipe and Python printed a
    BrokenPipeError traceback; now nothing on stderr and exit 141, as a tool SIGPIPE ended."""
    from test_check_cli import run_into_closed_reader

    _leak_csv(tmp_path / "s.csv", 48.0, seed=3)
    r = run_into_closed_reader([*CLI, "leak", str(tmp_path / "s.csv")])
    assert r.returncode == 141 and r.stderr == "", r.stderr


def test_analyze_leak_refuses_a_limit_in_gib(tmp_path):
    """A limit in a dashboard's GiB, read as bytes, is under the RSS: the leak's time to the limit
    was 0, an out-of-memory "now" that is not coming. It is refused with the conversion; 0 is no limit."""
    c = _leak_csv(tmp_path / "s.csv", 48.0, seed=3)
    rows = (tmp_path / "s.csv").read_text().splitlines()
    gib = [rows[0]] + [r.rsplit(",", 1)[0] + f",{c.limit_bytes / 2**30:.0f}" for r in rows[1:]]
    (tmp_path / "gib.csv").write_text("\n".join(gib) + "\n")
    for args in (("gib.csv",), ("s.csv", "--limit-bytes", "16")):
        r = _run("leak", tmp_path / args[0], *args[1:])
        assert r.returncode == 2 and r.stdout == "", r.stdout
        assert "is under the RSS it bounds" in r.stderr and "GiB x 1073741824" in r.stderr
    out = json.loads(_run("leak", tmp_path / "s.csv", "--limit-bytes", "0").stdout)
    assert out["detected"] is True and out["eta_s"] is None


@pytest.mark.parametrize(("args", "needle"), [
    (["leak", "--time-scale", "0"], "--time-scale: '0': must be a finite number > 0"),  # a traceback
    (["leak", "--time-scale", "nan"], "--time-scale: 'nan'"),  # a traceback
    (["drift", "--interval-s", "0"], "--interval-s: '0'"),  # a traceback
    (["drift", "--tolerance", "-1"], "--tolerance: '-1': must be a finite number >= 0"),  # a traceback
    (["drift", "--arl0-days", "0"], "--arl0-days: '0'"),  # a verdict: false alarms at once
    (["drift", "--warmup-s", "nan"], "--warmup-s: 'nan'"),  # a verdict: nothing learned, nothing said
])
def test_analyze_refuses_options_out_of_range(tmp_path, args, needle):
    _leak_csv(tmp_path / "s.csv", 0.0, seed=3)
    (tmp_path / "acc.csv").write_text("timestamp,draft_tokens,accepted_tokens\n" + "".join(
        f"{1.8e9 + 30 * i},{100 * i},{60 * i}\n" for i in range(200)))
    r = _run(args[0], tmp_path / ("s.csv" if args[0] == "leak" else "acc.csv"), *args[1:])
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


# --- what operators have in a post-mortem: a Prometheus answer saved as JSON, Grafana's CSV export -----------------

T0 = 1.8e9  # 2027-01-15 08:00 UTC


def _tpot_arrays(slowdown_at_h: float | None, seed: int = 4) -> tuple[np.ndarray, ...]:
    """As ``_tpot_csv``: (t, cumulative TPOT sum, count, running requests)."""
    rng = np.random.default_rng(seed)
    t = np.arange(15.0, 6 * 3600.0, 15.0)
    running = np.round(24 + 12 * np.sin(2 * np.pi * t / 14400))
    k = rng.poisson(8, len(t)).astype(float)
    tpot = (0.010 + 0.0004 * running) * rng.normal(1, 0.02, len(t))
    if slowdown_at_h is not None:
        tpot = tpot * np.where(t >= slowdown_at_h * 3600, 1.3, 1.0)
    return t, np.cumsum(k * tpot), np.cumsum(k), running


def _write_csv(path: Path, cols: dict[str, np.ndarray]) -> Path:
    """Our CSV format, every number as Python spells it back exactly (repr)."""
    names = list(cols)
    path.write_text(",".join(names) + "\n" + "".join(
        ",".join(repr(float(cols[n][i])) for n in names) + "\n" for i in range(len(cols[names[0]]))))
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A real Prometheus holding two processes' RSS (pid 1 leaks 48 MiB/h from hour 5), a drop in
    spec-decode acceptance and a TPOT slowdown at the same batch, under vLLM's metric names; its
    answers saved as curl saves them (the body of /api/v1/query_range or /api/v1/query) and as
    ``promtool query range -o json`` prints them, and the same samples in our CSV format."""
    from prometheus_support import backfilled, prometheus_binary

    if prometheus_binary() is None:
        pytest.skip("prometheus binary not installed (scripts/setup.sh --full)")
    d = tmp_path_factory.mktemp("exports")
    leak1 = sy.rss_case("sawtooth", 3, leak_mib_h=48.0, days=0.75, onset_h=5.0)
    leak2 = sy.rss_case("sawtooth", 4, leak_mib_h=0.0, days=0.75, onset_h=5.0)
    rss_t = T0 + leak1.t
    rss = {"1": np.round(leak1.v), "2": np.round(leak2.v)}
    acc = sy.rate_case("step", 5, change=-0.10, baseline=0.6, days=0.5, onset_h=4.0)
    acc_t = T0 + acc.t
    tp_t, tp_sum, tp_count, tp_running = _tpot_arrays(4.0)
    tp_t = T0 + tp_t
    om = []
    for pid, v in rss.items():
        om += [f'process_resident_memory_bytes{{job="vllm",pid="{pid}"}} {x:.0f} {t:.0f}'
               for t, x in zip(rss_t, v, strict=True)]
    lab = 'engine="0",model_name="glm"'
    for name, v in (("vllm:spec_decode_num_draft_tokens_total", acc.drafts),
                    ("vllm:spec_decode_num_accepted_tokens_total", acc.accepted)):
        om += [f"{name}{{{lab}}} {float(x)!r} {t:.0f}" for t, x in zip(acc_t, v, strict=True)]
    for name, v in (("vllm:request_time_per_output_token_seconds_sum", tp_sum),
                    ("vllm:request_time_per_output_token_seconds_count", tp_count),
                    ("vllm:num_requests_running", tp_running)):
        om += [f"{name}{{{lab}}} {float(x)!r} {t:.0f}" for t, x in zip(tp_t, v, strict=True)]
    files: dict[str, Path] = {}
    with backfilled("\n".join(om) + "\n# EOF\n") as prom:

        def save(name: str, query: str, t: np.ndarray, step: float, offset: float = 0.0, api: str = "query_range"):
            params = ({"query": query, "start": t[0] + offset, "end": t[-1], "step": step} if api == "query_range"
                      else {"query": query, "time": t[-1]})
            r = prom.client.get(f"{prom.url}/api/v1/{api}", params=params)
            files[name] = d / name
            files[name].write_bytes(r.content)  # what curl -o writes

        save("rss.json", "process_resident_memory_bytes", rss_t, 30)
        save("rss1.json", 'process_resident_memory_bytes{pid="1"}', rss_t, 30)
        save("rss1_raw.json", 'process_resident_memory_bytes{pid="1"}[1d]', rss_t, 0, api="query")
        save("acc.json", '{__name__=~"vllm:spec_decode_num_(draft|accepted)_tokens_total"}', acc_t, 10)
        save("draft.json", "vllm:spec_decode_num_draft_tokens_total", acc_t, 10)
        save("accepted.json", "vllm:spec_decode_num_accepted_tokens_total", acc_t, 10)
        save("accepted_late.json", "vllm:spec_decode_num_accepted_tokens_total", acc_t, 10, offset=5)
        for part in ("draft", "accepted"):
            save(f"{part}_increase.json", f"increase(vllm:spec_decode_num_{part}_tokens_total[1m])", acc_t, 10)
        tpot = "vllm:request_time_per_output_token_seconds_(sum|count)|vllm:num_requests_running"
        save("tpot.json", f'{{__name__=~"{tpot}"}}', tp_t, 15)
        save("instant.json", "process_resident_memory_bytes", rss_t, 0, api="query")
        save("nothing.json", "no_such_metric", rss_t, 30)
        save("error.json", "rate(process_resident_memory_bytes)", rss_t, 30)
        out = subprocess.run(["promtool", "query", "range", "-o", "json", f"--start={rss_t[0]:.0f}",
                              f"--end={rss_t[-1]:.0f}", "--step=30s", prom.url, "process_resident_memory_bytes"],
                             capture_output=True, text=True, timeout=60, check=True)
        files["rss.promtool.json"] = d / "rss.promtool.json"
        files["rss.promtool.json"].write_text(out.stdout)
    files["rss1.csv"] = _write_csv(d / "rss1.csv", {"timestamp": rss_t, "rss_bytes": rss["1"]})
    files["acc.csv"] = _write_csv(d / "acc.csv", {"timestamp": acc_t, "draft_tokens": acc.drafts,
                                                   "accepted_tokens": acc.accepted})
    files["tpot.csv"] = _write_csv(d / "tpot.csv", {"timestamp": tp_t, "tpot_sum_seconds": tp_sum,
                                                     "tpot_count": tp_count, "running_requests": tp_running})
    return {"files": files, "rss_t": rss_t, "rss": rss, "dir": d}


def _same(out: dict, ref: dict) -> None:
    """The verdict on the same samples: every field but the ones that say how the input was read."""
    drop = ("timestamp_unit", "series")
    assert {k: v for k, v in out.items() if k not in drop} == {k: v for k, v in ref.items() if k not in drop}


def _ok(*args) -> dict:
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _refused(*args, env: dict | None = None) -> str:
    r = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and len(r.stderr) < 1000, r.stderr  # one line, not the file
    return r.stderr


def test_analyze_reads_prometheus_answers_as_the_csv_of_their_samples(exports):
    """A saved /api/v1/query_range answer (the body curl writes), a range selector through
    /api/v1/query and promtool's JSON were refused as a CSV without a header, the whole 100 KB answer
    printed as the header it "got". They now give the verdict of the same samples in our CSV; the
    output names the series it read; the leak, the drop and the slowdown are found."""
    f = exports["files"]
    ref = _ok("leak", f["rss1.csv"])
    assert ref["detected"] is True
    for args in (("rss1.json",), ("rss1_raw.json",), ("rss.json", "--series", "pid=1"),
                 ("rss.promtool.json", "--series", 'pid="1"')):
        out = _ok("leak", f[args[0]], *args[1:])
        _same(out, ref)
        assert out["series"] == {"rss_bytes": 'process_resident_memory_bytes{job="vllm", pid="1"}'}
        assert out["timestamp_unit"] == "s"
    ref = _ok("drift", f["acc.csv"])
    assert ref["detected"] is True and ref["direction"] == "down"
    for files in (("acc.json",), ("draft.json", "accepted.json")):  # one answer holding both, or one file each
        out = _ok("drift", *(f[x] for x in files))
        _same(out, ref)
        assert out["series"]["draft_tokens"].startswith("vllm:spec_decode_num_draft_tokens_total{")
    ref = _ok("tpot", f["tpot.csv"])
    assert ref["detected"] is True and ref["slowdown"] == pytest.approx(1.3, abs=0.08)
    _same(_ok("tpot", f["tpot.json"]), ref)


def test_analyze_names_the_series_to_pick_when_an_answer_holds_several(exports):
    """One series per process: which one is the RSS cannot be guessed. The series are listed and the
    option named with a label that tells them apart; a selector that matches none says so."""
    f = exports["files"]
    for name in ("rss.json", "rss.promtool.json"):
        err = _refused("leak", f[name])
        assert "2 series for rss_bytes" in err and 'pid="1"' in err and 'pid="2"' in err
        assert "--series pid=1" in err
    err = _refused("leak", f["rss.json"], "--series", "pid=3")
    assert "no rss_bytes series matches --series pid=3" in err and 'pid="2"' in err


def test_analyze_refuses_prometheus_answers_it_cannot_read_with_the_fix(exports):
    """Answers that hold no series to read are refused with what to save instead: an error answer,
    an instant query's vector, a query that matched nothing, series whose samples do not line up
    (queried with another start), and series without a metric name (increase() drops it), for
    which drift cannot tell drafted from accepted."""
    f = exports["files"]
    assert "Prometheus answered an error (bad_data" in _refused("leak", f["error.json"])
    assert "'vector' answer" in _refused("leak", f["instant.json"]) and "query_range" in _refused(
        "leak", f["instant.json"])
    assert "holds no series" in _refused("leak", f["nothing.json"])
    err = _refused("drift", f["draft.json"], f["accepted_late.json"])
    assert "shares 0 of its" in err and "same start, end and step" in err
    err = _refused("drift", f["draft_increase.json"], f["accepted_increase.json"])
    assert "no series for draft_tokens" in err and "vllm:spec_decode_num_draft_tokens_total" in err
    err = _refused("leak", f["rss1.json"], "--timestamp-unit", "ms")
    assert "epoch seconds" in err


def _grafana(path: Path, header: list[str], rows: list[list[str]], excel: bool = False) -> Path:
    """A file as Grafana's Inspect > Data > Download CSV writes it (toCSV in @grafana/data): every
    header quoted with its quotes doubled, CRLF, a blank line after the frame; "Download for Excel"
    writes it tab-separated in UTF-16LE with a byte-order mark."""
    sep = "\t" if excel else ","
    text = sep.join('"' + h.replace('"', '""') + '"' for h in header) + "\r\n"
    text += "".join(sep.join(r) + "\r\n" for r in rows) + "\r\n"
    if excel:
        path.write_bytes(("\ufeff" + text).encode("utf-16-le"))
    else:
        path.write_bytes(text.encode())
    return path


def _js(x: float) -> str:
    """A number as JavaScript's toString writes it (whole numbers without ".0")."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def test_analyze_reads_grafana_csv_exports_as_the_csv_of_their_samples(exports, tmp_path):
    """Grafana's panel export was refused for its header ("Time", then each series by name and
    labels or by legend). Raw (epoch ms), formatted (local date-times, here read with the same TZ),
    joined by time with empty cells, a legend as header, and "Download for Excel" (UTF-16, tabs) now
    give the verdict of the same samples in our CSV."""
    import os
    from datetime import datetime
    from zoneinfo import ZoneInfo

    t, rss = exports["rss_t"], exports["rss"]
    ref = _ok("leak", exports["files"]["rss1.csv"])
    h1, h2 = (f'process_resident_memory_bytes{{job="vllm", pid="{p}"}}' for p in "12")
    ms = [f"{x * 1000:.0f}" for x in t]
    raw = _grafana(tmp_path / "raw.csv", ["Time", h1], [[a, _js(b)] for a, b in zip(ms, rss["1"], strict=True)])
    joined = _grafana(tmp_path / "joined.csv", ["Time", h1, h2],
                      [[a, _js(b), "" if i % 50 == 7 else _js(c)]
                       for i, (a, b, c) in enumerate(zip(ms, rss["1"], rss["2"], strict=True))])
    one = [[a, _js(b)] for a, b in zip(ms, rss["1"], strict=True)]
    alias = _grafana(tmp_path / "alias.csv", ["Time", "EngineCore"], one)
    excel = _grafana(tmp_path / "excel.csv", ["Time", h1], one, excel=True)
    zone = "America/New_York"
    local = [datetime.fromtimestamp(x, ZoneInfo(zone)).strftime("%Y-%m-%d %H:%M:%S") for x in t]
    formatted = _grafana(tmp_path / "formatted.csv", ["Time", h1],
                         [[a, _js(b)] for a, b in zip(local, rss["1"], strict=True)])
    for args in ((raw,), (joined, "--series", "pid=1"), (alias,), (excel,)):
        out = _ok("leak", *args)
        _same(out, ref)
        assert out["timestamp_unit"] == "ms" and out["rows_skipped"] == 0
    r = subprocess.run([*CLI, "leak", str(formatted)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TZ": zone})
    assert r.returncode == 0, r.stderr
    _same(json.loads(r.stdout), ref)
    err = _refused("leak", joined)
    assert "2 series for rss_bytes" in err and "--series pid=1" in err
    # the series with the holes: each empty cell a row left out and counted, as in our CSV
    holes = _ok("leak", joined, "--series", "pid=2")
    assert holes["rows_skipped"] == holes["rows_skipped_by_column"]["rss_bytes"] == len(range(7, len(t), 50))
    # the prefix cache's two counters as a panel's two series, found by vLLM's metric names
    rows = [r.split(",") for r in _prefix_csv(tmp_path / "p.csv", 3.0, 5.0).read_text().splitlines()[1:]]
    (tmp_path / "prefix.csv").write_text("timestamp,queries_tokens,hits_tokens\n" + "".join(
        f"{T0 + float(a):.0f},{b},{c}\n" for a, b, c in rows))
    prefix = _grafana(tmp_path / "prefix-grafana.csv", ["Time", 'vllm:prefix_cache_queries_total{engine="0"}',
                                                         'vllm:prefix_cache_hits_total{engine="0"}'],
                      [[f"{(T0 + float(a)) * 1000:.0f}", b, c] for a, b, c in rows])
    ref = _ok("prefix", tmp_path / "prefix.csv")
    assert ref["detected"] is True
    _same(_ok("prefix", prefix), ref)


def test_analyze_refuses_grafana_values_formatted_for_display(exports, tmp_path):
    """With Formatted data on, a unit turns values into text ("6.12 GiB"), refused with the option to
    turn off (a table-format frame, labels in columns, with the Format to set); without a unit
    Grafana rounds to whole numbers, which a TPOT sum cannot be: read, a 30 % slowdown was missed
    (no alarm, exit 0). Both are refused with the fix."""
    t, rss = exports["rss_t"], exports["rss"]
    h1 = 'process_resident_memory_bytes{job="vllm", pid="1"}'
    unit = _grafana(tmp_path / "unit.csv", ["Time", h1], [[f"{x * 1000:.0f}", f"{v / 2**30:.2f} GiB"]
                                                           for x, v in zip(t, rss["1"], strict=True)])
    err = _refused("leak", unit)
    assert "'6.12 GiB' is not a number" in err and "Formatted data off" in err
    table = _grafana(tmp_path / "table.csv", ["Time", "__name__", "job", "pid", "Value"],
                     [[f"{x * 1000:.0f}", "process_resident_memory_bytes", "vllm", "1", _js(v)]
                      for x, v in zip(t, rss["1"], strict=True)])
    assert "the query's Format is Table): set it to Time series" in _refused("leak", table)
    tt, s, n, running = _tpot_arrays(4.0)
    rounded = _write_csv(tmp_path / "rounded.csv", {"timestamp": T0 + tt, "tpot_sum_seconds": np.round(s),
                                                    "tpot_count": n, "running_requests": running})
    err = _refused("tpot", rounded)
    assert "tpot_sum_seconds holds whole numbers only" in err and "Formatted data" in err


def test_analyze_reads_our_columns_in_any_case_and_spacing(tmp_path):
    """``Timestamp, RSS Bytes`` (a spreadsheet's header) was refused as missing timestamp and
    rss_bytes, the very columns it has; names are now compared without case and spacing, in any
    order, with ISO 8601 times at any offset, and give the plain file's verdict."""
    from datetime import UTC, datetime, timedelta, timezone

    c = _leak_csv(tmp_path / "s.csv", 48.0, seed=3, with_limit=False)
    plus = timezone(timedelta(hours=5, minutes=30))
    (tmp_path / "odd.csv").write_text("RSS Bytes , note, Timestamp\n" + "".join(
        f"{v:.0f},x,{datetime.fromtimestamp(1.8e9 + t, plus if i % 2 else UTC).isoformat()}\n"
        for i, (t, v) in enumerate(zip(c.t, c.v, strict=True))))
    plain = _ok("leak", tmp_path / "s.csv")
    out = _ok("leak", tmp_path / "odd.csv")
    _same(out, plain)
    assert out["timestamp_unit"] == "iso8601" and plain["detected"] is True


def test_one_rule_tells_the_unit_of_numeric_timestamps():
    """``sla-guard analyze`` and ``sla-guard replay`` read unnamed numeric times with one rule
    (``sla_guard.epoch``): the unit in which they are all dates of 2000-2100. A span that no unit
    makes dates (numbers counted from 0) has none: analyze then reads seconds (and refuses implausible
    spacing), replay takes the column's convention."""
    from sla_guard.epoch import epoch_unit

    day = 1_780_000_000.0  # 2026
    assert [epoch_unit(day * k, (day + 86_400) * k) for k in (1, 1e3, 1e6, 1e9)] == ["s", "ms", "us", "ns"]
    assert epoch_unit(0.0, 86_400.0) is None and epoch_unit(5.0e5, 9.0e5) is None
    assert epoch_unit(day, 5.0e9) is None  # past 2100 as seconds, before 1970 as milliseconds
