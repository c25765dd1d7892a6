"""The blind workload suite of bench/workloads_blind.py: shape checks on the generated traces, no
simulation."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import workloads_blind as wb

KINDS = {*wb.FAMILIES, wb.TRACE_FAMILY}


@functools.cache
def _suite(split: str):
    return tuple(wb.suite(split))


@functools.cache
def _trace(split: str, family: str):
    return next(w for w in _suite(split) if w.family == family).build()


@pytest.mark.parametrize("split", wb.SPLITS)
def test_split_has_one_workload_per_kind(split):
    ws = _suite(split)
    assert len(ws) == 8
    assert len({w.name for w in ws}) == 8
    assert {w.family for w in ws} == KINDS
    assert all(w.split == split for w in ws)
    lo = wb.SEED_BASE[split]
    assert all(lo <= w.seed < lo + 100 for w in ws)
    assert all(0.6 <= w.acceptance <= 1.0 for w in ws)
    assert all(45 * 60 <= w.duration_s <= 75 * 60 for w in ws)


def test_unknown_split_is_refused():
    with pytest.raises(ValueError):
        wb.suite("train")


def test_names_differ_between_splits():
    assert not {w.name for w in _suite("tuning-more")} & {w.name for w in _suite("sealed")}


@pytest.mark.parametrize("family", ["surge_after_quiet", "agentic", wb.TRACE_FAMILY])
def test_build_is_deterministic(family):
    a = _trace("sealed", family)
    b = next(w for w in wb.suite("sealed") if w.family == family).build()
    assert a.requests == b.requests


@pytest.mark.parametrize("split", wb.SPLITS)
@pytest.mark.parametrize("family", sorted(KINDS))
def test_requests_are_well_formed(split, family):
    w = next(x for x in _suite(split) if x.family == family)
    tr = _trace(split, family)
    ts = np.array([r.t for r in tr.requests])
    assert len(ts) > 500
    assert np.all(np.diff(ts) >= 0)
    assert ts[0] >= 0 and ts[-1] <= w.duration_s
    assert all(r.input_len > 0 and r.output_len > 0 for r in tr.requests)
    assert len(ts) / w.duration_s <= 2.3  # mean offered rate stays modest
    hashed = [r for r in tr.requests if r.hash_ids]
    assert hashed, "every kind carries prefix information"
    assert all(len(r.hash_ids) == -(-r.input_len // tr.block_tokens) for r in hashed)


@pytest.mark.parametrize("split", wb.SPLITS)
@pytest.mark.parametrize("family", sorted(KINDS))
def test_measured_swing_matches_declared(split, family):
    w = next(x for x in _suite(split) if x.family == family)
    ts = np.array([r.t for r in _trace(split, family).requests])
    minutes = int(w.duration_s // 60)
    per_min = np.bincount((ts // 60).astype(int), minlength=minutes + 1)[:minutes]
    # agentic traffic comes in sessions of many requests: a longer window averages their sizes out
    k = 10 if family == "agentic" else 5
    smooth = np.convolve(per_min, np.ones(k) / k, mode="valid")
    measured = smooth.max() / smooth.min()
    assert w.swing >= 2.0
    assert w.swing / 1.5 <= measured <= w.swing * 1.5, (w.name, w.swing, measured)


@pytest.mark.parametrize("family", sorted(KINDS))
def test_splits_draw_different_traces(family):
    a, b = _trace("tuning-more", family), _trace("sealed", family)
    assert len(a.requests) != len(b.requests) or a.requests != b.requests


def test_prefix_sharing_exists_and_varies():
    shares = []
    for family in wb.FAMILIES:
        tr = _trace("tuning-more", family)
        seen: set[int] = set()
        hit = total = 0
        for r in tr.requests:
            hit += sum(h in seen for h in r.hash_ids)
            total += len(r.hash_ids)
            seen.update(r.hash_ids)
        shares.append(hit / total)
    assert min(shares) > 0.05
    assert max(shares) - min(shares) > 0.1
