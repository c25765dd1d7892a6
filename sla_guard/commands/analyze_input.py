"""Reading `sla-guard analyze`'s input: series as post-mortems have them, not only our CSV.

A CSV with the kind's columns (any order and case), a Prometheus answer saved as JSON (curl
.../api/v1/query_range, promtool query range -o json) or Grafana's Inspect > Data > Download CSV.
Each column is found by its metric name (the contract's, or vLLM's as the sidecar maps it) or a
legend named as the column. What cannot be read as is raises ``InputError`` naming the file, row
and column and the fix: a silent misreading (ms read as s, a rounded sum) would be a wrong verdict."""

from __future__ import annotations

import array
import contextlib
import csv
import gzip
import itertools
import json
import math
import re
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import numpy as np

from exporters import contract
from exporters.sidecar import MAPPINGS
from sla_guard.epoch import SECONDS_PER, epoch_unit


class InputError(ValueError):
    """Unreadable input; the message names the file, row and column and how to fix it."""



def _ts(text: str) -> tuple[float, bool]:
    """(seconds or a number in the file's unit, whether it was ISO 8601)."""
    try:
        return float(text), False
    except ValueError:
        return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp(), True


# the widest median sample spacing taken as seconds from numbers counted from 0 without --timestamp-unit
MAX_RELATIVE_SPACING_S = 600.0


