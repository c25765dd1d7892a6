"""Evaluators that bind the detectors to the guard: each tick they pull series from a
``MetricsView``, feed the pure detectors, keep findings in a ``FindingsBook`` and export the
guard's detector metrics. ``router(book)`` serves ``GET /v1/findings``.

Configuration lives under ``detectors:`` in the guard's YAML (``GuardConfig.detectors``, a
``sla_guard.settings.detectors.DetectorsConfig``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import zlib
from collections import defaultdict
from typing import Annotated

import numpy as np
from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import JSONResponse

from exporters import contract as c
from sla_guard.detect import drift, leak
from sla_guard.detect.findings import FindingsBook, finding_json
from sla_guard.ingest.source import UP
from sla_guard.model import PAGE_MAX, MetricsView, page, page_map
from sla_guard.settings.detectors import DetectorsConfig, LeakConfig, RateConfig, TpotConfig

HOUR = 3600.0
log = logging.getLogger(__name__)


def host_memory_bytes() -> float | None:
    try:
        import psutil

        return float(psutil.virtual_memory().total)
    except Exception:
        return None


def _lab(labels, name: str) -> str:
    return dict(labels).get(name, "")


def failed_queries(view: MetricsView) -> int:
    """How many of ``view``'s queries have failed so far (a Prometheus source; the guard's own
    store never fails): "no series" from a failed query is unknown data, never "gone"."""
    return getattr(view, "failed_queries", 0)


def reads_subsets(view: MetricsView) -> bool:
    """Whether ``view`` reads some of a metric's series without the others (the guard's own store:
    ``last_times`` and ``range(..., where=)``). A Prometheus source keeps what its ``range`` read
    and re-reads only the last minutes of each selector: it is read whole, one selector per metric
    (a selector per process would be a read each, and a first read of 12 h each)."""
    return callable(getattr(view, "last_times", None))


# --- leak ------------------------------------------------------------------------------------

ENGINE_KEYS = ("model", "pool", "engine", "instance")  # one engine: its load belongs to its processes


class LeakEvaluator:
    """RSS of every vLLM process (PROCESS_RSS) -> leak findings, one per process series."""

    name = "leak"

    def __init__(self, book: FindingsBook, cfg: LeakConfig = LeakConfig()) -> None:
        self.book = book
        self.cfg = cfg
        base = leak.LeakParams()
        if cfg.warmup_s is not None:
            base = dataclasses.replace(base, warmup_s=cfg.warmup_s, long_warmup_s=max(base.long_warmup_s, cfg.warmup_s))
        self.params = base.scaled(cfg.time_scale)
        p = self.params
        self.lookback_s = max(max(p.windows_s) + p.long_warmup_s, p.seasonal_lookback_s) + p.floor_window_s
        self.metrics = None
        self.verdicts: dict[str, leak.LeakVerdict] = {}
        self._last_bucket: dict[str, int] = {}
        self._ok_since: dict[str, float] = {}
        self._gauged: dict[str, tuple[str, str, str, str]] = {}  # key -> its GUARD_LEAK_SLOPE labels
        self._data_since: float | None = None  # first tick that saw any RSS series
        self.errors = 0  # process checks that raised (each process's verdict then unknown)
        self.last_error: str | None = None

    def bind_metrics(self, metrics) -> None:
        self.metrics = metrics

    def _limit(self) -> tuple[float | None, str]:
        """The memory limit a leak runs into: configured, else the guard host's memory (the
        contract exports no per-process limit, so a cgroup limit must be configured)."""
        if self.cfg.limit_bytes:
            return self.cfg.limit_bytes, "configured"
        host = host_memory_bytes()
        return host, "host_memory"

    def evaluate(self, view: MetricsView, now: float) -> None:
        if not self.cfg.enabled:
            return
        seen: set[str] = set()
        failed = failed_queries(view)
        down = self._down_instances(view, now)
        start = now - self.lookback_s
        rss: dict | None = None
        if reads_subsets(view):  # the guard's store: the last sample times now, the samples of the due below
            last = view.last_times(c.PROCESS_RSS.name, {}, start, now)
        else:
            rss = {s.labels: s for s in view.range(c.PROCESS_RSS.name, {}, start, now)}
            last = {lab: float(s.t[-1]) for lab, s in rss.items() if len(s.t)}
        if failed_queries(view) != failed:
            # Prometheus did not answer (503, timeout, too_large): every process read as gone and
            # each open leak finding was resolved "series_gone", to reopen at the next answer
            return
        due: list[tuple] = []  # (labels, their dict, key, bucket) of the processes checked this tick
        pending: dict[str, int] = {}  # key -> bucket of those (two series of one key: the first is checked)
        for labels, t_last in last.items():
            lab = dict(labels)
            key = "leak/" + "/".join(lab.get(k, "") for k in ("instance", "model", "pool", "engine", "process"))
            if now - t_last > self.params.max_gap_s and lab.get("instance", "") not in down:
                continue  # gone (see _down_instances): its finding resolves below, not in lookback_s (12 h)
            seen.add(key)
            bucket = self._bucket(key, t_last)
            if pending.get(key, self._last_bucket.get(key)) == bucket and (key in pending or key in self.verdicts):
                continue  # the floor only changes once per bucket
            pending[key] = bucket
            due.append((labels, lab, key, bucket))
        if due:
            # every engine's load and every process's start, read once (not read: judged at the
            # next tick, never without its load or start)
            context = self._context(view, now, {tuple(lab.get(k, "") for k in ENGINE_KEYS) for _, lab, _, _ in due})
            if context is None:
                return
            if rss is None:
                want = {labels for labels, _, _, _ in due}
                rss = {s.labels: s for s in view.range(c.PROCESS_RSS.name, {}, start, now, where=want.__contains__)}
            for labels, lab, key, bucket in due:
                s = rss.get(labels)
                if s is None:  # its samples left the window between the two reads: due at the next tick
                    continue
                self._last_bucket[key] = bucket
                try:
                    self._check(s, lab, key, now, context)
                except Exception as err:  # one process's degenerate data must not stop the others' checks
                    self._failed(key, err)
        if seen and self._data_since is None:
            self._data_since = now
        for key in list(self.verdicts):
            if key not in seen:  # the series is gone (process ended): nothing left to leak
                self.verdicts.pop(key, None)
                self._last_bucket.pop(key, None)
                self._ok_since.pop(key, None)
                self._ungauge(key)
                self.book.resolve(key, now, {"resolution": "series_gone"})
        self._restored_gone(seen, now)

    def _bucket(self, key: str, t: float) -> int:
        """The check bucket of ``t`` for ``key``: its edges shifted by a stable hash of the key.
        Edges aligned to the clock made every process due in the same tick (at 2,000 processes
        seconds of CPU in one tick and none in the next 19); each is still checked once a bucket."""
        phase = zlib.crc32(key.encode()) / 2**32 * self.params.bucket_s
        return int((t - phase) // self.params.bucket_s)

    def _check(self, s, lab: dict, key: str, now: float, context: tuple[dict, dict]) -> None:
        """Assess one process series (with its engine's load and its start time from
        ``_context``) and report its finding."""
        runs, starts = context
        engine = tuple(lab.get(k, "") for k in ENGINE_KEYS)
        load = runs.get(engine)
        start = starts.get((*engine, lab.get("process", "")))
        limit, source = self._limit()
        v = leak.assess(s.t, s.v, self.params, limit_bytes=limit, load=load, start_time=start)
        self.verdicts[key] = v
        self._gauged[key] = (lab.get("model", ""), lab.get("pool", ""), lab.get("instance", ""),
                             lab.get("process", ""))
        # a restart is evidence only when seen: a drop inside our data or a process start
        # time after the finding opened, never merely "our data begins after it opened"
        # (which is all a guard restarted from its state file has at first)
        restarted = (v.segment_start or 0) > float(s.t[0]) or (start is not None and start > 0)
        self._report(key, lab, v, limit, source, now, restarted)

    def _failed(self, key: str, err: Exception) -> None:
        """A process whose check raised is unknown until its next bucket (its open finding stays
        open: unknown never resolves one); counted in ``errors`` and in the guard's
        ``guard_evaluator_errors{evaluator="leak"}``, logged once a bucket."""
        self.errors += 1
        self.last_error = f"{key}: {type(err).__name__}: {err}"
        log.exception("leak check of %s failed", key)
        if self.metrics is not None:
            self.metrics[c.GUARD_EVALUATOR_ERRORS].labels(self.name).inc()
        self.verdicts[key] = leak.LeakVerdict("unknown", "error")
        self._ok_since.pop(key, None)

    def _context(self, view: MetricsView, now: float,
                 engines: set[tuple[str, ...]] | None = None) -> tuple[dict, dict] | None:
        """Running requests (``lookback_s``) of every engine (of ``engines`` where the view reads
        subsets: see ``reads_subsets``) and the start time of every process, each read once for all
        processes; None when a read failed. One query per process made two round trips per process
        whenever the floors moved (every 5 min): at a fleet's thousand processes the tick ran out
        of its budget, and a process whose query failed was judged without its load or start time."""
        failed = failed_queries(view)
        runs: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
        start = now - self.lookback_s
        if engines is not None and reads_subsets(view):
            load = view.range(c.REQUESTS_RUNNING.name, {}, start, now,
                              where=lambda labels: tuple(_lab(labels, k) for k in ENGINE_KEYS) in engines)
        else:
            load = view.range(c.REQUESTS_RUNNING.name, {}, start, now)
        for s in load:
            runs.setdefault(tuple(s.label(k) for k in ENGINE_KEYS), (s.t, s.v))
        starts: dict[tuple[str, ...], float] = {}
        for labels in view.instant(c.PROCESS_INFO.name, {}, now):
            with contextlib.suppress(ValueError):
                starts[tuple(_lab(labels, k) for k in (*ENGINE_KEYS, "process"))] = float(_lab(labels, "start_time"))
        return None if failed_queries(view) != failed else (runs, starts)

    @staticmethod
    def _down_instances(view: MetricsView, now: float) -> set[str]:
        """Instances whose source fails now (``up`` 0). A process series with no sample for
        longer than ``max_gap_s`` (a hole the detector already reads as a new segment) is gone
        when its page is still served without it or its target is no longer scraped (removed,
        renamed); while its target is down its data is unknown, and an open leak stays open."""
        return {dict(lab).get("instance", "") for lab, v in view.instant(UP, {}, now).items() if not v >= 1}

    def _ungauge(self, key: str) -> None:
        """Drop a gone process's slope gauge: kept, it showed the last slope forever and every
        process that ever lived stayed a series on the guard's /metrics."""
        labels = self._gauged.pop(key, None)
        if labels is not None and self.metrics is not None:
            with contextlib.suppress(KeyError):
                self.metrics[c.GUARD_LEAK_SLOPE].remove(*labels)

    def _restored_gone(self, seen: set[str], now: float) -> None:
        """A finding reopened from the state file whose process never shows up again, while
        others do, for longer than a data gap that already counts as a new segment: gone. So
        are the hysteresis clocks restored for such processes (kept, each stayed in memory and in
        every save for good)."""
        if self._data_since is None or now - self._data_since < self.params.max_gap_s:
            return
        for key in [k for k in self._ok_since if k not in self.verdicts]:
            del self._ok_since[key]
        restored = getattr(self.book, "restored", set())
        for key in [k for k in restored if k.startswith("leak/")]:
            restored.discard(key)
            if key not in seen:
                self.book.resolve(key, now, {"resolution": "series_gone"})

    def _report(self, key, lab, v: leak.LeakVerdict, limit, source, now, restarted: bool = True) -> None:
        if self.metrics is not None and v.status != "unknown":
            self.metrics[c.GUARD_LEAK_SLOPE].labels(lab.get("model", ""), lab.get("pool", ""),
                                                    lab.get("instance", ""), lab.get("process", "")).set(v.slope_bps)
        labels = {k: lab.get(k, "") for k in ("model", "pool", "instance", "process", "engine", "role")}
        if v.detected:
            self._ok_since.pop(key, None)
            sev = "critical" if v.eta_s is not None and v.eta_s < self.cfg.critical_eta_h * HOUR else "warning"
            summary = (f"{lab.get('process', 'process')} RSS of {lab.get('model', '')}/{lab.get('pool', '')} grows "
                       f"{v.slope_mib_per_h:.1f} MiB/h")
            details = {"slope_mib_per_h": round(v.slope_mib_per_h, 3), "slope_bytes_per_s": v.slope_bps,
                       "confidence": v.confidence, "z": v.z, "window_s": v.window_s, "onset": v.onset,
                       "floor_bytes": v.floor_bytes, "limit_bytes": limit, "limit_source": source, "eta_s": v.eta_s,
                       "hourly_swing_bytes": v.hourly_swing_bytes, "excursion_envelope_s": v.excursion_envelope_s}
            self.book.raise_("leak", key, sev, summary, labels, details, now)
            return
        f = self.book.get(key)
        if f is None or not f.open:
            return
        if restarted and (v.segment_start or 0) > f.opened_at:  # restarted: the leaked memory is gone
            self.book.resolve(key, now, {"resolution": "restart"})
            return
        # hysteresis: a leak verdict can blink off for a bucket (a spike, a load swing); resolve
        # only after the trend has been absent for a whole short window
        if v.status != "ok":
            self._ok_since.pop(key, None)
            return
        since = self._ok_since.setdefault(key, now)
        if now - since >= min(self.params.windows_s):
            self._ok_since.pop(key, None)
            self.book.resolve(key, now, {"resolution": "trend_gone"})

    def claims(self, key: str) -> bool:
        """Whether this evaluator will judge (and so in time resolve) the open finding ``key``."""
        return self.cfg.enabled and key.startswith("leak/")

    def state_dump(self, full: bool) -> dict:
        """Only the hysteresis clocks: verdicts are recomputed from the data at the next bucket,
        and the open findings themselves live in the findings book."""
        return {"ok_since": dict(self._ok_since)}

    def state_load(self, parts: dict, records: list[dict]) -> None:
        self._ok_since.update({str(k): float(v) for k, v in (parts.get("ok_since") or {}).items()})

    paged = True  # snapshot(limit, after): one entry per process (``sla_guard.model.page_map``)

    def snapshot(self, limit: int | None = None, after: str | None = None) -> dict:
        procs, extra = page_map(self.verdicts, limit, after, "processes")
        return {"processes": {k: {"status": v.status, "reason": v.reason,
                                  "slope_mib_per_h": round(v.slope_mib_per_h, 3), "z": v.z, "eta_s": v.eta_s}
                              for k, v in procs.items()},
                **extra, "errors": self.errors, "last_error": self.last_error}


