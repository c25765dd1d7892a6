"""The findings book: one deduplicated record per finding key, with an open -> resolved
lifecycle, the guard's findings metrics, and a bounded history of resolved findings.

Detectors call ``raise_`` while a condition holds and ``resolve`` (or ``sync``) when it stops;
the same key updates the same finding, so a leak reported every tick is one finding with a
moving slope, and one Alertmanager alert.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping

from exporters import contract as c
from sla_guard.model import Finding


class FindingsBook:
    """Thread-safe (evaluators write, the API and the Alertmanager publisher read)."""

    def __init__(self, metrics=None, max_resolved: int = 500) -> None:
        """``metrics``: a ``ContractMetrics`` holding the GUARD component, or None."""
        self._lock = threading.Lock()
        self._open: dict[str, Finding] = {}
        self._resolved: OrderedDict[str, Finding] = OrderedDict()
        self._max_resolved = max_resolved
        self._metrics = metrics
        self._gauge_keys: set[tuple[str, str, str, str]] = set()
        self._severities: set[str] = set()  # of the gauges' label sets
        self._refs: Counter[tuple[str, str, str]] = Counter()  # (model, pool, detector) -> findings kept
        self.version = 0  # bumps on every open / resolve / severity change
        self._dumped_version = -1
        self.restored: set[str] = set()  # keys reopened from the state file at start-up
        # crash-safe state, one part per open finding (state_dump): what changed since the last dump
        self._seq = 0  # bumps on every raise_
        self._changed_at: dict[str, int] = {}  # open key -> _seq of its last raise_
        self._dumped_seq = 0
        self._filed: set[str] = set()  # keys whose part may be in the file
        self._unfiling: set[str] = set()  # keys whose part the last dump deleted

    # --- writes ----------------------------------------------------------------------------
    def raise_(self, detector: str, key: str, severity: str, summary: str, labels: Mapping[str, str],
               details: Mapping[str, float | str | None], now: float) -> Finding:
        """Open the finding ``key`` or update it if already open."""
        with self._lock:
            f = self._open.get(key)
            # the gauges count open findings by (model, pool, detector, severity): recounting them
            # on every update made a tick's updates quadratic in the open findings (4000: 4.7 s)
            regauge = f is None or f.severity != severity or any(
                f.labels.get(k, "") != labels.get(k, "") for k in ("model", "pool"))
            if f is None:
                f = Finding(detector=detector, key=key, severity=severity, summary=summary,
                            labels=dict(labels), details=dict(details), opened_at=now, updated_at=now)
                self._open[key] = f
                if (gone := self._resolved.pop(key, None)) is not None:
                    self._unref(_ref_key(gone))
                self._refs[_ref_key(f)] += 1
                self.version += 1
                if self._metrics is not None:
                    self._metrics[c.GUARD_FINDINGS_TOTAL].labels(
                        f.labels.get("model", ""), f.labels.get("pool", ""), detector).inc()
            else:
                if f.severity != severity:
                    self.version += 1
                f.severity, f.summary, f.updated_at = severity, summary, now
                old = _ref_key(f)
                f.labels = dict(labels)
                if (new := _ref_key(f)) != old:  # moved to another model/pool: the old one's series may go
                    self._refs[new] += 1
                    self._unref(old)
                f.details = dict(details)
            self._seq += 1
            self._changed_at[key] = self._seq
            if regauge:
                self._refresh_gauges()
            return f

    def resolve(self, key: str, now: float, details: Mapping[str, float | str | None] | None = None
                ) -> Finding | None:
        with self._lock:
            f = self._open.pop(key, None)
            if f is None:
                return None
            self._changed_at.pop(key, None)
            f.resolved_at = now
            f.updated_at = now
            if details:
                f.details = {**f.details, **details}  # a new dict: readers iterate the old one unlocked
            self._resolved[key] = f
            while len(self._resolved) > self._max_resolved:
                self._unref(_ref_key(self._resolved.popitem(last=False)[1]))
            self.version += 1
            self._refresh_gauges()
            return f

    def sync(self, detector: str, active: Iterable[str], now: float) -> list[Finding]:
        """Resolve every open finding of ``detector`` whose key is not in ``active``."""
        keep = set(active)
        with self._lock:
            stale = [k for k, f in self._open.items() if f.detector == detector and k not in keep]
        return [f for k in stale if (f := self.resolve(k, now)) is not None]

    # --- crash-safe state (sla_guard.state.Stateful) ------------------------------------------
    def state_dump(self, full: bool) -> dict:
        """One part per open finding (``o/<key>``), written when it opened or changed and deleted
        when it resolved: one part of all of them, re-encoded every save, cost 118 ms a save at
        5,000 open. The bounded list of resolved ones only when something opened or resolved.

        A dump that is not full follows a save that committed (the guard makes the one after a
        failed save full), so the deletions of the dump before are in the file by then; a full one
        deletes again every part not of an open finding, and the single ``open`` part that files
        written before this layout hold (still read by ``state_load``)."""
        from sla_guard.state import encode

        with self._lock:
            if not full:
                self._filed -= self._unfiling
            write = list(self._open) if full else [k for k, n in self._changed_at.items() if n > self._dumped_seq]
            out: dict = {f"o/{k}": encode(self._open[k]) for k in write}
            self._unfiling = self._filed - self._open.keys()
            out.update({f"o/{k}": None for k in self._unfiling})
            if full:
                out["open"] = None
            self._filed.update(write)
            self._dumped_seq = self._seq
            if full or self.version != self._dumped_version:
                out["resolved"] = [encode(f) for f in self._resolved.values()]
                self._dumped_version = self.version
        return out

    def state_load(self, parts: dict, records: list[dict]) -> None:
        """Reopen what was open before the restart. Detectors then judge each one again once
        they have data (a detector without data resolves nothing; see LeakEvaluator)."""
        from sla_guard.state import decode

        with self._lock:
            saved = [*(parts.get("open") or []), *(v for k, v in parts.items() if k.startswith("o/") and v)]
            for d in saved:
                f = decode(d, {"Finding": Finding})
                self._open[f.key] = f
                self._resolved.pop(f.key, None)  # resolved meanwhile (a file restored into a running guard)
                self.restored.add(f.key)  # not those opened meanwhile
            self._filed |= {k[2:] for k in parts if k.startswith("o/")}
            for d in parts.get("resolved") or []:
                f = decode(d, {"Finding": Finding})
                if f.key not in self._open:
                    self._resolved[f.key] = f
            while len(self._resolved) > self._max_resolved:
                self._resolved.popitem(last=False)
            self._refs = Counter(_ref_key(f) for f in (*self._open.values(), *self._resolved.values()))
            self.version += 1
            self._refresh_gauges()

    # --- reads -----------------------------------------------------------------------------
    def get(self, key: str) -> Finding | None:
        with self._lock:
            return self._open.get(key) or self._resolved.get(key)

    def open_findings(self) -> list[Finding]:
        with self._lock:
            return list(self._open.values())

    def resolved_findings(self) -> list[Finding]:
        with self._lock:
            return list(self._resolved.values())

    def all(self) -> list[Finding]:
        with self._lock:
            return [*self._open.values(), *self._resolved.values()]

    # --- metrics ---------------------------------------------------------------------------
    def _unref(self, k: tuple[str, str, str]) -> None:
        """One finding fewer kept (open or in the history) for its (model, pool, detector): at none,
        its series leave the guard's /metrics. Kept at 0, every model that ever had a finding (LoRA
        adapters that come and go) stayed a gauge and a counter series there for good."""
        self._refs[k] -= 1
        if self._refs[k] > 0:
            return
        del self._refs[k]
        if self._metrics is None:
            return
        for sev in self._severities:
            if (gk := (*k, sev)) in self._gauge_keys:
                self._gauge_keys.discard(gk)
                with contextlib.suppress(KeyError):
                    self._metrics[c.GUARD_FINDINGS].remove(*gk)
        with contextlib.suppress(KeyError):
            self._metrics[c.GUARD_FINDINGS_TOTAL].remove(*k)

    def _refresh_gauges(self) -> None:
        if self._metrics is None:
            return
        counts: dict[tuple[str, str, str, str], int] = {}
        for f in self._open.values():
            k = (f.labels.get("model", ""), f.labels.get("pool", ""), f.detector, f.severity)
            counts[k] = counts.get(k, 0) + 1
        g = self._metrics[c.GUARD_FINDINGS]
        for k in self._gauge_keys - counts.keys():
            g.labels(*k).set(0)
        for k, n in counts.items():
            g.labels(*k).set(n)
        self._gauge_keys |= counts.keys()
        self._severities |= {k[3] for k in counts}


def _ref_key(f: Finding) -> tuple[str, str, str]:
    return f.labels.get("model", ""), f.labels.get("pool", ""), f.detector


def finding_json(f: Finding) -> dict:
    """The API's JSON form of a finding."""
    return {
        "detector": f.detector, "key": f.key, "severity": f.severity, "summary": f.summary,
        "labels": f.labels, "details": {k: _finite(v) for k, v in f.details.items()},
        "state": "open" if f.open else "resolved",
        "opened_at": f.opened_at, "updated_at": f.updated_at, "resolved_at": f.resolved_at,
    }


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v