def _relative_seconds(path: Path | str, t: np.ndarray) -> None:
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
    first name is not ``timestamp``; a UTF-16 one (Grafana's "Download for Excel": UTF-16LE and tabs)
    selects that encoding; a gzip file (an export compressed on its way off a cluster) is read
    through, not refused as undecodable bytes."""
    with path.open("rb") as fh:
        head = fh.read(2)
    if head == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    if head in (b"\xff\xfe", b"\xfe\xff"):
        return path.open(encoding="utf-16", newline="")
    return path.open(encoding="utf-8-sig", newline="")


# the metric names under which a Prometheus answer or a Grafana export holds each column: the
# contract's and vLLM's own (a series or column named as the column itself, e.g. a Grafana legend
# "rss_bytes", is that column too)
def _vllm(metric: contract.Metric, suffix: str = "") -> str:
    """vLLM's name for a contract metric, as the sidecar maps it (its local prefix cache's)."""
    return next(m.vllm for m in MAPPINGS if m.metric is metric and m.fixed in (None, ("cache", "local"))) + suffix


SERIES_NAMES: dict[str, tuple[str, ...]] = {
    "rss_bytes": (contract.PROCESS_RSS.series(), "process_resident_memory_bytes"),
    "running_requests": (contract.REQUESTS_RUNNING.series(), _vllm(contract.REQUESTS_RUNNING)),
    "draft_tokens": (contract.SPEC_DRAFT_TOKENS.series(), _vllm(contract.SPEC_DRAFT_TOKENS, "_total")),
    "accepted_tokens": (contract.SPEC_ACCEPTED_TOKENS.series(), _vllm(contract.SPEC_ACCEPTED_TOKENS, "_total")),
    "queries_tokens": (contract.PREFIX_CACHE_QUERIES.series(), _vllm(contract.PREFIX_CACHE_QUERIES, "_total")),
    "hits_tokens": (contract.PREFIX_CACHE_HITS.series(), _vllm(contract.PREFIX_CACHE_HITS, "_total")),
    "tpot_sum_seconds": (contract.REQUEST_TPOT.series("_sum"), _vllm(contract.REQUEST_TPOT, "_sum")),
    "tpot_count": (contract.REQUEST_TPOT.series("_count"), _vllm(contract.REQUEST_TPOT, "_count")),
}
# (required, optional) columns of each kind
COLUMNS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "leak": (("timestamp", "rss_bytes"), ("limit_bytes", "running_requests")),
    "drift": (("timestamp", "draft_tokens", "accepted_tokens"), ()),
    "prefix": (("timestamp", "queries_tokens", "hits_tokens"), ()),
    "tpot": (("timestamp", "tpot_sum_seconds", "tpot_count", "running_requests"), ()),
}
_QUOTED = re.compile(r'"(?:[^"]|"")*"')
_SERIES_HEADER = re.compile(r"^([^{]*)\{(.*)\}$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,}"]*))')
_FORMATTED = re.compile(r"^[-+]?[\d.,]+\s*[^\d\s.,]+")  # "6.12 GiB", "35 ms": a value formatted for display


class Series(NamedTuple):
    """One series of a Prometheus answer or a Grafana export, its times in epoch seconds."""

    name: str  # the metric name, or a column's header when it has no labels (a legend)
    labels: dict[str, str]
    t: np.ndarray
    v: np.ndarray
    grid: np.ndarray  # every time of its file (a Grafana export's rows): where it has no sample is a hole

    def show(self) -> str:
        labels = ", ".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()) if k != "__name__")
        text = f"{self.name}{{{labels}}}" if labels else self.name or "{}"
        return text if len(text) <= 120 else text[:117] + "..."


def _norm(name: str) -> str:
    """A column name as compared: case, and spaces or hyphens around and inside it, do not count."""
    return re.sub(r"[\s-]+", "_", name.strip()).lower()


def _csv_reader(first: str, fh):
    """A csv reader over the first line and the rest of ``fh``, with its delimiter: an Excel ``sep=``
    line's, else the one of comma, tab and semicolon found most often outside quotes in the header
    (Grafana's "Download for Excel" writes tabs, a spreadsheet in a comma-decimal locale semicolons)."""
    if first.lower().startswith("sep=") and len(first.rstrip("\r\n")) == 5:
        delimiter, first = first[4], fh.readline()
    else:
        bare = _QUOTED.sub("", first)
        delimiter = max(",\t;", key=bare.count)  # on a tie the comma
    return csv.reader(itertools.chain([first], fh), delimiter=delimiter)


def _cell_error(where: str, row_no: int, column: str, raw: str, what: str = "a number") -> InputError:
    hint = (": values formatted for display (Grafana's Inspect > Data > Data options > Formatted data): "
            "download it again with Formatted data off" if _FORMATTED.match(raw) else "")
    return InputError(f"{where}: row {row_no}, column {column}: {raw!r} is not {what}{hint}")


def _seconds(where: str, raw: np.ndarray, iso: bool, timestamp_unit: str) -> tuple[np.ndarray, str]:
    """Times in epoch seconds, and the unit they were read in (``sla_guard.epoch``; seconds where no
    unit makes them dates: numbers counted from 0, checked below)."""
    unit = "s" if iso else timestamp_unit
    if not iso and timestamp_unit == "auto":
        unit = (epoch_unit(float(np.nanmin(raw)), float(np.nanmax(raw))) if np.isfinite(raw).any() else None) or "s"
    t = raw * SECONDS_PER[unit]
    if not iso and timestamp_unit == "auto":
        _relative_seconds(where, np.sort(t))
    return t, "iso8601" if iso else unit


def read_csv(path: Path, required: tuple[str, ...], optional: tuple[str, ...] = (),
             timestamp_unit: str = "auto", reader=None) -> tuple[dict[str, np.ndarray], dict]:
    """Numeric columns of a CSV with a header (names in any case and order; timestamps as unix
    seconds, milliseconds, micro- or nanoseconds, or ISO 8601), and what reading them did: the
    timestamp unit and the rows left out because a cell was empty (a missed scrape in an export; the
    detectors treat it as a hole). A cell that is not a number is an error: that is a wrong file, not a
    gap. The file (gzip too) is read row by row into 8-byte doubles: in lists of Python floats a 115
    MiB export took 675 MiB."""
    skipped: dict[str, int] = {}
    try:
        with contextlib.ExitStack() as stack:
            if reader is None:
                fh = stack.enter_context(_open_text(path))
                reader = _csv_reader(fh.readline(), fh)
            header = next(reader, [])
            names = [_norm(h) for h in header]
            missing = [col for col in required if col not in names]
            if missing:
                got = ",".join(h.strip() for h in header) or "no header"
                raise InputError(f"{path}: missing column(s) {', '.join(missing)}; the header must contain "
                                 f"{','.join(required)}" + (f" (optional: {','.join(optional)})" if optional else "")
                                 + f", got {got if len(got) <= 200 else got[:197] + '...'}")
            index = {col: names.index(col) for col in (*required, *optional) if col in names}
            cols: dict[str, array.array] = {col: array.array("d") for col in index}
            iso, row_no = False, 1
            for row in reader:
                if not row:
                    continue
                row_no += 1
                cells = {col: (row[i] if i < len(row) else "").strip() for col, i in index.items()}
                empty = [col for col in required if not cells[col]]
                if empty:
                    for col in empty:
                        skipped[col] = skipped.get(col, 0) + 1
                    continue
                for col, raw in cells.items():
                    if col in optional and raw == "":
                        cols[col].append(math.nan)
                        continue
                    try:
                        if col == "timestamp":
                            val, was_iso = _ts(raw)
                            iso = iso or was_iso
                        else:
                            val = float(raw)
                    except ValueError:
                        raise _cell_error(str(path), row_no, col, raw, "a number or ISO 8601 time"
                                          if col == "timestamp" else "a number") from None
                    if not math.isfinite(val):
                        raise InputError(f"{path}: row {row_no}, column {col}: {raw!r} is not finite")
                    cols[col].append(val)
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror or err}") from None
    except (UnicodeError, csv.Error, EOFError) as err:  # EOFError: a truncated gzip file
        raise InputError(f"{path} is not a readable CSV: {err}") from None
    out = {col: np.frombuffer(v, dtype=float) for col, v in cols.items()}  # no copy
    if len(out["timestamp"]) < 2:
        raise InputError(f"{path}: need at least 2 data rows, got {len(out['timestamp'])}"
                         + (f" ({sum(skipped.values())} rows had an empty cell)" if skipped else ""))
    # in time order: an export written newest first (ORDER BY time DESC) has counters that fall in
    # every row, refused as per-interval counts, and with --increments summed backwards
    out["timestamp"], unit = _seconds(str(path), out["timestamp"], iso, timestamp_unit)
    if np.any(np.diff(out["timestamp"]) < 0):  # (sorted already: no copy)
        order = np.argsort(out["timestamp"], kind="stable")
        out = {col: v[order] for col, v in out.items()}
    return out, {"timestamp_unit": unit, "rows_skipped": sum(skipped.values()), "rows_skipped_by_column": skipped}