# --- crash-safe state of the drift evaluators --------------------------------------------------

_DRIFT_CLASSES = {k.__name__: k for k in (drift.RateCusum, drift.LatencyDrift, drift.Alarm, drift.RateDriftParams,
                                          drift.LatencyDriftParams)}
# state saved before issue 16's TPOT rework: its open alarm and counts carry over, the reference is relearned
_DRIFT_CLASSES["LatencyCusum"] = drift.LatencyDrift


DRIFT_SAVE_S = 600.0  # each drift group's CUSUM is written to the state file at least this often


def _group_part(k: tuple) -> str:
    """The state file part of one drift group (JSON: label values may hold any character)."""
    return "g/" + json.dumps(list(k), separators=(",", ":"))


_PACKED = "/packed"  # the class tag's suffix of a ``_pack``ed CUSUM


def _float_rows(v) -> int | None:
    """The row width of ``v`` when it is a non-empty list of floats (0) or of equal-length tuples of
    floats, else None. Checked by type (in C: ``set(map(type, ...))``), so only what comes back
    exactly as it was is packed: an int or a list row keeps ``encode``'s form."""
    if type(v) is not list or not v:
        return None
    if type(v[0]) is float:
        return 0 if set(map(type, v)) == {float} else None
    widths = set(map(len, v)) if set(map(type, v)) == {tuple} else set()
    if len(widths) != 1 or set(map(type, itertools.chain.from_iterable(v))) != {float}:
        return None
    return widths.pop()


