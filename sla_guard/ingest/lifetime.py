"""A view that reads counters as "increase since the engine started".

``sla-guard check`` with the embedded scraper has no history: one scrape cannot give a
Prometheus-style window. Every counter, though, is already the total since its process started,
so a one-shot check judges the engines' lifetime instead and says so ("since engine start")
rather than reporting "unknown" for lack of a window. Only for that one-shot use.
"""

from __future__ import annotations

from collections.abc import Mapping

from sla_guard import promql
from sla_guard.model import Labels, Series
from sla_guard.store import SeriesStore


class LifetimeView:
    """``MetricsView`` over one scrape: every window is the engine's lifetime."""

    serves_long_windows = True
    window_label = "since engine start"
    last_error = None

    def __init__(self, store: SeriesStore) -> None:
        self.store = store

    def instant(self, metric: str, matchers: Mapping[str, str], at: float) -> dict[Labels, float]:
        return self.store.instant(metric, matchers, at)

    def range(self, metric: str, matchers: Mapping[str, str], start: float, end: float) -> list[Series]:
        return self.store.range(metric, matchers, start, end)

    def increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                 by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """sum by (by) of each counter's current value (its increase since process start)."""
        out: dict[Labels, float] = {}
        for lab, v in self.store.instant(metric, matchers, at).items():
            d = dict(lab)
            key = tuple(sorted((k, d[k]) for k in by if d.get(k)))
            out[key] = out.get(key, 0.0) + v
        return out

    def counter_delta(self, metric: str, matchers: Mapping[str, str], t0: float, t1: float,
                      by: tuple[str, ...] = ()) -> dict[Labels, float]:
        return self.increase(metric, matchers, t1 - t0, t1, by)

    def bucket_increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                        by: tuple[str, ...] = (), les: tuple[float, ...] = ()) -> dict[Labels, dict[float, float]]:
        name = promql.bucket_series(metric)
        return promql.split_le(self.increase(name, matchers, window_s, at, ("le", *by)))  # one scrape: all

    def histogram_quantile(self, q: float, metric: str, matchers: Mapping[str, str], window_s: float,
                           at: float, by: tuple[str, ...] = ()) -> dict[Labels, float]:
        return promql.group_quantiles(q, self.bucket_increase(metric, matchers, window_s, at, by))
