"""The dashboards under faults, read through a REAL Prometheus: an operator looks at these panels
during an incident, so a panel must never show a reassuring value where the truth is "no data".

Two hours of a small fleet are backfilled (``promtool tsdb create-blocks-from openmetrics``) and
every panel query is evaluated as Grafana sends it ($model, $pool, $instance, $__rate_interval
and $__range substituted the way Grafana does for a 15 s scrape interval and the default 1 h
range). Each model is one fault, the last 30 minutes of the history:

- ``a``: the decode engines are gone (no samples), the prefill engine is up and idle;
- ``b``: one decode engine restarts (its counters start again) 20 minutes before the end;
- ``c``: the prefill API server refuses as many requests (HTTP 503) as it serves;
- ``u``: the prefill engine is upgraded in place to a bucket set with the 2.5 s TTFT threshold
  105 s before the end (a restart; the bucket appears mid-window);
- ``p``: the P/D proxy fails 1 in 4 of the requests it answers or fails (and as many again are the
  clients' own 4xx and aborts), then is gone (its series end);
- ``q``: the proxy serves without a failure, then gets no traffic (its counters stand still);
- the guard's own series end 30 minutes before the end (the guard is down).
"""

from __future__ import annotations

import json
import math
import time

import pytest
from prometheus_support import PrometheusProcess, backfilled, prometheus_binary

from dashboards.generate import render_dashboards
from exporters import contract as c

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)"),
]

STEP = 15  # seconds between scrapes; Grafana's $__rate_interval is then max(4 * 15 s, step + 15 s)
N = 2 * 3600 // STEP  # scrapes in the history
FAULT = 30 * 60 // STEP  # the last 30 minutes
TTFT_OLD = ("0.1", "5.0")  # before the upgrade: no 2.5 s bucket
TTFT_NEW = ("0.1", "2.5", "5.0")
TPOT_BOUNDS = ("0.01", "0.02", "0.05")


class History:
    """OpenMetrics text of the fleet: each family's samples grouped, each series in time order."""

    def __init__(self, base: float) -> None:
        self.t = [base + STEP * i for i in range(N)]
        self.families: dict[str, tuple[str, dict[str, list[str]]]] = {}

    def add(self, family: str, kind: str, name: str, labels: str, values: list[tuple[int, float]]) -> None:
        """``values``: (scrape index, value) pairs."""
        series = self.families.setdefault(family, (kind, {}))[1]
        series.setdefault(f"{name}{{{labels}}}", []).extend(f"{v:g} {self.t[i]:.0f}" for i, v in values)

    def histogram(self, m: c.Metric, labels: str, idx: list[int], n: list[int], took: float,
                  bounds: tuple[str, ...]) -> None:
        """``n[k]`` requests so far at scrape ``idx[k]``, every one ``took`` seconds."""
        for le in (*bounds, "+Inf"):
            self.add(m.name, "histogram", m.series("_bucket"), f'{labels},le="{le}"',
                     [(i, k if took <= float(le) else 0) for i, k in zip(idx, n, strict=True)])
        self.add(m.name, "histogram", m.series("_count"), labels, list(zip(idx, n, strict=True)))
        self.add(m.name, "histogram", m.series("_sum"), labels, [(i, k * took) for i, k in zip(idx, n, strict=True)])

    def gauge(self, m: c.Metric, labels: str, idx: list[int], value: float) -> None:
        self.add(m.name, "gauge", m.series(), labels, [(i, value) for i in idx])

    def counter(self, m: c.Metric, labels: str, idx: list[int], n: list[int]) -> None:
        self.add(m.name, "counter", m.series(), labels, list(zip(idx, n, strict=True)))

    def text(self) -> str:
        out = []
        for family, (kind, series) in self.families.items():
            out.append(f"# TYPE {family} {kind}")
            out += [f"{k} {p}" for k, ps in series.items() for p in ps]
        return "\n".join([*out, "# EOF", ""])