def _csv_series(path: Path, header: list[str], reader, timestamp_unit: str) -> tuple[list[Series], str]:
    """The series of a CSV whose first column is the time and each other one a series: Grafana's
    Inspect > Data > Download CSV (``"Time"``, then each series named by its legend or as
    ``name{label="value", ...}``; series joined by time leave a cell empty where one has no sample;
    epoch milliseconds, or local date-times with Formatted data on)."""
    heads = [h.strip() for h in header[1:]]
    t, vals = array.array("d"), [array.array("d") for _ in heads]
    iso, row_no = False, 1
    for row in reader:
        if not row:
            continue
        row_no += 1
        raw = row[0].strip()
        try:
            val, was_iso = _ts(raw)
        except ValueError:
            raise _cell_error(str(path), row_no, header[0].strip(), raw, "a number or ISO 8601 time") from None
        iso = iso or was_iso
        t.append(val)
        for j, head in enumerate(heads):
            cell = row[j + 1].strip() if j + 1 < len(row) else ""
            try:
                x = float(cell) if cell else math.nan
            except ValueError:
                err = _cell_error(str(path), row_no, head, cell)
                if not _FORMATTED.match(cell):  # text: a label column of a table-format frame
                    err = InputError(f"{err}: a column of labels (the query's Format is Table): set it to Time "
                                     f"series and download again, or give a CSV with our columns")
                raise err from None
            if cell and not math.isfinite(x):
                raise InputError(f"{path}: row {row_no}, column {head}: {cell!r} is not finite")
            vals[j].append(x)
    if len(t) < 2:
        raise InputError(f"{path}: need at least 2 data rows, got {len(t)}")
    secs, unit = _seconds(str(path), np.frombuffer(t, dtype=float), iso, timestamp_unit)
    out = []
    for head, v in zip(heads, vals, strict=True):
        v = np.frombuffer(v, dtype=float)
        m = _SERIES_HEADER.match(head)
        name, labels = (m.group(1).strip(), {k: a or b for k, a, b in _LABEL.findall(m.group(2))}) if m else (head, {})
        if m and name:
            labels["__name__"] = name
        ok = ~np.isnan(v)
        out.append(Series(name, labels, secs[ok], v[ok], secs))
    return out, unit