def _pack(cus) -> dict:
    """One group's CUSUM as its state part. Its windows (the per-interval rows held for the
    reference, the trend windows, the jitter block, the recent rows: ~90% of it) are lists of float
    rows: as JSON, tagged tuple by tuple, they were ~13 KB per CUSUM and ``encode`` walked each
    float in Python (~80% of a save's time). Here they are float64 columns, zlib-compressed once
    for the whole CUSUM (the windows repeat each other's rows) and base64: every bit comes back.
    The rest is ``encode``'s form under the class name with ``/packed`` added, which a guard before
    this refuses as an unknown class (its detector then learns again) instead of restoring the
    CUSUM without its windows; ``params`` is left out (``state_load`` sets the configured ones)."""
    from sla_guard.state import encode

    fields: dict = {}
    shapes: dict[str, list[int]] = {}
    cols: list[bytes] = []
    for f in dataclasses.fields(cus):
        if f.name == "params":
            continue
        v = getattr(cus, f.name)
        width = _float_rows(v)
        if width is None:
            fields[f.name] = encode(v)
        else:
            shapes[f.name] = [len(v), width]
            cols.append(np.array(v, dtype="<f8").T.tobytes())
    return {"__dc__": type(cus).__name__ + _PACKED, "f": fields, "shapes": shapes,
            "z": base64.b64encode(zlib.compress(b"".join(cols), 1)).decode("ascii")}


