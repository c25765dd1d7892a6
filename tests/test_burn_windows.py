"""One burn-window table for the guard and its generated alerts (issue 12, item 1): for any SLO
period the guard's verdicts and the Prometheus rules use the same (long window, short window,
factor, severity) rows, read here from both sides' real outputs: the evaluator's ``SLOResult``
and the rendered rule file."""

from __future__ import annotations

import re

import pytest
import yaml
from guard_support import Engine, drive

from alerts.generate import render_rules
from sla_guard.burn_windows import BURN_WINDOWS, burn_rules
from sla_guard.config import GuardConfig, parse_config, parse_duration
from sla_guard.model import Status
from sla_guard.slo import Ledger, SLOResult, _Plan, attainment_status, burn_alerts, fmt_window

TARGET = 0.99
Row = tuple[str, str, float, str]

# factor = budget share x period / long window (SRE workbook shares 2%, 5%, 10%, 10%)
EXPECTED: dict[str, list[Row]] = {
    "30d": [("1h", "5m", 14.4, "critical"), ("6h", "30m", 6.0, "critical"),
            ("1d", "2h", 3.0, "warning"), ("3d", "6h", 1.0, "warning")],
    "28d": [("1h", "5m", 13.44, "critical"), ("6h", "30m", 5.6, "critical"),
            ("1d", "2h", 2.8, "warning"), ("3d", "6h", 0.933333, "warning")],
    "7d": [("1h", "5m", 3.36, "critical"), ("6h", "30m", 1.4, "critical"),
           ("1d", "2h", 0.7, "warning"), ("3d", "6h", 0.233333, "warning")],
    "1d": [("1h", "5m", 0.48, "critical"), ("6h", "30m", 0.2, "critical"), ("1d", "2h", 0.1, "warning")],
    "30m": [],
}


def _config(period: str) -> dict:
    return {"evaluation_interval_s": 15, "staleness_s": 60,
            "slos": [{"objectives": [{"name": "ttft_att", "indicator": "ttft", "objective": "attainment",
                                      "threshold_s": 2.5, "target": TARGET, "period": period}]}]}


def _guard_result(period: str) -> SLOResult:
    """The evaluator's result for the attainment objective after a minute of traffic."""
    _, ev, _ = drive([Engine()], 60, lambda rng, e: [(0.2, 0.01)] * 3, cfg=parse_config(_config(period)))
    (res,) = ev.pools[("m", "decode")].slos
    return res


def _rule_rows(period: str) -> tuple[list[Row], set[str]]:
    """(long, short, factor, severity) of every generated burn alert, the windows from the PromQL and
    the factor from its literal (ratio limit / error budget); and the windows recorded."""
    text = render_rules(GuardConfig.model_validate(_config(period)))["slo.yaml"]
    rows: list[Row] = []
    recorded: set[str] = set()
    for g in yaml.safe_load(text)["groups"]:
        for r in g["rules"]:
            m = re.fullmatch(r"model_pool_slo:sli_error:ratio_rate(\w+)", r.get("record", ""))
            if m:
                recorded.add(m.group(1))
            if r.get("alert") != "SlaGuardErrorBudgetBurn":
                continue
            (long_w, lim_l), (short_w, lim_s) = re.findall(
                r"model_pool_slo:sli_error:ratio_rate(\w+)\{[^}]*\} > ([0-9.e+-]+)", r["expr"])
            assert lim_l == lim_s, r["expr"]
            assert (r["labels"]["long_window"], r["labels"]["short_window"]) == (long_w, short_w)
            rows.append((long_w, short_w, round(float(lim_l) / (1 - TARGET), 6), r["labels"]["severity"]))
    return rows, recorded


@pytest.mark.parametrize("period", ["7d", "28d", "30d", "1d", "30m"])
def test_guard_and_generated_rules_use_the_same_rows(period):
    res = _guard_result(period)
    guard_rows = [(a.long, a.short, a.factor, a.severity) for a in res.alerts]
    rule_rows, recorded = _rule_rows(period)
    assert guard_rows == rule_rows == EXPECTED[period]
    # the guard reads over exactly the windows the rules record, plus the period (the budget)
    assert set(res.burn_rates) == recorded | {fmt_window(parse_duration(period))}


def test_windows_stay_fixed_and_only_the_factor_follows_the_period():
    assert [(r.long, r.short) for r in burn_rules(30 * 86400)] == [(w.long, w.short) for w in BURN_WINDOWS]
    assert [(r.long, r.short) for r in burn_rules(7 * 86400)] == [(w.long, w.short) for w in BURN_WINDOWS]
    # a row whose long window exceeds the period is dropped, one equal to it kept
    assert [r.long for r in burn_rules(3 * 86400 - 1)] == ["1h", "6h", "1d"]
    assert [r.long for r in burn_rules(3 * 86400)] == ["1h", "6h", "1d", "3d"]
    assert burn_rules(3599) == ()