def _prometheus_series(path: Path, text: str) -> list[Series]:
    """The series of a Prometheus HTTP API answer saved to a file (``curl .../api/v1/query_range``, or
    a range selector such as ``metric[12h]`` through ``/api/v1/query``; Thanos, Mimir and
    VictoriaMetrics answer alike) or of ``promtool query range -o json`` (the bare ``result``
    list). Its times are epoch seconds, as the API defines them."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise InputError(f"{path}: not valid JSON ({err})") from None
    result = doc
    if isinstance(doc, dict):
        if doc.get("status") == "error":
            raise InputError(f"{path}: Prometheus answered an error ({doc.get('errorType')}: "
                             f"{str(doc.get('error'))[:200]}): fix the query and save its answer again")
        data = doc.get("data")
        if not isinstance(data, dict) or "result" not in data:
            raise InputError(f"{path}: JSON that is no Prometheus answer (no data.result): save the body of "
                             f"/api/v1/query_range, or give a CSV")
        result = data["result"]
        if data.get("resultType") != "matrix":
            raise InputError(f"{path}: a Prometheus '{data.get('resultType')}' answer holds one sample per series; "
                             f"the detectors need hours of them: save /api/v1/query_range?query=...&start=...&end="
                             f"...&step=... (or a range selector such as metric[12h] through /api/v1/query)")
    if not isinstance(result, list) or not all(isinstance(s, dict) and isinstance(s.get("metric"), dict)
                                               for s in result):
        raise InputError(f"{path}: JSON that is no Prometheus answer (no list of series with 'metric'): save the body "
                         f"of /api/v1/query_range, or the output of promtool query range -o json")
    out = []
    for s in result:
        labels = {str(k): str(v) for k, v in s["metric"].items()}
        shown = Series(labels.get("__name__", ""), labels, np.empty(0), np.empty(0), np.empty(0)).show()
        if "values" not in s:
            raise InputError(f"{path}: series {shown} has no 'values' (" + (
                "an instant query's answer: save /api/v1/query_range" if "value" in s else
                "a native histogram: query its _sum and _count, or a float series") + ")")
        try:
            tv = np.array([(float(a), float(b)) for a, b in s["values"]], dtype=float).reshape(-1, 2)
        except (TypeError, ValueError):
            raise InputError(f"{path}: series {shown}: a sample is not [time, \"value\"]") from None
        bad = ~np.isfinite(tv).all(axis=1)
        if bad.any():
            i = int(np.argmax(bad))
            raise InputError(f"{path}: series {shown} at {s['values'][i][0]}: {s['values'][i][1]!r} is not finite")
        out.append(Series(labels.get("__name__", ""), labels, tv[:, 0], tv[:, 1], tv[:, 0]))
    if not out:
        raise InputError(f"{path}: the answer holds no series: the query matched nothing in its time range")
    return out


def _selector(text: str) -> list[tuple[str, str]]:
    return [(k, a or b.strip()) for k, a, b in _LABEL.findall(text.strip().strip("{}"))]


def _choose(where: str, found: list[Series], required: tuple[str, ...], optional: tuple[str, ...],
            selectors: list[str]) -> dict[str, Series]:
    """The one series each column is read from: by its metric name (``SERIES_NAMES``) or a name that
    is the column's; for ``leak``, whose one column needs none, the file's one series whatever its
    name. Where a column has several (one per process, engine or pod), ``--series`` picks; where it
    picks none or still several, the series are listed and the option named."""
    roles = [col for col in (*required, *optional) if col != "timestamp"]
    by_role: dict[str, list[Series]] = {col: [] for col in roles}
    unnamed = []  # a name no column has (a legend, none): the one column of leak when nothing else is
    for s in found:
        role = next((col for col, names in SERIES_NAMES.items() if _norm(s.name) == col or s.name in names),
                    _norm(s.name) if _norm(s.name) in roles else None)
        if role in by_role:
            by_role[role].append(s)
        elif role is None:
            unnamed.append(s)
    main = [col for col in required if col != "timestamp"]
    if len(main) == 1 and not by_role[main[0]]:
        by_role[main[0]] = unnamed
    picks = [(sel, _selector(sel)) for sel in selectors]
    chosen = {}
    for col in roles:
        cands = by_role[col]
        # a selector judges the series that have its labels (a header selector: the one of that name);
        # a column none of whose series it can judge (a limit without a pid label) is left as it is
        judged = [(sel, p) for sel, p in picks
                  if any((all(k in s.labels for k, _ in p) if p else s.name == sel.strip()) for s in cands)]
        if judged:
            kept = [s for s in cands if any((all(s.labels.get(k) == v for k, v in p) if p else s.name == sel.strip())
                                            for sel, p in judged)]
            if not kept:
                raise InputError(f"{where}: no {col} series matches --series {' / '.join(sel for sel, _ in judged)}; "
                                 f"the {col} series are {_listing(cands)}")
            cands = kept
        if len(cands) > 1:
            raise InputError(f"{where}: {len(cands)} series for {col} ({_listing(cands)}): pick one with --series "
                             f"{_example(cands)}")
        if cands:
            chosen[col] = cands[0]
        elif col in required:
            names = " or ".join(SERIES_NAMES.get(col, ()))
            raise InputError(f"{where}: no series for {col} among the {len(found)} found ({_listing(found)}): "
                             f"{col} is read from a series "
                             + (f"named {names}, or " if names else "")
                             + f"a column or legend named {col} (or give a CSV with columns {','.join(required)})")
    return chosen


def _listing(series: list[Series]) -> str:
    return ", ".join(s.show() for s in series[:4]) + (f" and {len(series) - 4} more" if len(series) > 4 else "")


def _example(series: list[Series]) -> str:
    """A selector that tells the series apart: a label whose values all differ, else a header."""
    keys = sorted({k for s in series for k in s.labels} - {"__name__"})
    for k in keys:
        if len({s.labels.get(k) for s in series}) == len(series) and k in series[0].labels:
            return f"{k}={series[0].labels[k]}"
    return f"'{series[0].name}'" if len({s.name for s in series}) == len(series) else "LABEL=VALUE"


def read_series(paths: list[Path], required: tuple[str, ...], optional: tuple[str, ...] = (),
                timestamp_unit: str = "auto", selectors: list[str] | None = None
                ) -> tuple[dict[str, np.ndarray], dict]:
    """The columns from what the files hold: a CSV with our column names, read by ``read_csv``, or
    series (Prometheus JSON, Grafana's CSV export, several files together) joined by their
    timestamps, which the output names (``series``). A time where a required series has no sample is
    a row left out and counted, as an empty cell is; series whose samples do not line up (scraped
    apart, queried with another step) are refused rather than joined into holes."""
    where = ", ".join(map(str, paths))
    found: list[Series] = []
    units = []
    for path in paths:
        try:
            with _open_text(path) as fh:
                first = fh.readline()
                if first.lstrip().startswith(("{", "[")):
                    if timestamp_unit not in ("auto", "s"):
                        raise InputError(f"{path}: Prometheus answers hold epoch seconds: leave out --timestamp-unit")
                    found += _prometheus_series(path, first + fh.read())
                    units.append("s")
                    continue
                reader = _csv_reader(first, fh)
                header = next(reader, [])
                names = [_norm(h) for h in header]
                if all(col in names for col in required) or not names or names[0] not in ("time", "timestamp"):
                    if len(paths) > 1:
                        raise InputError(f"{path}: a CSV with our columns is read alone; several files are joined "
                                         f"only as series (Prometheus JSON, Grafana's CSV export)")
                    return read_csv(path, required, optional, timestamp_unit,
                                    itertools.chain([header], reader))
                series, unit = _csv_series(path, header, reader, timestamp_unit)
                found += series
                units.append(unit)
        except OSError as err:
            raise InputError(f"cannot read {path}: {err.strerror or err}") from None
        except (UnicodeError, csv.Error, EOFError) as err:
            raise InputError(f"{path} is not a readable CSV or JSON file: {err}") from None
    chosen = _choose(where, found, required, optional, selectors or [])
    t = np.unique(np.concatenate([s.grid for s in chosen.values()]))
    cols, skipped = {"timestamp": t}, {}
    keep = np.ones(len(t), dtype=bool)
    for col, s in chosen.items():
        st, first_at = np.unique(s.t, return_index=True)
        v = np.full(len(t), math.nan)
        v[np.searchsorted(t, st)] = s.v[first_at]
        cols[col] = v
        if col in required and np.isnan(v).any():
            skipped[col] = int(np.isnan(v).sum())
            keep &= ~np.isnan(v)
    cols = {col: v[keep] for col, v in cols.items()}
    kept = cols["timestamp"]
    for col, s in chosen.items():  # samples that do not line up: most times of one miss in the others
        inside = int(((s.t >= kept[0]) & (s.t <= kept[-1])).sum()) if len(kept) else len(s.t)
        shared = int(np.isfinite(cols[col]).sum())
        if inside >= 2 and shared < 0.5 * inside:
            raise InputError(f"{where}: series {s.show()} shares {shared} of its {inside} sample times with the "
                             f"others: query them together (one query_range, same start, end and step; or a "
                             f"Grafana panel's series joined by time) so their samples line up")
    if len(cols["timestamp"]) < 2:
        raise InputError(f"{where}: need at least 2 samples at times every series has, got {len(cols['timestamp'])}")
    return cols, {"timestamp_unit": "+".join(sorted(set(units))), "rows_skipped": sum(skipped.values()),
                  "rows_skipped_by_column": skipped, "series": {col: s.show() for col, s in chosen.items()}}


def check_not_rounded(path: Path | str, v: np.ndarray) -> None:
    """A TPOT sum that is a whole number at every sample was rounded for display (Grafana's Formatted
    data writes 1234.567 s as 1235): what it grows by in a scrape is a fraction of a second, and the
    verdict was made of the rounding (a 30 % slowdown missed, 102 intervals unknown)."""
    if len(v) >= 10 and np.ptp(v) > 0 and np.all(v == np.round(v)):
        raise InputError(f"{path}: tpot_sum_seconds holds whole numbers only: rounded for display (Grafana's "
                         f"Formatted data); export it unrounded (Formatted data off, or the Prometheus answer)")


# bytes per unit of an RSS column (``--rss-unit``)
RSS_UNITS = {"B": 1.0, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30}
# no vLLM engine or worker process holds less (torch alone maps hundreds of MiB): a median under it
# is RSS in another unit read as bytes
MIN_PROCESS_RSS = 64 * 2**20


def rss_in_bytes(path: Path | str, name: str, v: np.ndarray, unit: str | None) -> np.ndarray:
    """The RSS column in bytes. ``unit`` (``--rss-unit``) converts; without it the column must read as
    bytes of a plausible engine process. RSS in KiB (``ps -o rss``, ``/proc/<pid>/status``'s VmRSS),
    MiB or GiB (a dashboard's unit) read as bytes is a process of a few MB or kB, in which no leak
    reaches any threshold: a silent "no leak"."""
    if unit is not None:
        return v * RSS_UNITS[unit]
    med = float(np.median(v))
    if 0 < med < MIN_PROCESS_RSS:
        raise InputError(f"{path}: column {name} must hold bytes, but its median is {med:g} (under 64 MiB, less "
                         f"than any vLLM process holds): pass --rss-unit KiB for ps -o rss or /proc/<pid>/status "
                         f"VmRSS, --rss-unit MiB or GiB for a dashboard's export (MiB x 1048576, GiB x 1073741824), "
                         f"or --rss-unit B if these are bytes")
    return v


def memory_limit(path: Path | str, cols: dict[str, np.ndarray], option: float | None) -> float | None:
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


def check_counters(path: Path | str, cols: dict[str, np.ndarray], names: tuple[str, ...], increments: bool,
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

