"""The clairvoyant bound of bench/bench_oracle.py (issue 15): its schedule pays for every
replica it adds and finds the cheapest schedule within the miss budget. Small cost matrices built
here, no simulation."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_oracle as bo

SMALL, START, BIG = bo.SIZES.index((1, 1)), bo.SIZES.index(bo.START), bo.SIZES.index((4, 2))


def _costs(n_slots: int, start_s: float = 600.0):
    reps = np.array([p + d for p, d in bo.SIZES], float)
    cost = np.tile(reps * bo.SLOT_S, (n_slots, 1))
    pp = np.array([p for p, _ in bo.SIZES])
    dd = np.array([d for _, d in bo.SIZES])
    added = np.maximum(0, pp[None, :] - pp[:, None]) + np.maximum(0, dd[None, :] - dd[:, None])
    return cost, added * start_s


def test_without_misses_the_cheapest_size_is_kept_from_the_first_slot():
    cost, start = _costs(4)
    miss = np.zeros((4, len(bo.SIZES)))
    c, m, path = bo.bound(miss, cost, start, max_miss=0.0)
    assert path == [SMALL] * 4
    assert m == 0.0
    assert c == 4 * 2 * bo.SLOT_S  # shrinking from the 2P2D start is free


def test_a_burst_costs_its_cold_start_and_is_met_only_when_worth_it():
    cost, start = _costs(6)
    miss = np.zeros((6, len(bo.SIZES)))
    reps = np.array([p + d for p, d in bo.SIZES])
    miss[3, reps < 6] = 50.0  # slot 3 needs six replicas
    c, m, path = bo.bound(miss, cost, start, max_miss=0.0)
    assert m == 0.0 and sum(bo.SIZES[path[3]]) >= 6 and path[0] == SMALL and path[5] == SMALL
    # dropping to 1P1D and starting four replicas for the burst (2400 replica-s) beats holding
    # 2P2D for three slots and starting two (3000): the start costs are paid
    grow = c - (5 * 2 + 6) * bo.SLOT_S
    assert grow >= 4 * 600.0 - 1e-6
    # with the burst's misses allowed, nothing is bought for it
    c2, m2, path2 = bo.bound(miss, cost, start, max_miss=50.0)
    assert path2 == [SMALL] * 6 and m2 == 50.0 and c2 < c


def test_the_schedule_is_the_cheapest_within_the_budget_by_brute_force():
    import itertools

    rng = np.random.default_rng(7)
    cost, start = _costs(3)
    reps = np.array([p + d for p, d in bo.SIZES])
    miss = np.maximum(0, rng.integers(0, 40, (3, len(bo.SIZES))) - 6 * reps[None, :]).astype(float)
    budget = 30.0
    s0 = bo.SIZES.index(bo.START)
    best = np.inf
    for path in itertools.product(range(len(bo.SIZES)), repeat=3):
        if sum(miss[j, k] for j, k in enumerate(path)) <= budget:
            c = start[s0, path[0]] + sum(cost[j, k] + (start[path[j - 1], k] if j else 0.0) for j, k in enumerate(path))
            best = min(best, c)
    c, m, path = bo.bound(miss, cost, start, budget, bins=30)  # one bin per miss: no rounding
    assert m <= budget
    assert c == best
