"""Findings -> Alertmanager v2 API (``POST /api/v2/alerts``).

Alertmanager expires a firing alert it has not heard about for ``resolve_timeout``, so open
findings are re-sent every ``resend_s``; a resolved finding is sent once with ``endsAt`` (and
kept pending until a push succeeds). Every failed attempt is counted by reason; nothing here
ever raises into the guard: an unreachable Alertmanager degrades alerting, not the service.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import urlencode

import httpx

from exporters import contract as c
from exporters.redact import peer_text
from sla_guard.config import AlertmanagerSettings, split_listen
from sla_guard.model import Finding
from sla_guard.outbound import env_value, post_json

log = logging.getLogger(__name__)

ALERT_NAMES = {
    "leak": "SlaGuardHostMemoryLeak",
    "acceptance_drift": "SlaGuardSpecDecodeAcceptanceDrift",
    "prefix_hit_drift": "SlaGuardPrefixCacheHitRateDrift",
    "tpot_drift": "SlaGuardTpotDriftAtSameLoad",
    "ttft_stage": "SlaGuardTTFTStageGrowth",
}
RUNBOOK_ANCHORS = {
    "leak": "#leak",
    "acceptance_drift": "#acceptance-drift",
    "prefix_hit_drift": "#prefix-hit-drift",
    "tpot_drift": "#tpot-drift",
    "ttft_stage": "#ttft-stage-growth",
}
IDENTITY_LABELS = ("pool", "model", "instance", "process")


def label_id(labels: dict) -> str:
    """A short stable name for a label set (Alertmanager's identity of an alert)."""
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:20]


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat().replace("+00:00", "Z")


def external_url(settings: AlertmanagerSettings, listen: str) -> str:
    """The guard's URL for people following an alert: ``alertmanager.external_url`` (behind a
    proxy), else the API's ``listen`` address, with this host's name for a wildcard one."""
    if settings.external_url:
        return settings.external_url.rstrip("/")
    host, port = split_listen(listen)
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def findings_url(base: str, f: Finding) -> str:
    """``/v1/findings`` narrowed to the finding's detector, model and pool (open and resolved)."""
    q = {"state": "all", "detector": f.detector}
    q.update({k: str(f.labels[k]) for k in ("model", "pool") if f.labels.get(k) not in ("", None)})
    return f"{base}/v1/findings?{urlencode(q)}"


def to_alert(f: Finding, runbook_base_url: str, external_url: str = "") -> dict:
    """One Alertmanager v2 ``postableAlert`` for a finding (pure); ``external_url``: the guard's
    base URL, linked from ``generatorURL``."""
    labels = {"alertname": ALERT_NAMES.get(f.detector, "SlaGuard" + f.detector.title().replace("_", "")),
              "severity": f.severity, "detector": f.detector}
    for k, v in f.labels.items():
        if v not in ("", None):
            labels[k] = str(v)
    for k in IDENTITY_LABELS:  # always present, so routes and silences can match on them
        labels.setdefault(k, "none")
    alert = {
        "labels": labels,
        "annotations": {
            "summary": f.summary,
            "description": describe(f),
            "runbook_url": runbook_base_url + RUNBOOK_ANCHORS.get(f.detector, ""),
        },
        "startsAt": _iso(f.opened_at),
    }
    if external_url:
        alert["generatorURL"] = findings_url(external_url, f)
    if f.resolved_at is not None:  # never before startsAt (a clock stepped back): Alertmanager refuses the batch
        alert["endsAt"] = _iso(max(f.resolved_at, f.opened_at))
    return alert