def _unpack(value: dict, params) -> object:
    """Inverse of ``_pack``; also reads a part written before it (``encode``'s form)."""
    from sla_guard.state import decode

    over = {"params": params}
    if not str(value.get("__dc__", "")).endswith(_PACKED):
        return decode(value, _DRIFT_CLASSES, over)
    cus = decode({"__dc__": value["__dc__"].removesuffix(_PACKED), "f": value["f"]}, _DRIFT_CLASSES, over)
    shapes = value["shapes"]
    buf = np.frombuffer(zlib.decompress(base64.b64decode(value["z"])), dtype="<f8")
    if len(buf) != sum(rows * max(width, 1) for rows, width in shapes.values()):
        raise ValueError(f"drift state part: {len(buf)} packed floats, not the {shapes} it names")
    names = {f.name for f in dataclasses.fields(cus)}
    at = 0
    for name, (rows, width) in shapes.items():
        a = buf[at:at + rows * max(width, 1)]
        at += len(a)
        if name in names:  # a field since removed is skipped, as ``decode`` skips it
            setattr(cus, name, a.tolist() if width == 0 else list(map(tuple, a.reshape(width, rows).T.tolist())))
    return cus


class _DriftState:
    """``Stateful`` for a drift evaluator: its CUSUMs (baseline, statistics, open alarm) and
    when the next interval closes. Without them a restart relearns the baseline from the
    drifted rate and can never resolve (or re-find) an open drift. The interval being
    accumulated and the last counter values are not kept: a restart costs the detector one
    interval of data, and saving a value per counter series every tick cost ~10x more than
    everything else together.

    One part per model/pool group (``g/<labels>``), each written when an interval closes once per
    ``DRIFT_SAVE_S`` (its turn spread over the intervals by a hash of the group, as the leak
    checks), and at once when its alarm opens or closes (in the save that holds the finding's
    change, so a restart never restores a finding without the alarm that resolves it), when it
    is new, and at every full save; deleted when the group is forgotten. Every CUSUM changes at
    every interval (its windows move), so the one part of all of them written at every interval
    (``s``, still read) was ~80 KB a model/pool (14 KB per CUSUM, 6 CUSUMs with spec decoding
    per position): 8 MiB and ~1-2 s on the tick thread each minute at 100 groups, 11 GiB a day
    (``bench/bench_drift_state.py``). Each part is ``_pack``'s form (its windows as compressed
    float64 columns: ~3 KB a rate CUSUM, ~6 KB a TPOT one); a part in ``encode``'s form (before)
    still loads. After a crash each group is back as it was at its last write, at most
    ``DRIFT_SAVE_S`` (10 intervals) before it, each group's CUSUM whole."""

    paged = True  # snapshot(limit, after): one entry per group (``sla_guard.model.page_map``)

    def snapshot(self, limit: int | None = None, after: str | None = None) -> dict:
        groups, extra = page_map({"/".join(k): cus for k, cus in list(self.cusums.items())}, limit, after, "groups")
        out: dict = {k: cus.snapshot() for k, cus in groups.items()}
        out.update(extra)  # no group key clashes with these: each holds a "/"
        if self.groups_over_limit:
            out["groups_over_limit"] = self.groups_over_limit
        return out

    def _init_state(self) -> None:
        self._filed: set[str] = set()  # group parts the state file holds
        self._unfiling: set[str] = set()  # group parts the last dump deleted
        self._marks: dict[tuple, tuple[int, bool]] = {}  # group -> (its turn, alarm open) when last written
        self._dumped_next: float | None = None

    def state_dump(self, full: bool) -> dict:
        filed, marks = self._filed, self._marks
        if not full:  # the save of the previous dump committed (the guard makes the next one full if not)
            filed -= self._unfiling
        if not full and self._next == self._dumped_next:
            return {}
        self._dumped_next = self._next
        out: dict = {"next": self._next}
        if full:
            out["s"] = None  # the single part of all groups, before this layout
            marks.clear()
        live = set()
        for k, cus in self.cusums.items():
            part = _group_part(k)
            live.add(part)
            phase = zlib.crc32(part.encode()) / 2**32 * DRIFT_SAVE_S
            mark = (int(((self._next or 0.0) - phase) // DRIFT_SAVE_S), cus.alarm is not None)
            if marks.get(k) != mark:
                out[part] = _pack(cus)
                marks[k] = mark
        self._unfiling = filed - live
        out.update(dict.fromkeys(self._unfiling))
        filed |= live
        for k in [k for k in marks if k not in self.cusums]:
            del marks[k]
        return out

    def _sweep_gone(self, view: MetricsView, present: set[tuple], now: float) -> None:
        """Resolve the open finding of a group whose series are gone (its pool removed or renamed,
        spec decoding turned off) for longer than ``resolve_s``: its CUSUM keeps the open alarm, so
        it stayed open forever. Not while a target of that model/pool is down (data unknown). The
        CUSUM is kept (for ``forget_after_s``, see ``_forget``): if the series come back still
        drifted, the finding opens again. Only ``max_groups`` groups are tracked."""
        seen = self._seen_at
        over = 0
        for k in present:
            if k in seen or len(seen) < self.max_groups:
                seen[k] = now
            else:
                over += 1
        if over and not self.groups_over_limit:
            log.warning("%s: %d model/pool groups beyond detectors.max_groups=%d are not judged (their drifts go "
                        "unseen): raise max_groups, or lower forget_after_s if they are gone", self.name, over,
                        self.max_groups)
        self.groups_over_limit = over
        down = None
        for k, cus in self.cusums.items():
            if cus.alarm is None or now - seen.setdefault(k, now) <= self.params.resolve_s:
                continue
            if down is None:
                failed = failed_queries(view)
                up = view.instant(UP, {}, now)
                if failed_queries(view) != failed:
                    return  # whether its targets are down is unknown this tick
                down = {(_lab(lab, "model"), _lab(lab, "pool")) for lab, v in up.items() if not v >= 1}
            f = self.book.get(self._key(k))
            if f is not None and f.open and tuple(k[:2]) not in down:
                self.book.resolve(f.key, now, {"resolution": "series_gone"})

    def _forget_gone(self, view: MetricsView, now: float, *counters: _Counters) -> None:
        """Drop the last value of each counter series not read for ``resolve_s`` (when
        ``_sweep_gone`` counts its group gone): kept, a pod replaced every hour left one entry per
        counter for good. Not while its target is down (``up`` 0: unknown, not gone; its
        increments carry on when it returns), nor when that is unknown this tick. Looked at every
        tenth of ``resolve_s``, so an outage adds no ``up`` query to every tick."""
        if now < self._forget_at:
            return
        self._forget_at = now + self.params.resolve_s / 10
        gone = set().union(*(cnt.unseen(now - self.params.resolve_s) for cnt in counters))
        if not gone:
            return
        failed = failed_queries(view)
        down = LeakEvaluator._down_instances(view, now)
        if failed_queries(view) != failed:
            return
        gone = {lab for lab in gone if _lab(lab, "instance") not in down}
        for cnt in counters:
            cnt.forget(gone)

    def _forget(self, now: float, *counters: _Counters) -> None:
        """Drop every trace of a group with no series for ``forget_after_s`` (a LoRA adapter unloaded,
        a pool renamed): kept, each group that ever reported stayed in memory and in every save of
        the state file for good (~8 KB of CUSUM each: 1,000 churned models, 8 MB a detector). An
        open finding of it is resolved (``no_data``), never dropped with it; if the group returns
        its baseline is learned again."""
        seen = self._seen_at
        for k in self.cusums:
            seen.setdefault(k, now)  # restored from the state file: its clock starts now
        horizon = now - self.forget_after_s
        for k in [k for k, t in seen.items() if t < horizon]:
            del seen[k]
            self.cusums.pop(k, None)
            self._acc.pop(k, None)
            f = self.book.get(self._key(k))
            if f is not None and f.open:
                self.book.resolve(f.key, now, {"resolution": "no_data"})
            self.forgotten += 1
        for cnt in counters:
            if len(cnt.groups) > len(seen):
                cnt.groups &= seen.keys()

    def claims(self, key: str) -> bool:
        """Whether this evaluator will judge (and so in time resolve) the open finding ``key``."""
        return self.cfg.enabled and any(cus.alarm is not None and self._key(k) == key
                                        for k, cus in self.cusums.items())

    def state_load(self, parts: dict, records: list[dict]) -> None:
        from sla_guard.state import decode

        groups = [p for p in parts if p.startswith("g/")]
        if "s" not in parts and "next" not in parts and not groups:
            return
        over = {"params": self.params}
        saved: dict = {}
        if "s" in parts:  # a file written before one part per group
            d = decode(parts["s"], _DRIFT_CLASSES, over)
            self._next, saved = d["next"], d["cusums"]
        if "next" in parts:
            self._next = parts["next"]
        for p in groups:
            saved[tuple(json.loads(p[2:]))] = _unpack(parts[p], self.params)
        self._filed.update(groups)
        mine, self.cusums = self.cusums, saved
        for k, cus in mine.items():  # a file restored into a running guard: what this one found stays judged
            if k not in self.cusums or (cus.alarm is not None and self.cusums[k].alarm is None):
                self.cusums[k] = cus  # (else an open finding's alarm went, and nothing resolved it)


# --- rates -----------------------------------------------------------------------------------

class _Counters:
    """Increments of cumulative counters between ticks, summed by a label tuple."""

    def __init__(self) -> None:
        self.last: dict = {}
        self.seen_at: dict = {}  # series labels -> the last tick that read it (``forget``)
        self.resets: set[tuple] = set()  # groups with a counter reset (an engine restart) in the last step
        self.groups: set[tuple] = set()  # groups seen in an earlier step

    def step(self, values: dict, by: tuple[str, ...], now: float) -> dict[tuple, float]:
        out: dict[tuple, float] = defaultdict(float)
        self.resets = set()
        seen: set[tuple] = set()
        for labels, v in values.items():
            if not math.isfinite(v):
                continue
            key = tuple(_lab(labels, k) for k in by)
            seen.add(key)
            prev = self.last.get(labels)
            self.last[labels] = v
            self.seen_at[labels] = now
            if prev is None:
                # a new series in a group already seen is an engine (re)started under new labels (a
                # replaced pod, a renamed target): its counters began at zero, its cache is cold
                if key in self.groups:
                    self.resets.add(key)
                continue
            if v < prev:
                self.resets.add(key)
            out[key] += v - prev if v >= prev else v
        self.groups |= seen
        return out

    def unseen(self, since: float) -> set:
        """Series not read since ``since``."""
        return {lab for lab, t in self.seen_at.items() if t < since}

    def forget(self, series: set) -> None:
        for lab in series:
            self.last.pop(lab, None)
            self.seen_at.pop(lab, None)


def rate_params(cfg: RateConfig, sides: str, family: int = 1) -> drift.RateDriftParams:
    """The rate detector's parameters from its config section: the one mapping the guard, `analyze
    prefix` and the benchmarks share, so offline and online verdicts agree."""
    return drift.RateDriftParams(interval_s=cfg.interval_s, warmup_s=cfg.warmup_s, shift=cfg.shift,
                                 tolerance=cfg.tolerance, sides=sides, arl0_s=cfg.arl0_days * drift.DAY,
                                 family=family, arl_rule=cfg.arl_rule, jitter_blocks=cfg.jitter_blocks,
                                 refine_s=cfg.refine_s, reset_hold_s=cfg.reset_hold_s, trend_wander=cfg.wander,
                                 measured_wander_blocks=cfg.measured_wander_blocks,
                                 load_hold_ratio=cfg.load_hold_ratio)


class RateDriftEvaluator(_DriftState):
    """A ratio of two counters (successes / trials) per (model, pool[, position]) -> CUSUM."""

    def __init__(self, book: FindingsBook, name: str, detector: str, trials, successes, cfg: RateConfig,
                 sides: str, what: str, matchers: dict | None = None, by_position: bool = False,
                 family: int = 1, forget_after_s: float = 86400.0, max_groups: int = 2000) -> None:
        self.book, self.name, self.detector = book, name, detector
        self.trials, self.successes, self.cfg = trials, successes, cfg
        self.what, self.matchers = what, matchers or {}
        self.by = ("model", "pool", "position") if by_position else ("model", "pool")
        self.params = rate_params(cfg, sides, family)
        self._n, self._x = _Counters(), _Counters()
        self._acc: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._next: float | None = None
        self.cusums: dict[tuple, drift.RateCusum] = {}
        self._seen_at: dict[tuple, float] = {}  # group -> last tick its series were there (_sweep_gone)
        self._forget_at = -math.inf  # next look for counter series gone (_forget_gone)
        self.forget_after_s, self.max_groups = forget_after_s, max_groups
        self.groups_over_limit = 0  # groups present but not judged (max_groups)
        self.forgotten = 0
        self._init_state()

    def evaluate(self, view: MetricsView, now: float) -> None:
        if not self.cfg.enabled:
            return
        failed = failed_queries(view)
        trials = view.instant(self.trials.exposed, self.matchers, now)
        successes = view.instant(self.successes.exposed, self.matchers, now)
        if failed_queries(view) != failed:
            # Prometheus did not answer one of them: this tick's counts are unknown, not absent (one
            # read without the other moved its increments into the next interval, and an outage read
            # as every series gone); the counters' last values wait for the next answer, losing nothing
            return
        dn = self._n.step(trials, self.by, now)
        dx = self._x.step(successes, self.by, now)
        self._sweep_gone(view, {tuple(_lab(lab, b) for b in self.by) for lab in trials}, now)
        self._forget_gone(view, now, self._n, self._x)
        self._forget(now, self._n, self._x)
        for k, n in dn.items():
            if k not in self._seen_at:
                continue  # beyond max_groups
            acc = self._acc[k]
            acc[0] += n
            acc[1] += dx.get(k, 0.0)
        for k in self._n.resets | self._x.resets:
            if k in self.cusums:
                self.cusums[k].restarted(now)
        if self._next is None:
            self._next = now + self.params.interval_s
            return
        if now < self._next:
            return
        self._next = now + self.params.interval_s
        for k, (n, x) in list(self._acc.items()):
            self._acc[k] = [0.0, 0.0]
            cus = self.cusums.setdefault(k, drift.RateCusum(self.params))
            was_open = cus.alarm is not None
            cus.update(now, n, min(x, n))
            self._report(k, cus, was_open, now)

    def _key(self, k: tuple) -> str:
        return "/".join((self.detector, *k))

    def _report(self, k: tuple, cus: drift.RateCusum, was_open: bool, now: float) -> None:
        key = self._key(k)
        labels = dict(zip(self.by, k, strict=True))
        a = cus.alarm
        if a is not None:
            word = "fell" if a.direction == "down" else "rose"
            where = f" at draft position {labels['position']}" if labels.get("position") else ""
            summary = (f"{self.what}{where} of {labels.get('model')}/{labels.get('pool')} {word} "
                       f"from {a.baseline:.3f} to {a.after:.3f}")
            details = {"before": a.baseline, "after": a.after, "change_at": a.change_at, "direction": a.direction,
                       "what": self.what, "unit": "", "statistic": a.statistic,
                       "threshold": a.threshold,
                       "arl0_days": self.cfg.arl0_days}
            self.book.raise_(self.detector, key, "warning", summary, labels, details, now)
        elif was_open:
            self.book.resolve(key, now, {"after": cus.recent_rate()})


class TpotDriftEvaluator(_DriftState):
    """Mean TPOT per interval vs the reference at the same batch size -> latency-drift findings."""

    name = "tpot_drift"

    def __init__(self, book: FindingsBook, cfg: TpotConfig = TpotConfig(), forget_after_s: float = 86400.0,
                 max_groups: int = 2000) -> None:
        self.book, self.cfg = book, cfg
        self.forget_after_s, self.max_groups = forget_after_s, max_groups
        self.groups_over_limit = 0  # groups present but not judged (max_groups)
        self.forgotten = 0
        self.params = drift.LatencyDriftParams(interval_s=cfg.interval_s, warmup_s=cfg.warmup_s,
                                               arl0_s=cfg.arl0_days * drift.DAY)
        self._s, self._n = _Counters(), _Counters()
        self._next: float | None = None
        self._acc: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.cusums: dict[tuple, drift.LatencyDrift] = {}
        self._seen_at: dict[tuple, float] = {}  # group -> last tick its series were there (_sweep_gone)
        self._forget_at = -math.inf  # next look for counter series gone (_forget_gone)
        self._running: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])  # (sum, ticks) this interval
        self._init_state()

    def evaluate(self, view: MetricsView, now: float) -> None:
        if not self.cfg.enabled:
            return
        by = ("model", "pool")
        failed = failed_queries(view)
        sums = view.instant(c.REQUEST_TPOT.series("_sum"), {}, now)
        counts = view.instant(c.REQUEST_TPOT.series("_count"), {}, now)
        if failed_queries(view) != failed:  # unknown this tick, not absent (as in RateDriftEvaluator)
            return
        ds = self._s.step(sums, by, now)
        dn = self._n.step(counts, by, now)
        self._sweep_gone(view, {tuple(_lab(lab, b) for b in by) for lab in counts}, now)
        self._forget_gone(view, now, self._s, self._n)
        self._forget(now, self._s, self._n)
        for k, n in dn.items():
            if k not in self._seen_at:
                continue  # beyond max_groups
            self._acc[k][0] += ds.get(k, 0.0)
            self._acc[k][1] += n
        # the batch the interval's requests ran at: the engines' mean, averaged over the interval's ticks
        # (the value at its end alone reads a load change inside it as a slowdown at the new batch)
        per_pool: dict[tuple, list[float]] = defaultdict(list)
        for labels, v in view.instant(c.REQUESTS_RUNNING.name, {}, now).items():
            k = tuple(_lab(labels, x) for x in by)
            if math.isfinite(v) and k in self._seen_at:
                per_pool[k].append(v)
        for k, vs in per_pool.items():
            self._running[k][0] += float(np.mean(vs))
            self._running[k][1] += 1
        if self._next is None or now < self._next:
            self._next = self._next or now + self.params.interval_s
            return
        self._next = now + self.params.interval_s
        running, self._running = self._running, defaultdict(lambda: [0.0, 0.0])
        for k, (s, n) in list(self._acc.items()):
            self._acc[k] = [0.0, 0.0]
            if n <= 0 or not running.get(k, (0.0, 0))[1]:
                continue
            cus = self.cusums.setdefault(k, drift.LatencyDrift(self.params))
            was_open = cus.alarm is not None
            cus.update(now, s / n, running[k][0] / running[k][1], n)
            key = self._key(k)
            labels = dict(zip(by, k, strict=True))
            if cus.alarm is not None:
                a = cus.alarm
                self.book.raise_("tpot_drift", key, "warning",
                                 f"TPOT of {k[0]}/{k[1]} is {100 * (a.after - 1):.0f}% above its reference at the same "
                                 "batch size", labels,
                                 {"before": 1.0, "after": a.after, "what": "TPOT relative to baseline at same load",
                                  "unit": "x", "change_at": a.change_at, "threshold": self.params.threshold,
                                  "arl0_days": self.cfg.arl0_days}, now)
            elif was_open:
                self.book.resolve(key, now)

    def _key(self, k: tuple) -> str:
        return "/".join(("tpot_drift", *k))


