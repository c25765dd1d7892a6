"""Latency query sets reused across dashboards: mean and percentiles of a contract histogram."""

from __future__ import annotations

from collections.abc import Sequence

from dashboards.common import RATE, q
from exporters import promql as pq
from exporters.contract import Metric

PERCENTILES = (0.5, 0.9, 0.99)


def mean_and_percentiles(metric: Metric, by: Sequence[str], matchers: Sequence[str],
                         percentiles: Sequence[float] = PERCENTILES, mean: bool = True) -> list:
    """mean (request-weighted) and pXX per group, legends like ``decode mean`` / ``decode p90``."""
    legend = " ".join("{{" + b + "}}" for b in by)
    out = [q(pq.mean(metric, RATE, by, matchers), f"{legend} mean")] if mean else []
    out += [q(pq.quantile(p, metric, RATE, by, matchers), f"{legend} p{p * 100:g}") for p in percentiles]
    return out