def describe(f: Finding) -> str:
    """Human description: slope, ETA and (from the object census) the growing container for
    leaks, before/after rates for drifts."""
    d = f.details
    if f.detector == "leak":
        parts = [f"RSS grows {d.get('slope_mib_per_h', 0):.1f} MiB/h"]
        if d.get("confidence") is not None:
            parts.append(f"confidence {float(d['confidence']):.4f}")
        if d.get("onset") is not None:
            parts.append(f"since about {_iso(float(d['onset']))}")
        if d.get("eta_s") is not None:
            parts.append(f"reaches its limit ({float(d.get('limit_bytes') or 0) / 2**30:.2f} GiB, "
                         f"{d.get('limit_source', 'limit')}) in {float(d['eta_s']) / 3600:.1f} h")
        else:
            parts.append("no memory limit known, no ETA")
        if d.get("census_top_owner"):  # the engines' object census (sla_guard/detect/census.py)
            share = d.get("census_explained_ratio")
            parts.append(f"fastest growing container {d['census_top_owner']} "
                         f"(+{float(d.get('census_top_growth_per_h') or 0):.0f} elements/h, "
                         f"~{float(d.get('census_top_mib_per_h') or 0):.2f} MiB/h)"
                         + (f"; census growers explain {100 * float(share):.0f}% of the RSS slope, "
                            f"{float(d.get('census_unexplained_mib_per_h') or 0):.1f} MiB/h unexplained (native)"
                            if share is not None else ""))
        return "; ".join(parts) + "."
    if f.detector == "ttft_stage":
        est = " (client TTFT estimated from the engine stages)" if d.get("estimated") == "true" else ""
        return (f"The {f.labels.get('stage', '?')} stage of {f.labels.get('model', '?')}'s TTFT ({d.get('source')}) "
                f"has a {d.get('window')} mean of {1000 * float(d.get('current_s') or 0):.0f} ms against a baseline of "
                f"{1000 * float(d.get('baseline_s') or 0):.0f} ms; the client TTFT is "
                f"{1000 * float(d.get('ttft_s') or 0):.0f} ms{est}.")
    before, after = d.get("before"), d.get("after")
    if before is not None and after is not None:
        unit = d.get("unit", "")
        return (f"{d.get('what', f.detector)} moved from {float(before):.4g}{unit} to {float(after):.4g}{unit} "
                f"(change near {_iso(float(d.get('change_at') or f.opened_at))}).")
    return f.summary


