"""PromQL window math, checked against values worked out by hand from Prometheus's Go code
(promql/functions.go extrapolatedRate, promql/quantile.go bucketQuantile). The comparison with
a live Prometheus is tests/test_prometheus_agreement.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sla_guard.promql import (
    bucket_quantile,
    bucket_series,
    counter_delta,
    extrapolated_rate,
    extrapolated_rate_matrix,
    mean_from_sum_count,
    weighted_ratio,
)

T = [0, 15, 30, 45, 60]
V = [0, 10, 20, 30, 40]


def test_increase_exact_when_samples_on_boundaries():
    assert extrapolated_rate(T, V, 0, 60) == pytest.approx(40)


def test_increase_zero_point_clamp():
    # 5 s to each boundary extrapolates, but a counter at 0 cannot be extrapolated below zero
    # before its first sample: interval 60 + 0 + 5 = 65 -> 40 * 65/60
    assert extrapolated_rate(T, V, -5, 65) == pytest.approx(40 * 65 / 60)
    # delta() (not a counter) extrapolates both sides: 70/60
    assert extrapolated_rate(T, V, -5, 65, is_counter=False) == pytest.approx(40 * 70 / 60)


def test_counter_reset_adds_value_before_drop():
    # 10 -> 20 -> 5 (restart) -> 15: 10 + 5 + 10 = 25 (Prometheus: last-first + 20)
    assert extrapolated_rate([0, 10, 20, 30], [10, 20, 5, 15], 0, 30) == pytest.approx(25)


def test_far_boundary_extrapolates_half_interval_and_zero_clamp():
    # first sample 100 s after start: beyond 1.1 x avg (11 s) -> half an interval (5 s), but the
    # zero point is 10 s before the first sample (30 * 1/3), which is < 11 -> extrapolate 10 s.
    assert extrapolated_rate([100, 110, 120, 130], [1, 2, 3, 4], 0, 130) == pytest.approx(3 * 40 / 30)
    # same for a gauge delta: half an interval at the start only
    assert extrapolated_rate([100, 110, 120, 130], [1, 2, 3, 4], 0, 130, is_counter=False) == pytest.approx(
        3 * 35 / 30)


def test_rate_divides_by_range_and_needs_two_samples():
    assert extrapolated_rate(T, V, 0, 60, is_rate=True) == pytest.approx(40 / 60)
    assert math.isnan(extrapolated_rate([10], [5], 0, 60))
    assert math.isnan(extrapolated_rate(T, V, 100, 200))  # nothing in range


def test_range_is_closed_on_both_ends():
    # Prometheus 2.x: a sample exactly at at-range is inside the window
    assert extrapolated_rate([0, 30], [0, 30], 0, 30) == pytest.approx(30)


def test_matrix_handles_gaps_and_rows_independently():
    t = np.array([[0, 10, 20, 30], [0, 10, 20, 30], [0, 10, 20, 30]], float)
    v = np.array([[1, np.nan, 3, 4], [10, 20, 5, 15], [np.nan, np.nan, 7, np.nan]], float)
    out = extrapolated_rate_matrix(t, v, 0, 30)
    assert out[0] == pytest.approx(3)
    assert out[1] == pytest.approx(25)
    assert math.isnan(out[2])
    # a reset hidden behind a gap is still a drop between consecutive present samples
    out = extrapolated_rate_matrix(np.array([[0, 10, 20, 30]], float), np.array([[5, np.nan, 2, 4]], float), 0, 30)
    assert out[0] == pytest.approx(4 - 5 + 5)


def test_counter_delta_telescopes_over_consecutive_intervals():
    rng = np.random.default_rng(1)
    t = np.arange(0, 100, 1.0)
    inc = rng.integers(0, 5, size=t.size).astype(float)
    v = np.cumsum(inc)
    v[60:] -= v[59]  # restart at t=60: counter starts again from the increments
    whole = counter_delta(t, v, 0, 99)[0]
    parts = sum(counter_delta(t, v, a, a + 11)[0] for a in range(0, 99, 11))
    assert whole == pytest.approx(parts)
    assert whole == pytest.approx(inc[1:].sum())


def test_bucket_quantile_interpolates_like_prometheus():
    uppers = [1, 2, 4, math.inf]
    counts = [10, 20, 30, 40]
    assert bucket_quantile(0.25, uppers, counts) == pytest.approx(1.0)
    assert bucket_quantile(0.5, uppers, counts) == pytest.approx(2.0)
    assert bucket_quantile(0.6, uppers, counts) == pytest.approx(2.8)
    assert bucket_quantile(0.9, uppers, counts) == 4  # rank in +Inf bucket -> largest finite bound
    assert bucket_quantile(0.1, uppers, counts) == pytest.approx(0.4)  # first bucket from 0
    # order of input does not matter
    assert bucket_quantile(0.6, uppers[::-1], counts[::-1]) == pytest.approx(2.8)


def test_bucket_quantile_edge_cases():
    assert bucket_quantile(-0.1, [1, math.inf], [1, 2]) == -math.inf
    assert bucket_quantile(1.1, [1, math.inf], [1, 2]) == math.inf
    assert math.isnan(bucket_quantile(math.nan, [1, math.inf], [1, 2]))
    assert math.isnan(bucket_quantile(0.5, [1, 2], [1, 2]))  # no +Inf bucket
    assert math.isnan(bucket_quantile(0.5, [1, math.inf], [0, 0]))  # no observations
    assert math.isnan(bucket_quantile(0.5, [math.inf], [5]))  # fewer than two buckets
    assert bucket_quantile(0.5, [-1, 1, math.inf], [5, 6, 8]) == -1  # first bound <= 0
    # non-monotonic counts (rate noise) are raised to the running max
    assert bucket_quantile(0.5, [1, 2, 4, math.inf], [10, 8, 30, 40]) == pytest.approx(
        bucket_quantile(0.5, [1, 2, 4, math.inf], [10, 10, 30, 40]))
    # duplicate bounds are merged
    assert bucket_quantile(0.5, [1, 1, math.inf], [2, 3, 10]) == pytest.approx(
        bucket_quantile(0.5, [1, math.inf], [5, 10]))


def test_means_and_ratios():
    assert mean_from_sum_count(10, 4) == 2.5
    assert math.isnan(mean_from_sum_count(10, 0))
    # request-weighted: (1 + 0) / (16 + 1000) not mean(1/16, 0/1000)
    assert weighted_ratio([1, 0], [16, 1000]) == pytest.approx(1 / 1016)
    assert math.isnan(weighted_ratio([0], [0]))


def test_bucket_series_accepts_both_spellings():
    assert bucket_series("x_seconds") == "x_seconds_bucket"
    assert bucket_series("x_seconds_bucket") == "x_seconds_bucket"


def test_every_view_implements_the_whole_metrics_view_protocol():
    """Evaluators read views only through ``MetricsView`` (no hasattr probing): each view class
    defines every method and attribute the protocol declares."""
    import inspect

    from sla_guard.ingest.lifetime import LifetimeView
    from sla_guard.ingest.prometheus import PrometheusView
    from sla_guard.model import MetricsView
    from sla_guard.store import SeriesStore

    methods = {n for n, v in vars(MetricsView).items() if inspect.isfunction(v) and not n.startswith("_")}
    attrs = set(MetricsView.__annotations__)
    assert {"bucket_increase", "counter_delta", "instant"} <= methods
    assert attrs == {"serves_long_windows", "window_label", "last_error"}
    store = SeriesStore(slots=8)
    views = [store, LifetimeView(store), PrometheusView("http://127.0.0.1:9")]
    for view in views:
        for name in methods:
            assert callable(getattr(view, name, None)), (type(view).__name__, name)
        for name in attrs:
            assert hasattr(view, name), (type(view).__name__, name)
    assert [v.serves_long_windows for v in views] == [False, True, True]