class RestoredFindings:
    """A finding reopened from the state file that no configured detector will judge again (its
    detector now disabled, per-position acceptance turned off, its drift state lost) stayed open
    forever: served, sent to Alertmanager and, for a leak, a rolling restart the advisor kept
    recommending. At the first tick each is resolved unless an enabled evaluator claims it."""

    name = "restored_findings"

    def __init__(self, book: FindingsBook, evaluators: list) -> None:
        self.book, self.evaluators = book, evaluators
        self.detectors = {"leak", "acceptance_drift", "prefix_hit_drift", "tpot_drift"}  # ttft_stage syncs its own
        self.resolved: list[str] = []  # keys resolved as not configured
        # restored keys already looked at: a state file attached later (``Guard._attach_state``)
        # reopens its findings after the first tick, and they were never looked at
        self._checked: set[str] = set()

    def evaluate(self, view: MetricsView, now: float) -> None:
        new = self.book.restored - self._checked
        if not new:
            return
        self._checked |= new
        for f in self.book.open_findings():
            if f.key in new and f.detector in self.detectors and not any(
                    ev.claims(f.key) for ev in self.evaluators):
                self.book.restored.discard(f.key)
                self.book.resolve(f.key, now, {"resolution": "not_configured"})
                self.resolved.append(f.key)

    paged = True  # snapshot(limit, after): the keys resolved (``sla_guard.model.page``)

    def snapshot(self, limit: int | None = None, after: str | None = None) -> dict:
        keys, extra = page_map(dict.fromkeys(self.resolved), limit, after, "resolved")
        return {"checked": len(self._checked), "resolved": list(keys), **extra}