def _engine(h: History, model: str, pool: str, inst: str, idx: list[int], n: list[int], ttft: float = 0.1,
            tpot: float = 0.015, ttft_bounds: tuple[str, ...] = TTFT_NEW) -> None:
    lab = f'instance="{inst}",job="engines",model="{model}",pool="{pool}",engine="0"'
    h.gauge(c.REQUESTS_RUNNING, lab, idx, 1)
    h.histogram(c.REQUEST_TTFT, lab, idx, n, ttft, ttft_bounds)
    h.histogram(c.REQUEST_TPOT, lab, idx, n, tpot, TPOT_BOUNDS)


def fleet(base: float) -> str:
    h = History(base)
    every, early, late = list(range(N)), list(range(N - FAULT)), list(range(N - FAULT, N))
    served = [2 * (i + 1) for i in every]
    # a: decode engines gone for the last 30 min; the prefill engine up, serving nothing since then
    for inst in ("a-d0", "a-d1"):
        _engine(h, "a", "decode", inst, early, served[: N - FAULT])
    _engine(h, "a", "prefill", "a-p0", every, [served[min(i, N - FAULT - 1)] for i in every])
    # b: a decode engine restarts 20 min before the end (its counters start again), another does not
    restart = N - 20 * 60 // STEP
    _engine(h, "b", "decode", "b-d0", every, [2 * (i + 1) if i < restart else 2 * (i - restart + 1) for i in every])
    _engine(h, "b", "decode", "b-d1", every, served)
    # c: the prefill API server refuses (503) as many requests as it serves, the last 30 min
    _engine(h, "c", "prefill", "c-p0", every, served)
    lab = 'instance="c-p0",job="engines",model="c",pool="prefill",engine="0",reason="max_num_queued_reqs"'
    h.counter(c.ADMISSION_REJECTIONS, lab, every, [0 if i < N - FAULT else 2 * (i - N + FAULT + 1) for i in every])
    # u: upgraded in place (a restart) 105 s before the end to a bucket set with the 2.5 s threshold
    up = N - 7  # 105 s before the end
    _engine(h, "u", "prefill", "u-p0", list(range(up)), served[:up], ttft_bounds=TTFT_OLD)
    _engine(h, "u", "prefill", "u-p0", list(range(up, N)), [2 * (i - up + 1) for i in range(up, N)])
    # p: a proxy failing 1 in 4 of its ok + error requests, gone for the last 30 min; q: one with
    # no failure (its error series exists at 0, as the proxy makes it), idle for the last 30 min
    proxy = 'instance="px:8000",job="proxy",pool="client",route="pd",router="px"'
    for outcome, per_scrape in (("ok", 3), ("error", 1), ("client_error", 4), ("aborted", 4)):
        h.counter(c.CLIENT_REQUESTS, f'{proxy},model="p",outcome="{outcome}"', early,
                  [per_scrape * (i + 1) for i in early])
    for outcome, per_scrape in (("ok", 2), ("error", 0)):
        h.counter(c.CLIENT_REQUESTS, f'{proxy},model="q",outcome="{outcome}"', every,
                  [per_scrape * (min(i, N - FAULT - 1) + 1) for i in every])
    # the guard: its own series end 30 min before the end
    g = 'instance="guard:9400",job="sla-guard"'
    h.gauge(c.GUARD_SERIES, g, early, 1234)
    for model, pool in (("a", "decode"), ("a", "prefill")):
        gl = f'{g},model="{model}",pool="{pool}"'
        for status in ("ok", "at_risk", "violated", "unknown"):
            h.gauge(c.GUARD_SLO_STATUS, f'{gl},slo="ttft_mean",status="{status}"', early, status == "ok")
        h.gauge(c.GUARD_FINDINGS, f'{gl},detector="kv_thrash",severity="warning"', early, 0)
        h.gauge(c.GUARD_GOODPUT, gl, early, 0.97)
    del late
    return h.text()


GRAFANA = {"$__rate_interval": "1m", "$__range": "3600s", "${__range}": "3600s"}


def grafana_expr(expr: str, model: str, pool: str = "All") -> str:
    """``expr`` as Grafana sends it: All is the variables' allValue ``.*``."""
    for k, v in GRAFANA.items():
        expr = expr.replace(k, v)
    expr = expr.replace("$model", model).replace("$pool", ".*" if pool == "All" else pool)
    return expr.replace("$instance", ".*")


