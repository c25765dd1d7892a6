"""Tunables of the generated rules and the one place alerts get their annotations.

``time_scale`` multiplies every range window and ``for`` duration in the generated PromQL while
recording-rule names keep the nominal window (``...:ratio_rate1h``). The committed rules use 1;
the end-to-end test generates a copy with 1/60 so a one-hour burn window is one minute and an
injected fault fires within seconds against a real Prometheus, through the same generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sla_guard.config import AlertmanagerSettings, parse_duration

RUNBOOK_DOC = "docs/runbooks.md"


def fmt_duration(seconds: float) -> str:
    """Seconds as a Prometheus duration, largest exact unit first ('90s' -> '90s', 3600 -> '1h')."""
    s = max(1, round(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"


@dataclass(frozen=True)
class RuleParams:
    time_scale: float = 1.0
    runbook_base_url: str = field(default_factory=lambda: AlertmanagerSettings().runbook_base_url)
    guard_job: str = "sla-guard"
    slo_for: str = "2m"
    # A pool whose SLI series all vanished (deployment deleted or relabelled, every scrape failing):
    # flagged for this long after they were last seen, once gone for ``pool_absent_for``.
    pool_absent_window: str = "1d"
    pool_absent_for: str = "10m"
    # Speculative decoding: alert when the 1h acceptance falls this far below its own 1-day mean.
    acceptance_drop: float = 0.2
    acceptance_min_draft_tokens: int = 1000
    # KV transfer (NIXL): p99 per pool over 5m.
    kv_transfer_p99_s: float = 0.5
    kv_transfer_min_transfers: int = 10
    # KV saturation: usage above this while requests queue.
    kv_usage_high: float = 0.9
    # Host memory: growth of the RSS floor (minimum over 1h) across the window.
    rss_window: str = "6h"
    rss_floor_window: str = "1h"
    rss_growth_bytes: int = 256 * 1024 * 1024

    def window(self, nominal: str) -> str:
        """A range window or ``for`` duration after ``time_scale``."""
        secs = parse_duration(nominal)
        return "0s" if secs == 0 else fmt_duration(secs * self.time_scale)

    def runbook(self, anchor: str) -> str:
        return f"{self.runbook_base_url}#{anchor}"

    def alert(self, name: str, expr: str, severity: str, *, for_: str, summary: str, description: str,
              runbook: str, labels: dict[str, str] | None = None) -> dict:
        rule: dict = {"alert": name, "expr": expr}
        if parse_duration(for_) > 0:
            rule["for"] = self.window(for_)
        rule["labels"] = {"severity": severity, **(labels or {})}
        rule["annotations"] = {"summary": summary, "description": description,
                               "runbook_url": self.runbook(runbook)}
        return rule
