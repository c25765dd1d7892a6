"""The one multi-window, multi-burn-rate table: the guard (``sla_guard/slo.py``) and the rules it
generates (``alerts/slo_rules.py``) both read ``burn_rules(period)``, so for any SLO period they
alert on the same windows, factors and severities.

Source: Google SRE workbook, "Alerting on SLOs", section 6 "Multiwindow, multi-burn-rate alerts"
and its table of recommended parameters (https://sre.google/workbook/alerting-on-slos/): page when
2% of the budget goes in 1h (short window 5m) or 5% in 6h (30m); open a ticket when 10% goes in 1d
(2h) or 10% in 3d (6h). Sloth (https://github.com/slok/sloth, its default window sets
``google-30d.yaml`` and ``google-28d.yaml``) keeps these windows and budget shares for any period
and derives the factor from the period, as here::

    factor = budget share x period / long window
    30d: 14.4, 6, 3, 1     28d: 13.44, 5.6, 2.8, 0.933333     7d: 3.36, 1.4, 0.7, 0.233333

Windows stay fixed (the ones the workbook tuned detection time and reset time for); only the
factor follows the period. For short periods the ticket factors fall below 1: they then fire at a
rate the period's budget would survive, which is what "10% of the budget in 1d" means there.

A row whose long window is longer than the period is dropped (a 1d period keeps three rows, 6h
two, under 1h none): it would read data older than the budget it guards, and capping its window
at the period would only repeat the error-budget verdict over the period with a factor below the
budget share. The budget remaining over the period still gives a verdict when no row is left.

Severity is one vocabulary everywhere: ``critical`` (the workbook's page) and ``warning`` (its
ticket), the ``severity`` label Alertmanager routes on (alerts/alertmanager.yml), also used by
the detectors' findings. In the guard a firing critical row makes an objective violated, a firing
warning row at risk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sla_guard.config import parse_duration

Severity = Literal["critical", "warning"]
PAGE: Severity = "critical"
TICKET: Severity = "warning"


@dataclass(frozen=True, slots=True)
class BurnWindow:
    """One row of the table, independent of the period."""

    long: str
    short: str
    budget_fraction: float
    severity: Severity


BURN_WINDOWS: tuple[BurnWindow, ...] = (
    BurnWindow("1h", "5m", 0.02, PAGE),
    BurnWindow("6h", "30m", 0.05, PAGE),
    BurnWindow("1d", "2h", 0.10, TICKET),
    BurnWindow("3d", "6h", 0.10, TICKET),
)


@dataclass(frozen=True, slots=True)
class BurnRule:
    """A row resolved for one period: alert when both windows burn faster than ``factor``."""

    long: str
    short: str
    long_s: float
    short_s: float
    budget_fraction: float
    factor: float
    severity: Severity


def burn_factor(budget_fraction: float, period_s: float, long_s: float) -> float:
    """Burn rate that spends ``budget_fraction`` of the period's budget within ``long_s``; rounded
    so the guard's comparison and the rule's PromQL literal are the same number."""
    return round(budget_fraction * period_s / long_s, 6)


def burn_rules(period_s: float) -> tuple[BurnRule, ...]:
    """The table's rows for an SLO period (seconds), rows longer than the period dropped."""
    out = []
    for row in BURN_WINDOWS:
        long_s, short_s = parse_duration(row.long), parse_duration(row.short)
        if long_s > period_s:
            continue
        out.append(BurnRule(row.long, row.short, long_s, short_s, row.budget_fraction,
                            burn_factor(row.budget_fraction, period_s, long_s), row.severity))
    return tuple(out)


def burn_windows(period_s: float) -> list[float]:
    """Every window (seconds) the rows of a period read, shortest first."""
    return sorted({w for r in burn_rules(period_s) for w in (r.long_s, r.short_s)})


__all__ = ["BURN_WINDOWS", "PAGE", "TICKET", "BurnRule", "BurnWindow", "Severity", "burn_factor", "burn_rules",
           "burn_windows"]