def panel(uid: str, title: str) -> dict:
    board = json.loads(render_dashboards()[f"{uid}.json"])
    return next(p for p in board["panels"] if p["title"] == title)


@pytest.fixture(scope="module")
def prom():
    base = float(int(time.time()) - 12 * 3600)  # Prometheus takes the backfill as history
    with backfilled(fleet(base)) as p:
        p.end = base + STEP * (N - 1)  # type: ignore[attr-defined]
        yield p


def values(prom: PrometheusProcess, expr: str, at: float, by: str = "pool") -> dict[str, float]:
    return {r["metric"].get(by, ""): float(r["value"][1]) for r in prom.query(expr, at)}


def shown(prom: PrometheusProcess, p: dict, model: str, at: float, pool: str = "All",
          by: tuple[str, ...] = ("pool",)) -> dict[str, float]:
    """The instant value of each series of panel ``p``'s queries, by legend-ish key."""
    out = {}
    for t in p["targets"]:
        for r in prom.query(grafana_expr(t["expr"], model, pool), at):
            out[" ".join(r["metric"].get(b, "") for b in by).strip()] = float(r["value"][1])
    return out


def test_goodput_share_counts_refused_requests(prom):
    """The Goodput panel's TTFT line left out the requests the API server refused (HTTP 503 at a
    queue limit): a prefill pool refusing as many requests as it served read 100 % within the
    TTFT threshold while the guard and the rules count every refused request as a miss (50 %).
    Each fault's value, over a real Prometheus: refused -> 0.5; restart -> 1 (every request in
    time); idle -> NaN (0/0, a gap, never 1); engines gone -> nothing; threshold bucket appeared
    within the rate window -> nothing (the coverage check), never the low share an uncovered window reads."""
    targets = [t for t in panel("sla-guard-pd-overview", "Goodput")["targets"] if 'le="2.5"' in t["expr"]]
    assert len(targets) == 1
    line = {"targets": targets}
    assert shown(prom, line, "c", prom.end) == {"prefill": pytest.approx(0.5)}
    assert shown(prom, line, "c", prom.end - 2400) == {"prefill": pytest.approx(1.0)}  # before the refusals
    assert shown(prom, line, "b", prom.end) == {"decode": pytest.approx(1.0)}
    idle = shown(prom, line, "a", prom.end)
    assert list(idle) == ["prefill"] and math.isnan(idle["prefill"])
    upgraded = prom.end - 7 * STEP  # the first scrape with the 2.5 s bucket
    assert shown(prom, line, "u", prom.end - 2400) == {}  # no such bucket yet: no line, not 0 %
    assert shown(prom, line, "u", upgraded + 30) == {}  # bucket for half the 1m window: left out
    assert shown(prom, line, "u", prom.end) == {"prefill": pytest.approx(1.0)}  # covered again