def build_evaluators(book: FindingsBook, cfg: DetectorsConfig) -> list:
    evs: list = [LeakEvaluator(book, cfg.leak)]
    keep = {"forget_after_s": cfg.forget_after_s, "max_groups": cfg.max_groups}
    fam = 5 if cfg.acceptance.per_position else 1  # overall + up to 4 positions share the ARL0
    evs.append(RateDriftEvaluator(book, "acceptance_drift", "acceptance_drift", c.SPEC_DRAFT_TOKENS,
                                  c.SPEC_ACCEPTED_TOKENS, cfg.acceptance, "both", "spec-decode acceptance",
                                  family=fam, **keep))
    if cfg.acceptance.per_position:
        evs.append(RateDriftEvaluator(book, "acceptance_drift_per_position", "acceptance_drift",
                                      c.SPEC_DRAFT_TOKENS_POS, c.SPEC_ACCEPTED_TOKENS_POS, cfg.acceptance, "both",
                                      "spec-decode acceptance", by_position=True, family=fam, **keep))
    evs.append(RateDriftEvaluator(book, "prefix_hit_drift", "prefix_hit_drift", c.PREFIX_CACHE_QUERIES,
                                  c.PREFIX_CACHE_HITS, cfg.prefix_hit, "down", "prefix-cache hit rate",
                                  matchers={"cache": "local"}, **keep))
    evs.append(TpotDriftEvaluator(book, cfg.tpot, **keep))
    evs.append(RestoredFindings(book, list(evs)))
    return evs


