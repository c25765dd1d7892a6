"""Where a P/D request's TTFT goes: the client's TTFT split into stages, per model, and a finding
when one stage grows against its own baseline ("KV hand-off mean 3.1x its baseline").

Each stage is a mean over one window, from the histogram that measures it:

- ``router``: measured by the P/D router or proxy (client scope, ``CLIENT_STAGE``): its own
  work (``proxy``), the prefill leg and the decode leg up to the first token;
- ``engine``: measured inside the engines (``REQUEST_QUEUE`` / ``REQUEST_PREFILL`` of each pool,
  ``KV_XFER_DURATION`` on the decode pool where the connector reports transfers, i.e. NIXL);
- ``derived``: a router leg minus the engine stages inside it -- the API server around each
  engine (HTTP, tokenisation, detokenisation, the response). Marked, never passed off as measured.

The KV hand-off is the decode side's wait for remote KV. With NIXL, vLLM counts that wait in the
decode request's queue time, so the decode queue stage is the queue time minus the transfer
mean. Synchronous connectors (ExampleConnector, LMCache in-line) load the KV inside the first
decode step and report no transfers: the hand-off is then inside ``first_decode_step`` and the
breakdown says so.

When no router reports the client scope, the client TTFT is *estimated* as the sum of the
engine stages, flagged ``estimated`` (it leaves out every second outside the engines).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from fastapi import APIRouter, HTTPException

from exporters import contract as c
from sla_guard.config import GuardConfig, Indicator, Objective, parse_duration
from sla_guard.detect.findings import FindingsBook
from sla_guard.model import MetricsView

DETECTOR = "ttft_stage"
# A stage's baseline is frozen from the first window with this many client (or engine) requests:
# a baseline that keeps learning would absorb the slow growth the finding is for.
MIN_REQUESTS = 20.0
GROWTH_OPEN = 2.0  # open at 2x the baseline mean ...
GROWTH_RESOLVE = 1.5  # ... resolve below 1.5x (hysteresis: no flapping at the edge)
MIN_DELTA_S = 0.020  # and only if the stage grew by at least this much (and 5% of the SLA)


@dataclass(frozen=True, slots=True)
class StageDef:
    name: str
    title: str
    source: str  # router | engine | derived


STAGES: tuple[StageDef, ...] = (
    StageDef("proxy", "router / proxy", "router"),
    StageDef("prefill_server", "prefill API server (HTTP, tokenisation)", "derived"),
    StageDef("prefill_queue", "prefill queue", "engine"),
    StageDef("prefill_compute", "prefill compute", "engine"),
    StageDef("kv_handoff", "KV hand-off (decode waits for remote KV)", "engine"),
    StageDef("decode_queue", "decode queue", "engine"),
    StageDef("first_decode_step", "first decode step", "engine"),
    StageDef("decode_server", "decode API server (HTTP, first chunk)", "derived"),
    StageDef("outside_engines", "outside the engines (router, network, API servers)", "derived"),
)
TITLE = {s.name: s.title for s in STAGES}
SOURCE = {s.name: s.source for s in STAGES}


@dataclass(slots=True)
class Stage:
    stage: str
    seconds: float
    source: str
    share: float | None = None  # of the client TTFT (measured or estimated)
    requests: float | None = None


@dataclass(slots=True)
class Breakdown:
    model: str
    window: str
    client_ttft_s: float | None  # measured by a router; None without client scope
    client_requests: float | None
    estimated: bool  # True: no router measures this model; ttft_s is the sum of engine stages
    ttft_s: float | None  # the TTFT the shares are of: measured, else estimated
    sum_of_stages_s: float
    sla_s: float | None
    stages: list[Stage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _means(view: MetricsView, metric: c.Metric, matchers: Mapping[str, str], w: float, now: float,
           by: tuple[str, ...]) -> dict[tuple, tuple[float, float]]:
    """{group values: (mean, count)} of a histogram over ``w``, groups with requests only."""
    sums = view.increase(metric.series("_sum"), matchers, w, now, by)
    counts = view.increase(metric.series("_count"), matchers, w, now, by)
    out = {}
    for lab, n in counts.items():
        s = sums.get(lab)
        if s is None or not (n > 0 and math.isfinite(n) and math.isfinite(s)):
            continue
        out[tuple(dict(lab).get(k, "") for k in by)] = (s / n, n)
    return out


def compute(view: MetricsView, now: float, window_s: float) -> dict[str, Breakdown]:
    """The breakdown of every model that has a prefill or decode pool or a client scope."""
    by = ("model",)
    client = _means(view, c.CLIENT_TTFT, {"pool": c.Pool.CLIENT}, window_s, now, by)
    legs = _means(view, c.CLIENT_STAGE, {"pool": c.Pool.CLIENT}, window_s, now, ("model", "stage"))
    eng = {
        "prefill_queue": _means(view, c.REQUEST_QUEUE, {"pool": c.Pool.PREFILL}, window_s, now, by),
        "prefill_compute": _means(view, c.REQUEST_PREFILL, {"pool": c.Pool.PREFILL}, window_s, now, by),
        "kv_handoff": _means(view, c.KV_XFER_DURATION, {"pool": c.Pool.DECODE}, window_s, now, by),
        "decode_queue": _means(view, c.REQUEST_QUEUE, {"pool": c.Pool.DECODE}, window_s, now, by),
        "first_decode_step": _means(view, c.REQUEST_PREFILL, {"pool": c.Pool.DECODE}, window_s, now, by),
    }
    models = {k[0] for k in client} | {k[0] for k in legs} | {k[0] for d in eng.values() for k in d}
    label = _fmt_window(window_s)
    return {m: _one(m, label, client.get((m,)), {s: v for (mm, s), v in legs.items() if mm == m},
                    {k: d.get((m,)) for k, d in eng.items()})
            for m in sorted(models)}


def _one(model: str, window: str, client: tuple[float, float] | None, legs: dict[str, tuple[float, float]],
         eng: dict[str, tuple[float, float] | None]) -> Breakdown:
    notes: list[str] = []
    stages: list[Stage] = []

    def add(name: str, value: float | None, n: float | None = None) -> None:
        if value is not None and math.isfinite(value):
            stages.append(Stage(name, value, SOURCE[name], None, n))

    def mean(k: str) -> float | None:
        v = eng.get(k)
        return None if v is None else v[0]

    kv = mean("kv_handoff")
    dq = mean("decode_queue")
    if kv is not None and dq is not None:
        dq = max(dq - kv, 0.0)  # with NIXL the decode queue time contains the remote-KV wait
    elif kv is None and mean("first_decode_step") is not None:
        notes.append("no KV transfers reported (synchronous connector): the KV hand-off is inside "
                     "first_decode_step")
    pre = [mean("prefill_queue"), mean("prefill_compute")]
    dec = [kv, dq, mean("first_decode_step")]
    have_legs = "prefill_leg" in legs and "decode_first_leg" in legs and "proxy" in legs
    if have_legs:
        add("proxy", legs["proxy"][0], legs["proxy"][1])
        add("prefill_server", legs["prefill_leg"][0] - sum(v for v in pre if v is not None))
    add("prefill_queue", pre[0], _n(eng, "prefill_queue"))
    add("prefill_compute", pre[1], _n(eng, "prefill_compute"))
    add("kv_handoff", kv, _n(eng, "kv_handoff"))
    add("decode_queue", dq, _n(eng, "decode_queue"))
    add("first_decode_step", dec[2], _n(eng, "first_decode_step"))
    if have_legs:
        add("decode_server", legs["decode_first_leg"][0] - sum(v for v in dec if v is not None))
    engine_sum = sum(s.seconds for s in stages if s.source == "engine")
    if client is not None and not have_legs:
        add("outside_engines", client[0] - engine_sum)
        notes.append("the router reports no TTFT stages: outside_engines is the client TTFT minus the engine stages")
    total = sum(s.seconds for s in stages)
    estimated = client is None
    ttft = client[0] if client is not None else (engine_sum if stages else None)
    if estimated and stages:
        notes.append("no router reports this model's client scope: the TTFT is ESTIMATED as the sum of the "
                     "engine stages and leaves out every second outside the engines")
    if any(s.seconds < 0 for s in stages):
        notes.append("a derived stage is negative: the router and the engines disagree on this window "
                     "(different requests, or clocks)")
    if ttft:
        for s in stages:
            s.share = s.seconds / ttft
    return Breakdown(model, window, None if client is None else client[0], None if client is None else client[1],
                     estimated, ttft, total, None, stages, notes)


def _n(eng: dict[str, tuple[float, float] | None], k: str) -> float | None:
    v = eng.get(k)
    return None if v is None else v[1]


def _fmt_window(seconds: float) -> str:
    for unit, n in (("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms" if abs(s) < 1 else f"{s:.2f} s"


class StageBreakdownEvaluator:
    """Evaluator: the breakdown every tick (served at ``/v1/ttft-breakdown``) and a
    ``ttft_stage`` finding per (model, stage) that grew ``GROWTH_OPEN``x over its frozen baseline."""

    name = "ttft_breakdown"

    def __init__(self, config: GuardConfig, book: FindingsBook | None = None) -> None:
        self.config = config
        self.book = book
        self.window_s = _client_window(config)
        self.latest: dict[str, Breakdown] = {}
        self.baseline: dict[str, dict[str, float]] = {}  # model -> stage -> frozen mean
        self.evaluated_at: float | None = None
        self._dirty = True

    def evaluate(self, view: MetricsView, now: float) -> None:
        out = compute(view, now, self.window_s)
        for m, b in out.items():
            b.sla_s = _client_sla(self.config, m)
        self.latest = out
        self.evaluated_at = now
        if self.book is not None:
            self._findings(now)

    def _findings(self, now: float) -> None:
        active = []
        for m, b in self.latest.items():
            ref = self.baseline.get(m)
            enough = (b.client_requests or 0) >= MIN_REQUESTS or (b.estimated and all(
                (s.requests or 0) >= MIN_REQUESTS for s in b.stages if s.source == "engine"))
            if ref is None:
                if enough and b.stages:
                    self.baseline[m] = {s.stage: s.seconds for s in b.stages}
                    self._dirty = True
                continue
            if not enough:  # too few requests to judge: keep what is open as it is
                active += [f"{DETECTOR}/{m}/{s}" for s in ref if self._open(f"{DETECTOR}/{m}/{s}")]
                continue
            floor = max(MIN_DELTA_S, 0.05 * (b.sla_s or 0.0))
            for s in b.stages:
                base = ref.get(s.stage)
                if base is None or base <= 0:
                    continue
                key = f"{DETECTOR}/{m}/{s.stage}"
                ratio = s.seconds / base
                grown = ratio >= GROWTH_OPEN and s.seconds - base >= floor
                held = self._open(key) and ratio >= GROWTH_RESOLVE
                if not (grown or held):
                    continue
                active.append(key)
                share = f", {s.share:.0%} of the client's TTFT" if s.share is not None else ""
                self.book.raise_(
                    DETECTOR, key, "warning",
                    f"{TITLE[s.stage]} mean {ratio:.1f}x its baseline ({_ms(base)} -> {_ms(s.seconds)}){share}",
                    {"model": m, "pool": c.Pool.CLIENT.value, "stage": s.stage},
                    {"baseline_s": base, "current_s": s.seconds, "ratio": ratio, "source": s.source,
                     "window": b.window, "ttft_s": b.ttft_s, "estimated": str(b.estimated).lower()}, now)
        self.book.sync(DETECTOR, active, now)

    def _open(self, key: str) -> bool:
        return self.book is not None and any(f.key == key for f in self.book.open_findings())

    def snapshot(self) -> dict:
        return {"evaluated_at": self.evaluated_at, "window": _fmt_window(self.window_s),
                "models": [asdict(b) for b in self.latest.values()], "baseline": self.baseline}

    # -- crash-safe state: the frozen baselines (sla_guard.state) --------------------------------
    def state_dump(self, full: bool) -> dict:
        if not (full or self._dirty):
            return {}
        self._dirty = False
        return {"baseline": self.baseline}

    def state_load(self, parts: dict, records: list[dict]) -> None:
        base = parts.get("baseline") or {}
        self.baseline = {str(m): {str(k): float(v) for k, v in d.items()} for m, d in base.items()}


def _client_window(config: GuardConfig) -> float:
    """The window of the client TTFT mean objective (the SLA the breakdown explains), else 5 m."""
    for s in config.slos_for("*", c.Pool.CLIENT.value):
        if s.indicator is Indicator.TTFT and s.objective is Objective.MEAN:
            return parse_duration(s.window)
    return 300.0


def _client_sla(config: GuardConfig, model: str) -> float | None:
    ttft = [s.threshold_s for s in config.slos_for(model, c.Pool.CLIENT.value)
            if s.indicator is Indicator.TTFT and s.objective is Objective.MEAN]
    return min(ttft) if ttft else None


def router(ev: StageBreakdownEvaluator) -> APIRouter:
    """``GET /v1/ttft-breakdown?model=``: where each model's client TTFT went, stage by stage."""
    r = APIRouter(tags=["slo"])

    @r.get("/v1/ttft-breakdown")
    def breakdown(model: str | None = None) -> dict:
        snap = ev.snapshot()
        if model is not None:
            snap["models"] = [b for b in snap["models"] if b["model"] == model]
            if not snap["models"]:
                raise HTTPException(404, f"no breakdown for model {model!r} (no client scope or pool data)")
        return snap

    return r
