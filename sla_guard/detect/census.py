"""Object-census results on the leak findings: which Python containers grow in a leaking process.

The plugin's census (engine_hooks/census.py) exports, per vLLM process, its top growing
containers (``slaguard_census_container_*{owner}``). Each tick ``CensusEvaluator`` reads them
through the ``MetricsView``, matches them to the open ``leak`` findings of the same process
(instance, model, pool, engine, process) and writes them into that finding's details with the
same key (``FindingsBook.raise_``): the top owner path, its growth per hour and estimated MiB/h,
the share of the finding's RSS slope the growers explain and the unexplained remainder (native
memory: allocator, C extensions, torch). The leak evaluator rewrites the finding's details when
its verdict moves; this evaluator runs after it in the same tick and puts the census back.

While a leak finding is open it can also open a census request (``request_file``, a path shared
with the engines, see docs/census.md) so the engines walk every ``fast_interval_s`` instead of
every 10 minutes.

``census_summary`` and ``attribute`` are pure and shared with ``sla-guard analyze leak --census``.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from exporters import contract as c
from sla_guard.detect.findings import FindingsBook
from sla_guard.model import MetricsView, page_map

MIB = 2**20
IDENTITY = ("instance", "model", "pool", "engine", "process")
CENSUS_KEYS = ("census_top_owner", "census_top_growth_per_h", "census_top_mib_per_h", "census_top_length",
               "census_explained_ratio", "census_unexplained_mib_per_h", "census_growers")


def attribute(growers: Sequence[Mapping], rss_bytes_per_h: float | None, top_text: int = 3) -> dict:
    """Finding details from census growers (dicts with owner, length, growth_per_h, bytes_per_h,
    largest bytes first) against an RSS slope: the top owner, the share of the slope the growers'
    estimated bytes explain, and the unexplained remainder (None without a positive slope)."""
    if not growers:
        return {}
    gs = sorted(growers, key=lambda g: float(g.get("bytes_per_h") or 0), reverse=True)
    top = gs[0]
    got = sum(max(float(g.get("bytes_per_h") or 0), 0.0) for g in gs)
    share = rest = None
    if rss_bytes_per_h is not None and math.isfinite(rss_bytes_per_h) and rss_bytes_per_h > 0:
        share = round(got / rss_bytes_per_h, 4)
        rest = round((rss_bytes_per_h - got) / MIB, 3)
    text = "; ".join(f"{g['owner']} +{float(g.get('growth_per_h') or 0):.0f}/h "
                     f"~{float(g.get('bytes_per_h') or 0) / MIB:.2f} MiB/h" for g in gs[:top_text])
    return {"census_top_owner": str(top["owner"]),
            "census_top_growth_per_h": round(float(top.get("growth_per_h") or 0), 3),
            "census_top_mib_per_h": round(float(top.get("bytes_per_h") or 0) / MIB, 4),
            "census_top_length": float(top.get("length") or 0), "census_explained_ratio": share,
            "census_unexplained_mib_per_h": rest, "census_growers": text}


def read_census_file(path: Path) -> dict:
    """A census file (``census-<pid>.json`` from the plugin's run directory); ValueError if unreadable."""
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"{path} is not a census file (JSON): {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("growers"), list):
        raise ValueError(f"{path} is not a census file: no 'growers' list")
    return data


def census_summary(data: Mapping, rss_bytes_per_h: float | None) -> dict:
    """``sla-guard analyze leak --census``: the file's growers against the analysed RSS slope
    (the file's own RSS slope when none is given)."""
    growers = [g for g in data.get("growers") or [] if isinstance(g, Mapping) and g.get("owner")]
    slope = rss_bytes_per_h if rss_bytes_per_h and rss_bytes_per_h > 0 else data.get("rss_bytes_per_h")
    out = attribute(growers, slope)
    out["census_growers"] = [{k: g.get(k) for k in ("owner", "length", "growth_per_h", "bytes_per_h", "walks")}
                             for g in growers]
    out["census_pid"] = data.get("pid")
    out["census_at"] = data.get("ts")
    out["census_rss_slope_source"] = "analysis" if rss_bytes_per_h and rss_bytes_per_h > 0 else "census_file"
    return out


class CensusEvaluator:
    """Census metrics -> details of the open leak findings (run it after the leak evaluator)."""

    name = "census"

    def __init__(self, book: FindingsBook, *, request_file: str | os.PathLike | None = None,
                 fast_interval_s: float = 60.0, request_ttl_s: float = 900.0) -> None:
        self.book = book
        self.request_file = Path(request_file) if request_file else None
        self.fast_interval_s, self.request_ttl_s = fast_interval_s, request_ttl_s
        self.by_process: dict[tuple[str, ...], list[dict]] = {}
        self._requested_at = -math.inf
        self.request_errors = 0

    def _growers(self, view: MetricsView, now: float) -> dict[tuple[str, ...], list[dict]]:
        rows: dict[tuple[str, ...], dict[str, dict]] = defaultdict(dict)
        for metric, field, scale in ((c.CENSUS_CONTAINER_BYTES, "bytes_per_h", 3600.0),
                                     (c.CENSUS_CONTAINER_GROWTH, "growth_per_h", 3600.0),
                                     (c.CENSUS_CONTAINER_LENGTH, "length", 1.0)):
            for labels, v in view.instant(metric.name, {}, now).items():
                lab = dict(labels)
                owner = lab.get("owner", "")
                if not owner or not math.isfinite(v):
                    continue
                key = tuple(lab.get(k, "") for k in IDENTITY)
                rows[key].setdefault(owner, {"owner": owner})[field] = v * scale
        return {k: sorted(v.values(), key=lambda g: g.get("bytes_per_h", 0.0), reverse=True) for k, v in rows.items()}

    def evaluate(self, view: MetricsView, now: float) -> None:
        self.by_process = self._growers(view, now)
        leaks = [f for f in self.book.open_findings() if f.detector == "leak"]
        for f in leaks:
            growers = self.by_process.get(tuple(f.labels.get(k, "") for k in IDENTITY))
            if not growers:
                continue
            slope = f.details.get("slope_bytes_per_s")
            details = attribute(growers, float(slope) * 3600.0 if isinstance(slope, int | float) else None)
            if all(f.details.get(k) == details.get(k) for k in CENSUS_KEYS):
                continue
            self.book.raise_(f.detector, f.key, f.severity, f.summary, f.labels, {**f.details, **details}, now)
        if leaks and self.request_file is not None and now - self._requested_at >= self.fast_interval_s:
            self._request(now)

    def _request(self, now: float) -> None:
        """Ask the engines for frequent census walks while a leak is open (the engines poll it)."""
        self._requested_at = now
        try:
            tmp = self.request_file.with_name(f".{self.request_file.name}.guard.tmp")
            tmp.write_text(json.dumps({"interval_s": self.fast_interval_s, "until": now + self.request_ttl_s}))
            os.replace(tmp, self.request_file)
        except OSError:
            self.request_errors += 1

    paged = True  # snapshot(limit, after): one entry per process (``sla_guard.model.page_map``)

    def snapshot(self, limit: int | None = None, after: str | None = None) -> dict:
        procs, extra = page_map({"/".join(k): g for k, g in list(self.by_process.items())}, limit, after, "processes")
        return {"processes": {k: g[:5] for k, g in procs.items()}, **extra}