def test_an_idle_pool_and_a_pool_whose_engines_are_gone_read_differently(prom):
    """Model ``a``: prefill up and idle, decode's engines gone, the last 30 minutes. The mean
    stats read NaN for the idle pool, which Grafana drew as "NaN" (or an empty tile) in the base
    threshold colour, green, and the silent pool just vanished from them, no different from a pool
    never deployed. Now NaN maps to "no requests" in blue, and Engines reporting reads 0 (red) for
    the silent pool and 1 for the idle one."""
    for title in ("Mean TTFT (5m) per pool", "Mean TPOT (5m) per pool"):
        p = panel("sla-guard-pd-overview", title)
        got = shown(prom, p, "a", prom.end)
        assert list(got) == ["prefill"] and math.isnan(got["prefill"]), got
        assert shown(prom, p, "a", prom.end - 2400).keys() == {"prefill", "decode"}
        mapped = [m["options"]["result"] for m in p["fieldConfig"]["defaults"]["mappings"]
                  if m["type"] == "special" and m["options"]["match"] == "null+nan"]
        assert mapped == [{"text": "no requests", "color": "blue"}], title
        assert p["fieldConfig"]["defaults"]["noValue"]
    up = panel("sla-guard-pd-overview", "Engines reporting")
    assert shown(prom, up, "a", prom.end) == {"decode": 0, "prefill": 1}
    assert shown(prom, up, "a", prom.end - 2400) == {"decode": 2, "prefill": 1}
    assert shown(prom, up, "b", prom.end) == {"decode": 2}  # a restart is no outage
    steps = up["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps == [{"color": "red", "value": None}, {"color": "green", "value": 1}]


def test_client_error_ratio_reads_failed_requests_and_nothing_for_a_proxy_gone_or_idle(prom):
    """The client scope had no error ratio: an operator read failed requests off "Client requests by
    outcome" by eye. *Client error ratio* is error / (ok + error) per model (the availability SLI,
    ``exporters.promql.outcome_ratio``, as the rules record it): 0.25 for model ``p`` (the clients' own
    4xx and aborts, as many again, count in neither part: 1/8 or 1/12 otherwise), 0 for ``q`` (no
    failure). Then ``p``'s proxy is gone: nothing, not 0 % errors; ``q`` is idle: NaN (0/0, a gap)."""
    p = panel("sla-guard-pd-overview", "Client error ratio")
    assert p["fieldConfig"]["defaults"]["unit"] == "percentunit"
    by = ("model",)
    assert shown(prom, p, ".*", prom.end - 2400, by=by) == {"p": pytest.approx(0.25), "q": 0}
    assert shown(prom, p, "p", prom.end, by=by) == {}
    idle = shown(prom, p, ".*", prom.end, by=by)
    assert list(idle) == ["q"] and math.isnan(idle["q"])


def test_guard_panels_tell_a_guard_down_from_a_guard_with_nothing_to_say(prom):
    """The guard's series end 30 minutes before the end. Open findings read "No data" both while
    the guard was down and while it was up with no finding yet for the selection (the guard
    exports a detector's gauge only after its first finding): now "none open" 0 while the guard
    reports, and "Guard not reporting" (noValue) when it does not; Guard reporting reads 0."""
    findings = panel("sla-guard-guard", "Open findings")
    by = ("detector", "severity")
    assert shown(prom, findings, "b", prom.end - 2400, by=by) == {"none open": 0}
    assert shown(prom, findings, "a", prom.end - 2400, by=by) == {"kv_thrash warning": 0}
    assert shown(prom, findings, "a", prom.end, by=by) == {}
    assert findings["fieldConfig"]["defaults"]["noValue"] == "Guard not reporting"
    status = panel("sla-guard-pd-overview", "SLO status (guard)")
    assert shown(prom, status, "a", prom.end) == {}
    assert "guard is not reporting" in status["fieldConfig"]["defaults"]["noValue"]
    for uid in ("sla-guard-pd-overview", "sla-guard-guard"):
        g = panel(uid, "Guard reporting")
        assert shown(prom, g, "a", prom.end, by=()) == {"": 0}
        assert shown(prom, g, "a", prom.end - 2400, by=()) == {"": 1}
        assert g["fieldConfig"]["defaults"]["mappings"] == [
            {"type": "value", "options": {"0": {"text": "guard not reporting", "color": "red"}}}]


def test_no_panel_reads_a_value_for_a_pool_whose_engines_are_gone(prom):
    """Every panel query of every dashboard for model ``a``, pool decode (engines gone 30 minutes,
    guard down), as an instant query at the end: nothing (Grafana: no data, a line that ends),
    except the two reporting panels, which read 0. No ``or vector(0)`` turns a gone pool into 0
    errors, no clamp into 100 %."""
    boards = [json.loads(t) for t in render_dashboards().values()]
    read = {}
    for b in boards:
        for p in b["panels"]:
            for t in p.get("targets", []):
                for r in prom.query(grafana_expr(t["expr"], "a", "decode"), prom.end):
                    read[(b["uid"], p["title"], t["refId"])] = float(r["value"][1])
    reporting = {k: v for k, v in read.items() if k[1] in ("Engines reporting", "Guard reporting")}
    assert reporting == {("sla-guard-pd-overview", "Engines reporting", "A"): 0,
                         ("sla-guard-pd-overview", "Guard reporting", "A"): 0,
                         ("sla-guard-guard", "Guard reporting", "A"): 0}
    assert {k: v for k, v in read.items() if k not in reporting} == {}