def test_guard_pages_a_7d_slo_above_3_36_over_1h_and_5m_and_not_below():
    """The workbook's fast page for a 7-day SLO: both 1h and 5m over 3.36x the allowed ratio.
    Before the shared table the guard read 14 min and 70 s windows against 14.4x."""
    period = 7 * 86400.0
    wins = {w: (0.0, 1000.0) for w in _Plan.burn_windows(period)}
    for burn, fires in ((3.4, True), (3.3, False)):
        errors = burn * (1 - TARGET) * 1000
        wins.update({3600.0: (errors, 1000.0), 300.0: (errors, 1000.0)})
        alerts = burn_alerts(wins, TARGET, period)
        page = next(a for a in alerts if (a.long, a.short) == ("1h", "5m"))
        assert page.firing is fires and page.severity == "critical"
        assert page.burn_long == pytest.approx(burn)
        assert attainment_status(0.9, alerts, 0.25) is (Status.VIOLATED if fires else Status.OK)
    # the long window alone is not enough
    wins[300.0] = (0.0, 1000.0)
    assert not any(a.firing for a in burn_alerts(wins, TARGET, period))


def test_ledger_serves_every_window_of_a_7d_period():
    """Fixed windows need up to 3 d of history for a 7-day SLO: the ledger's coarse tier spans the
    period, its fine tier the windows up to 6 h."""
    period = 7 * 86400.0
    led = Ledger(period)
    end = 4 * 86400
    for t in range(60, end + 1, 60):
        led.add(float(t), good=9.0, total=10.0)  # one add per minute: 10 requests, 1 error
    for w in _Plan.burn_windows(period):
        errors, total = led.window(float(end), w)
        expected = min(w, end) / 60 * 10
        # exact from the 1-min tier; within one 15-min bucket from the coarse one
        assert total == pytest.approx(expected, abs=0 if w <= 6 * 3600 else 150), fmt_window(w)
        assert errors / total == pytest.approx(0.1)



def test_a_quiet_short_window_pages_neither_the_guard_nor_the_rule():
    """The generated SlaGuardErrorBudgetBurn rule holds a traffic guard: the short window needs
    ``min_requests`` requests. A busy hour burning 16x (page threshold 14.4 for 30 days) that goes
    quiet, 1 slow request of 5 in the last 5 minutes: the rule stays silent; the guard paged
    ('violated') with 65 % of the budget left."""
    period = 30 * 86400.0
    wins = {w: (0.0, 1e6) for w in _Plan.burn_windows(period)}
    wins.update({3600.0: (3511.0, 21706.0), 300.0: (1.0, 5.0)})
    alerts = burn_alerts(wins, TARGET, period, min_requests=20)
    page = next(a for a in alerts if (a.long, a.short) == ("1h", "5m"))
    assert page.burn_long > page.factor and page.burn_short > page.factor
    assert not page.firing
    assert attainment_status(0.65, alerts, 0.25) is Status.OK
    wins[300.0] = (4.0, 20.0)  # enough requests in the short window: it pages
    assert next(a for a in burn_alerts(wins, TARGET, period, min_requests=20) if a.long == "1h").firing
    # the rule says the same: its short-window traffic guard is min_requests
    text = render_rules(GuardConfig.model_validate(_config("30d")))["slo.yaml"]
    page_rule = next(r for g in yaml.safe_load(text)["groups"] for r in g["rules"]
                     if r.get("alert") == "SlaGuardErrorBudgetBurn" and r["labels"]["short_window"] == "5m")
    assert re.search(r"model_pool_slo:sli_requests:rate5m\{[^}]*\} \* 300 >= 20", page_rule["expr"])


def test_the_evaluator_applies_the_short_window_traffic_guard():
    """End to end through the ledger: the objective's ``min_requests`` (20) reaches the burn
    verdicts. 5 busy minutes (a third of the requests slow), then 5 quiet ones: 10 slow requests."""
    steps = iter(range(10_000))

    def traffic(rng, e):
        i = next(steps)
        return [(9.0, 0.01), (0.2, 0.01), (0.2, 0.01)] if i < 60 else [(9.0, 0.01)] * (i % 6 == 0)

    _, ev, _ = drive([Engine()], 600, traffic, cfg=parse_config(_config("30d")))
    (res,) = ev.pools[("m", "decode")].slos
    page = next(a for a in res.alerts if (a.long, a.short) == ("1h", "5m"))
    assert page.burn_long > page.factor and page.burn_short > page.factor
    assert not page.firing  # 10 requests in the last 5 minutes, fewer than min_requests