def router(book: FindingsBook) -> APIRouter:
    """``GET /v1/findings?state=open|resolved|all&detector=&model=&pool=&limit=&after=``: a page
    of the matching findings by key, ``count`` all that match, ``next`` the cursor when more."""
    r = APIRouter(tags=["findings"])

    @r.get("/v1/findings")
    def findings(state: str = "open", detector: str | None = None, model: str | None = None,
                 pool: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description=f"findings per page (1-{PAGE_MAX})")]
                 = PAGE_MAX,
                 after: Annotated[str | None, Query(description="the previous page's `next`")] = None
                 ) -> JSONResponse:
        if state not in ("open", "resolved", "all"):
            raise HTTPException(400, "state must be one of open, resolved, all")
        items = {"open": book.open_findings, "resolved": book.resolved_findings, "all": book.all}[state]()
        match = [f for f in items if (detector is None or f.detector == detector)
                 and (model is None or f.labels.get("model") == model)
                 and (pool is None or f.labels.get("pool") == pool)]
        # a page of them, by key: 5,000 open findings were one 2 MB answer
        got, nxt = page(match, limit, after, key=lambda f: f.key)
        out: dict = {"findings": [finding_json(f) for f in got], "count": len(match)}
        if nxt is not None:
            out["next"] = nxt
        return JSONResponse(out)  # rendered here, in the worker thread, not on the event loop

    return r
