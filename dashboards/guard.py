"""The guard: findings, desired vs actual replicas, burn rates, error budget left, its own health."""

from __future__ import annotations

from dashboards.common import GUARD_SEL, RATE, Panels, dashboard, guard_reporting, guards, q, value_map
from exporters import contract as c
from exporters import promql as pq
from sla_guard.config import GuardConfig

UID = "sla-guard-guard"


def open_findings(matchers: tuple[str, ...]) -> str:
    """Open findings per detector and severity, or one "none open" 0 while the guard reports: the
    guard exports a detector's gauge only once it had a finding, so a guard with none and a guard
    that is down both read empty, and "No data" said neither."""
    none = f'label_replace(0 * {guards()}, "detector", "none open", "", "")'
    return f"{pq.sum_by(['detector', 'severity'], pq.series(c.GUARD_FINDINGS, matchers=matchers))} or on () {none}"


def build(config: GuardConfig) -> dict:
    g = GUARD_SEL

    def panels(p: Panels) -> None:
        p.row("Findings and SLOs")
        p.stat("Open findings", "Open findings by detector and severity; \"none open\" (0) while the guard "
               "reports and has none for this selection, empty when the guard is not reporting.",
               [q(open_findings(g), "{{detector}} {{severity}}", instant=True)], w=8, thresholds=[1],
               no_value="Guard not reporting")
        p.ts("Findings opened", "Findings opened per hour by detector.",
             [q(pq.sum_by(["pool", "detector"], pq.increase(c.GUARD_FINDINGS_TOTAL, "1h", matchers=g)),
                "{{pool}} {{detector}}")], w=16)
        p.ts("Burn rate", "Error-budget burn rate per SLO and window (1 = budget used exactly over the period).",
             [q(pq.series(c.GUARD_BURN_RATE, matchers=g), "{{pool}} {{slo}} {{window}}")], w=8, sla=[1])
        p.ts("Error budget left", "Share of each SLO's error budget left in its period.",
             [q(pq.series(c.GUARD_BUDGET_REMAINING, matchers=g), "{{pool}} {{slo}}")], "percentunit", w=8)
        p.ts("SLO indicator value", "Current value of each SLO's indicator (seconds or ratio).",
             [q(pq.series(c.GUARD_SLO_VALUE, matchers=g), "{{pool}} {{slo}}")], w=8)
        p.row("Replicas")
        p.ts("Desired vs current replicas", "Replicas the advisor recommends and replicas serving, per pool.",
             [q(pq.series(c.GUARD_DESIRED_REPLICAS, matchers=g), "{{model}} {{pool}} desired"),
              q(pq.series(c.GUARD_CURRENT_REPLICAS, matchers=g), "{{model}} {{pool}} current")], w=12)
        p.ts("Scaling decisions", "Advisor decisions per hour by direction and reason.",
             [q(pq.sum_by(["pool", "direction", "reason"], pq.increase(c.GUARD_SCALING_DECISIONS, "1h", matchers=g)),
                "{{pool}} {{direction}} {{reason}}")], w=12)
        p.row("Guard health")
        p.stat("Guard reporting", "Guard processes with a current sample; 0 (red) when the guard is down or "
               "not scraped: every other panel here is then empty or ends.",
               [q(guard_reporting(), "guards", instant=True)], w=24, h=3, up=True,
               mappings=[value_map("0", "guard not reporting", "red")])
        p.ts("Evaluation time", "Time one evaluation tick takes: p50 and p99.",
             [q(pq.quantile(x, c.GUARD_EVAL_DURATION, RATE, ["instance"]), f"{{{{instance}}}} p{x * 100:g}")
              for x in (0.5, 0.99)], "s", w=8)
        p.ts("Targets up", "1 if the guard's last scrape of an engine target succeeded.",
             [q(pq.series(c.GUARD_TARGET_UP, matchers=g), "{{pool}} {{target}}")], w=8)
        p.ts("Errors", "Ingestion errors, failed Alertmanager pushes, evaluator exceptions and failed "
             "scaling actions per second.",
             [q(pq.sum_by(["kind"], pq.rate(c.GUARD_SCRAPE_ERRORS, RATE)), "scrape {{kind}}"),
              q(pq.sum_by(["reason"], pq.rate(c.GUARD_ALERT_PUSH_ERRORS, RATE)), "alertmanager {{reason}}"),
              q(pq.sum_by(["evaluator"], pq.rate(c.GUARD_EVALUATOR_ERRORS, RATE)), "evaluator {{evaluator}}"),
              q(pq.sum_by(["actuator"], pq.rate(c.GUARD_ACTUATION_ERRORS, RATE, matchers=g)),
                "actuator {{actuator}}")], "ops", w=8)
        p.ts("Store", "Series held in the guard's store and bytes of its arrays.",
             [q(pq.series(c.GUARD_SERIES), "{{instance}} series"),
              q(pq.series(c.GUARD_STORE_BYTES), "{{instance}} bytes")], w=24)

    return dashboard(UID, "sla-guard / Guard", "The guard service: findings, replicas, burn rates, health.", panels)