class AlertmanagerClient:
    """Synchronous pusher with bounded retries. Returns False on failure, never raises."""

    def __init__(self, url: str, *, bearer_token: str | None = None, basic_auth: tuple[str, str] | None = None,
                 timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.5, metrics=None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self._headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else {}
        self._auth = basic_auth
        self.timeout_s = timeout_s
        self.retries = max(1, retries)
        self.backoff_s = backoff_s
        self._metrics = metrics
        self._sleep = sleep
        self.failures = 0  # failed attempts, also without metrics
        self.sent = 0

    def _count(self, reason: str) -> None:
        self.failures += 1
        if self._metrics is not None:
            self._metrics[c.GUARD_ALERT_PUSH_ERRORS].labels(reason).inc()

    def send(self, alerts: list[dict]) -> bool:
        if not alerts:
            return True
        for attempt in range(self.retries):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = self._post(alerts)
            except (httpx.TimeoutException, TimeoutError):
                self._count("timeout")
                continue
            except httpx.HTTPError:
                self._count("connect")
                continue
            except Exception:  # never fatal
                log.exception("alertmanager push failed")
                self._count("other")
                continue
            if r.status_code < 300:
                self.sent += len(alerts)
                return True
            self._count("http_4xx" if r.status_code < 500 else "http_5xx")
            if 400 <= r.status_code < 500 and r.status_code != 429:
                log.warning("alertmanager rejected alerts: %s %s", r.status_code, peer_text(r.text, 200))
                return False  # a bad request will not get better by retrying
        return False

    def _post(self, alerts: list[dict]) -> httpx.Response:
        """One POST complete (connect, headers, body) within ``timeout_s`` in total, else
        TimeoutError: a trickling Alertmanager held the publisher thread, and with it every
        alert, for as long as it trickled."""
        return post_json(self.url, alerts, timeout_s=self.timeout_s, headers=self._headers, auth=self._auth)

    def close(self) -> None:
        """Nothing held between pushes: each one opens (and closes) its own connection."""


class AlertPublisher:
    """Keeps Alertmanager in step with a FindingsBook: open findings every ``resend_s`` (and
    at once after a change), resolved ones until delivered. ``tick(now)`` is the whole logic;
    ``start()`` runs it on a daemon thread so HTTP never blocks an evaluation tick."""

    def __init__(self, book, client: AlertmanagerClient, runbook_base_url: str, *, resend_s: float = 60.0,
                 external_url: str = "", max_pending: int = 1000) -> None:
        self.book = book
        self.client = client
        self.runbook_base_url = runbook_base_url
        self.resend_s = resend_s
        self.external_url = external_url
        self.max_pending = max_pending
        self._sent_resolved: set[str] = set()
        # label-set id -> (alert, opened_at) of every label set Alertmanager may hold as firing:
        # one that no open finding carries any more (a leak turned critical, or resolved) is
        # resolved at the next push, not left to Alertmanager's resolve_timeout
        self._sent_open: dict[str, tuple[dict, float]] = {}
        # what Alertmanager may hold from before a restart: the findings the state file reopened
        # (a file without this publisher's parts); state_load adds what was really sent
        for f in book.open_findings():
            if f.key in getattr(book, "restored", ()):
                a = to_alert(f, runbook_base_url, external_url)
                self._sent_open[label_id(a["labels"])] = (a, f.opened_at)
        self._store = None  # the state file, written before each push (bind_state)
        self._state_name = ""
        self._filed: set[str] = set()  # part names the state file holds
        # what ``state_load`` read, taken in by the next ``tick``: a file attached later is restored
        # on the guard's tick thread while this publisher's thread may be in a push, whose end
        # replaced ``_sent_open`` and ``_filed`` and so dropped what was restored meanwhile
        self._loaded: tuple[dict[str, tuple[dict, float]], set[str]] = ({}, set())
        self._load_lock = threading.Lock()
        self._last_push = -1e18
        self._last_version = -1
        self._failed = 0  # pushes failed in a row: the next waits 1, 2, 4 ... s, at most resend_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_settings(cls, book, settings, metrics=None, listen: str = "127.0.0.1:8080") -> AlertPublisher | None:
        """From ``GuardConfig.alertmanager`` (``listen``: the API's address, for ``generatorURL``);
        None when no URL is configured."""
        if not settings.url:
            return None
        token = env_value("alertmanager.bearer_token_env", settings.bearer_token_env,
                          "pushing alerts to Alertmanager without a bearer token")
        client = AlertmanagerClient(settings.url, bearer_token=token, timeout_s=settings.timeout_s, metrics=metrics)
        return cls(book, client, settings.runbook_base_url, external_url=external_url(settings, listen))

    def tick(self, now: float) -> bool | None:
        """Push if due; returns the push result, or None when nothing was due."""
        with self._load_lock:
            (loaded, names), self._loaded = self._loaded, ({}, set())
        if loaded or names:
            self._sent_open = {**self._sent_open, **loaded}
            self._filed |= names
            self._last_version = -1  # pushed now: what no finding carries any more is resolved
        version = self.book.version
        since = now - self._last_push
        if since < 0:  # the wall clock stepped back (NTP, a VM resumed): waiting for it to catch up
            since = math.inf  # re-sent nothing for that long, and Alertmanager resolved what still fires
        if self._failed and since < min(self.resend_s, 2.0 ** (self._failed - 1)):
            return None  # an Alertmanager answering 429/5xx, or down, is not hit every second
        if version == self._last_version and since < self.resend_s:
            return None
        open_ = self.book.open_findings()
        resolved = [f for f in self.book.resolved_findings() if f.key not in self._sent_resolved]
        resolved = resolved[-self.max_pending:]
        alerts = [to_alert(f, self.runbook_base_url, self.external_url) for f in [*open_, *resolved]]
        firing = {label_id(a["labels"]): (a, f.opened_at) for f, a in zip(open_, alerts, strict=False)}
        in_batch = {label_id(a["labels"]) for a in alerts}
        alerts += [{**a, "endsAt": _iso(max(now, t))} for i, (a, t) in self._sent_open.items() if i not in in_batch]
        # written ahead: a crash between the push and the next save must not lose a label set
        # Alertmanager holds (it would fire until its resolve_timeout, resolved by no one)
        held = {**self._sent_open, **firing}
        self._file(held)
        ok = self.client.send(alerts)
        self._last_push = now
        self._failed = 0 if ok else self._failed + 1
        if not ok:  # a failed push may still have reached Alertmanager (an answer lost)
            self._sent_open = held
            return ok
        self._last_version = version
        self._sent_open = firing
        if firing.keys() != held.keys():
            self._file(firing)  # what this push resolved leaves the file: it stays bounded
        self._sent_resolved |= {f.key for f in resolved}
        open_keys = {f.key for f in open_}
        self._sent_resolved -= open_keys  # a reopened key must be resolved again later
        self._sent_resolved &= {f.key for f in self.book.resolved_findings()}  # bounded
        return ok

    # --- crash-safe state (sla_guard.state.Stateful) ------------------------------------------
    def bind_state(self, store, name: str) -> None:
        """Write this publisher's parts to ``store`` (under component ``name``) itself, before
        each push: the guard's save after the tick came too late for a push made in between."""
        self._store, self._state_name = store, name

    def _file(self, held: dict[str, tuple[dict, float]]) -> None:
        """One part per label set Alertmanager may hold as firing (``s/<label id>``); the others
        deleted. A failed write is counted by the store and shown on ``/v1/status``; the push
        still goes (alerting matters more than what a crash then may leave firing)."""
        if self._store is None:
            return
        parts: dict = {f"s/{i}": {"labels": a["labels"], "annotations": a.get("annotations", {}), "opened_at": t}
                       for i, (a, t) in held.items()}
        parts.update(dict.fromkeys(self._filed - parts.keys()))
        if self._store.save({self._state_name: parts}):
            self._filed = {n for n, v in parts.items() if v is not None}

    def state_dump(self, full: bool) -> dict:
        """Nothing: the parts are written by the publisher itself, ahead of each push (``_file``)."""
        return {}

    def state_load(self, parts: dict, records: list[dict]) -> None:
        """The label sets sent as firing before the restart (added to those of the reopened
        findings): the next push resolves those that no longer fire. A part that is not a label
        set of strings is skipped (Alertmanager refuses the whole batch for one bad alert, and
        would for every push after). Parts named by finding key (older files) load the same."""
        names = {k for k in parts if k.startswith("s/")}
        loaded: dict[str, tuple[dict, float]] = {}
        for k, v in parts.items():
            if not (k.startswith("s/") and isinstance(v, dict)):
                continue
            labels, t = v.get("labels"), v.get("opened_at")
            if not (isinstance(labels, dict) and labels and all(isinstance(x, str) for x in (*labels, *labels.values()))
                    and isinstance(t, (int, float)) and math.isfinite(t)):
                log.warning("state: skipped an unreadable Alertmanager label set %r", k)
                continue
            ann = v.get("annotations")
            ann = {a: b for a, b in ann.items() if isinstance(a, str) and isinstance(b, str)} \
                if isinstance(ann, dict) else {}
            loaded[label_id(labels)] = ({"labels": labels, "annotations": ann, "startsAt": _iso(t)}, float(t))
        with self._load_lock:
            self._loaded[0].update(loaded)
            self._loaded[1].update(names)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.tick(time.time())
            except Exception:  # never fatal
                log.exception("alert publisher tick failed")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sla-guard-alertmanager", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.client.close()
