"""The numpy series store: what it keeps, what it drops (and counts), and that its queries are
the PromQL functions applied to the stored samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from exporters import contract as c
from sla_guard.promql import bucket_quantile, extrapolated_rate
from sla_guard.store import SeriesStore

TTFT_B = c.REQUEST_TTFT.series("_bucket")
TTFT_COUNT = c.REQUEST_TTFT.series("_count")
FINISHED = c.REQUESTS_FINISHED.series()


def _engine(model="m", pool="decode", engine="0"):
    return {"model": model, "pool": pool, "engine": engine}


def test_increase_matches_promql_on_the_stored_samples():
    st = SeriesStore(slots=64)
    rng = np.random.default_rng(0)
    ts, vs = [], []
    v = 0.0
    for i in range(40):
        t = 1000 + i * 5 + rng.uniform(0, 0.5)
        v = v + rng.integers(0, 10) if i != 20 else 3.0  # restart at i=20
        st.append(FINISHED, {**_engine(), "reason": "stop"}, t, v)
        ts.append(round(t, 3))
        vs.append(v)
    at = 1000 + 39 * 5 + 1
    for w in (30, 60, 120):
        want = extrapolated_rate([t for t in ts if at - w <= t <= at], [x for t, x in zip(ts, vs, strict=True)
                                                                        if at - w <= t <= at], at - w, at)
        got = st.increase(FINISHED, {"model": "m"}, w, at, by=("pool",))
        assert got[(("pool", "decode"),)] == pytest.approx(want, rel=1e-12)


def test_sum_by_groups_and_matchers():
    st = SeriesStore(slots=16)
    for t in (0.0, 10.0, 20.0):
        for pool, e in (("prefill", "0"), ("prefill", "1"), ("decode", "0")):
            st.append(FINISHED, {**_engine(pool=pool, engine=e), "reason": "stop"}, t, t)
    got = st.increase(FINISHED, {}, 20, 20, by=("pool",))
    assert got == {(("pool", "prefill"),): pytest.approx(40), (("pool", "decode"),): pytest.approx(20)}
    assert st.increase(FINISHED, {"pool": "decode"}, 20, 20) == {(): pytest.approx(20)}
    assert st.increase(FINISHED, {"pool": "nope"}, 20, 20) == {}
    assert st.increase("no_such_metric", {}, 20, 20) == {}


def test_ingest_text_instant_and_staleness_marker():
    st = SeriesStore(slots=8, lookback_s=60)
    text = 'x_total{a="1"} 5\nx_total{a="2"} 7\ng 3.5\n'
    r = st.ingest_text(text, 100.0, {"instance": "t1", "model": "m", "pool": "decode"})
    assert r.samples == 3 and not r.errors
    inst = st.instant("x_total", {"instance": "t1"}, 110)
    assert sorted(inst.values()) == [5, 7]
    # a series that vanished from the next scrape has no current value
    st.ingest_text('x_total{a="1"} 6\n', 105.0, {"instance": "t1", "model": "m", "pool": "decode"})
    assert list(st.instant("x_total", {}, 110).values()) == [6]
    # scrape failed -> staleness marker -> nothing current; an older 'at' still sees the value
    st.mark_stale({"instance": "t1", "model": "m", "pool": "decode"}, 108.0)
    assert st.instant("x_total", {}, 110) == {}
    assert list(st.instant("x_total", {}, 106).values()) == [6]
    # beyond the lookback nothing is current either
    assert st.instant("g", {}, 500) == {}


def test_a_scrape_marked_stale_at_its_own_time_is_withdrawn():
    """The scraper fails a scrape after storing part of it (its limits refused series the SLOs
    read); a staleness marker at that scrape's own time did nothing, so the partial page stayed
    current next to up=0. Now it withdraws the scrape: no current value, no sample in windows."""
    st = SeriesStore(slots=8, lookback_s=60)
    st.ingest_text("x_total 5\n", 100.0, {"instance": "t1"}, group="t1")
    st.ingest_text("x_total 9\n", 105.0, {"instance": "t1"}, group="t1")
    st.mark_stale("t1", 105.0)
    assert st.instant("x_total", {}, 106.0) == {}
    assert [list(s.v) for s in st.range("x_total", {}, 0.0, 106.0)] == [[5.0]]


def test_retired_groups_are_freed_and_their_ids_reused():
    """Targets removed from discovery (a pod replaced under a new name) kept their series for the
    whole retention and their group's arrays for good: churn filled max_series and grew memory."""
    st = SeriesStore(slots=8, retention_s=3600, coarse_names={"y"}, coarse_step_s=1.0, coarse_slots=100)
    sizes = []
    for i in range(200):
        t = float(i)
        st.ingest_text("x_total 1\n", t, {"instance": "keep"}, group="keep")
        st.ingest_text("x_total 1\ny 2\n", t, {"instance": f"pod-{i}"}, group=f"pod-{i}")
        if i:
            st.retire(f"pod-{i - 1}", t, keep_s=2.0)
        assert st.instant("y", {}, t) == {(("instance", f"pod-{i}"),): 2.0}  # the retired ones are stale
        st.collect_garbage()
        sizes.append(st.nbytes())
    assert st.series_count() <= 1 + 2 * 4  # 'keep' and the pods retired less than 2 s ago
    assert sizes[-1] == sizes[20]
    # a retired target back in discovery is written again and stays, down for a while or not
    st.retire("keep", 200.0, keep_s=2.0)
    st.ingest_text("x_total 1\n", 201.0, {"instance": "keep"}, group="keep")
    st.ingest_text("z 1\n", 210.0, {"instance": "other"}, group="other")
    st.collect_garbage()
    assert [s.t[-1] for s in st.range("x_total", {"instance": "keep"}, 190.0, 210.0)] == [201.0]


def test_label_values_win_over_target_labels():
    st = SeriesStore(slots=8)
    st.ingest_text('y{pool="prefill"} 1\n', 1.0, {"pool": "mixed", "instance": "a"})
    assert list(st.instant("y", {"pool": "prefill"}, 1.0)) == [(("instance", "a"), ("pool", "prefill"))]


def test_drops_are_counted_not_raised():
    st = SeriesStore(slots=8, max_series=120, max_series_per_group=100, max_labels=4)
    bomb = "".join(f'bomb{{id="{i}"}} 1\n' for i in range(500))
    r = st.ingest_text(bomb, 1.0, {"instance": "bad"})
    assert r.samples == 100 and r.errors["series_limit"] == 400
    r = st.ingest_text('ok 1\nok 2\nn NaN\ni +Inf\nw{a="1",b="2",c="3",d="4",e="5"} 1\n', 1.0, {"instance": "good"})
    assert r.errors == {"duplicate": 1, "nan": 1, "label_limit": 1}
    assert st.instant("i", {}, 1.0) == {(("instance", "good"),): math.inf}
    assert st.ingest_text('ok 3\n', 0.5, {"instance": "good"}).errors["out_of_order"] == 1
    r = st.ingest_text("this is { not an exposition\n", 2.0, {"instance": "good"})
    assert r.errors["parse"] == 1 and r.samples == 0
    assert st.series_count() <= 120


def test_ring_keeps_last_slots_and_gc_frees_dead_series():
    st = SeriesStore(slots=4, retention_s=1000)
    for i in range(10):
        st.append("c_total", {"engine": "0"}, float(i), float(i))
    (s,) = st.range("c_total", {}, 0, 100)
    assert list(s.t) == [6, 7, 8, 9]
    # engine restarts with other series: the old one falls out of the ring and is collected
    for i in range(10, 20):
        st.append("d_total", {"engine": "0"}, float(i), 1.0)
    assert st.collect_garbage() >= 1
    assert st.range("c_total", {}, 0, 100) == []
    assert st.series_count() == 1
    # retention: samples older than newest - retention are invisible
    st2 = SeriesStore(slots=100, retention_s=10)
    for i in range(30):
        st2.append("c_total", {"engine": "0"}, float(i), float(i))
    (s,) = st2.range("c_total", {}, 0, 100)
    assert s.t.min() >= 19


def test_histogram_quantile_matches_bucket_quantile():
    st = SeriesStore(slots=16)
    bounds = [0.5, 1.0, 2.5, math.inf]
    first = [1, 2, 3, 4]
    second = [11, 32, 53, 64]
    for t, counts in ((0.0, first), (30.0, second)):
        for e in ("0", "1"):
            for le, n in zip(bounds, counts, strict=True):
                st.append(TTFT_B, {**_engine(engine=e), "le": "+Inf" if math.isinf(le) else str(le)}, t, n)
    got = st.histogram_quantile(0.9, c.REQUEST_TTFT.series(), {"model": "m"}, 30, 30, by=("pool",))
    inc = [2 * (b - a) for a, b in zip(first, second, strict=True)]
    assert got[(("pool", "decode"),)] == pytest.approx(bucket_quantile(0.9, bounds, inc))
    assert st.bucket_increase(c.REQUEST_TTFT.series(), {}, 30, 30)[()] == {
        le: pytest.approx(x) for le, x in zip(bounds, inc, strict=True)}


def test_counter_delta_telescopes_in_store():
    st = SeriesStore(slots=64)
    vals = [0, 5, 9, 2, 6, 10, 15]  # restart after 9
    for i, v in enumerate(vals):
        st.append(TTFT_COUNT, _engine(), i * 10.0, float(v))
    whole = st.counter_delta(TTFT_COUNT, {}, 0, 60)[()]
    parts = sum(st.counter_delta(TTFT_COUNT, {}, a, a + 20).get((), 0.0) for a in (0, 20, 40))
    assert whole == pytest.approx(9 + 2 + 4 + 4 + 5) == pytest.approx(parts)


def test_nan_sample_poisons_windows_like_promql():
    st = SeriesStore(slots=16)
    for i, v in enumerate([1, 2, float("nan"), 4, 5, 6]):
        st.append("c_total", {"engine": "0"}, i * 10.0, v)
        st.append("c_total", {"engine": "1"}, i * 10.0, float(i))
    # the window holding the NaN sample: NaN for the sum (PromQL propagates it), not a value
    # computed from fewer samples
    got = st.increase("c_total", {}, 30, 30)
    assert math.isnan(got[()])
    assert st.increase("c_total", {"engine": "1"}, 30, 30)[()] == pytest.approx(3)
    # once the NaN is out of the window the value is back
    assert st.increase("c_total", {"engine": "0"}, 20, 50)[()] == pytest.approx(2)
    assert st.dropped["nan"] == 1


def test_label_churn_does_not_grow_memory_forever():
    st = SeriesStore(slots=4, retention_s=50)
    st._vocab_limit = 1000
    for i in range(200):  # every scrape brings 50 brand-new label values, old ones die
        page = "".join(f'churn_total{{id="{i}-{j}"}} 1\n' for j in range(50))
        st.ingest_text(page + "steady_total 1\n", float(i), {"instance": "t"})
    st.collect_garbage()
    assert st.series_count() <= 4 * 50 + 1
    assert len(st._words) < 1000
    # what is left is still queryable by its labels
    assert len(st.instant("churn_total", {"instance": "t"}, 199.0)) == 50
    assert st.instant("steady_total", {"instance": "t"}, 199.0) == {(("instance", "t"),): 1.0}


def test_coarse_tier_extends_range_for_selected_names():
    rss = c.PROCESS_RSS.name
    st = SeriesStore(slots=10, coarse_names=[rss], coarse_step_s=60, coarse_slots=100)
    for i in range(600):  # 5 s scrapes for 50 min; the main ring holds the last 50 s only
        t = 1000.0 + 5 * i
        st.ingest_text(f'{rss}{{process="core"}} {1e9 + i}\nother_total {i}\n', t, {"instance": "e0"})
    (s,) = st.range(rss, {"process": "core"}, 1000, 4000)
    fine_start = 1000.0 + 5 * 590
    assert s.t[0] == 1000.0 and s.t[-1] == 1000.0 + 5 * 599
    coarse_part = s.t[s.t < fine_start]
    # the first scrape of each minute before the ring
    assert np.all(coarse_part[1:] % 60 == 0) and np.all(np.diff(coarse_part)[1:] == 60)
    assert np.all(np.diff(s.t[s.t >= fine_start]) == 5)
    assert np.all(np.diff(s.t) > 0) and s.v[-1] == 1e9 + 599
    # names outside the coarse set keep only the ring
    (o,) = st.range("other_total", {}, 1000, 4000)
    assert len(o.t) == 10
    # appends go to the coarse tier too
    st2 = SeriesStore(slots=4, coarse_names=[rss], coarse_step_s=60, coarse_slots=50)
    for i in range(100):
        st2.append(rss, {"engine": "0"}, 30.0 * i, float(i))
    (s2,) = st2.range(rss, {}, 0, 3000)
    assert len(s2.t) == 50 + 2 and s2.t[-1] == 30.0 * 99


def test_last_times_and_a_subset_range_answer_as_the_whole_range_does():
    """``last_times`` (the time of each series' last sample) and ``range(..., where=)`` (a subset
    of the series) let the leak detector read the 12 h of RSS of only the processes due for a
    check: both must answer what ``range`` of every series answers for them, in its order, over
    the ring, the coarse tier, NaN samples, a series missing from scrapes, a stale page, a
    target gone and a group id reused."""
    rss = c.PROCESS_RSS.name
    st = SeriesStore(slots=12, retention_s=2000.0, coarse_names=[rss], coarse_step_s=30, coarse_slots=60)
    rng = np.random.default_rng(1)
    for i in range(300):
        t = 1000.0 + 5 * i
        for e in range(6):
            if e == 5 and i > 150:
                continue  # a target gone: its series only in the coarse tier, then nowhere
            lines = []
            for p in ("api", "core", "w0"):
                if e == 2 and p == "w0" and 100 < i < 250:
                    continue  # missing from its page for a while
                v = "NaN" if (e == 3 and p == "core" and i % 7 == 0) else f"{1e9 + e * 1e6 + rng.normal(0, 1e5):.0f}"
                lines.append(f'{rss}{{process="{p}"}} {v}')
            st.ingest_text("\n".join(lines) + "\n", t, {"instance": f"e{e}"}, group=f"e{e}")
        if i == 200:
            st.mark_stale("e4", t + 1)
        if i == 220:
            st.retire("e5", t, keep_s=1.0)
            st.collect_garbage()
        if i == 230:  # a new target takes the retired one's group id
            st.ingest_text(f'{rss}{{process="api"}} 5e8\n', t + 2, {"instance": "e9"}, group="e9")
    windows = [(1000.0, 2500.0), (1500.0, 2480.0), (2300.0, 2490.0), (0.0, 1200.0), (2494.0, 2494.0), (3000.0, 4000.0),
               (1000.0, 2000.0), (1000.0, 2015.0)]  # the last two end at a scrape without e2's w0 and e3's core
    for start, end in windows:
        whole = st.range(rss, {}, start, end)
        assert list(st.last_times(rss, {}, start, end).items()) == [(s.labels, s.t[-1]) for s in whole], (start, end)
        for matchers in ({}, {"process": "core"}, {"instance": "e2"}):
            assert st.last_times(rss, matchers, start, end) == {
                s.labels: s.t[-1] for s in st.range(rss, matchers, start, end)}
        for pick in ({"e0", "e3"}, {"e2", "e5", "e9"}, set()):
            part = st.range(rss, {}, start, end, where=lambda lab, pick=pick: dict(lab)["instance"] in pick)
            want = [s for s in whole if dict(s.labels)["instance"] in pick]
            assert [s.labels for s in part] == [s.labels for s in want]
            for a, b in zip(part, want, strict=True):
                assert np.array_equal(a.t, b.t) and np.array_equal(a.v, b.v)
    assert st.last_times("no_such_metric", {}, 0.0, 1e9) == {}


def _all_samples(store: SeriesStore, names, start: float, end: float) -> dict:
    out = {}
    for n in names:
        for s in store.range(n, {}, start, end):
            out[(n, s.labels)] = [(float(t), None if math.isnan(v) else float(v))
                                  for t, v in zip(s.t, s.v, strict=True)]
    return out


def test_steady_state_fast_paths_store_exactly_what_a_full_parse_stores():
    """The scrape-cache paths (known series texts skip the regex; a page in the same order as
    the last one is written by layout) must store what the reference path (every line parsed,
    every series looked up) stores, through reordering, new and vanished series, NaN values,
    duplicates and a series over the label limit -- with the same drops counted each scrape."""
    from sla_guard.exposition import parse_exposition

    wide = ",".join(f'l{i}="v"' for i in range(20))  # over max_labels: dropped every scrape
    rng = np.random.default_rng(7)

    def page(step: int) -> str:
        lines = ["# HELP a_total a", "# TYPE a_total counter"]
        lines += [f'a_total{{k="{i}"}} {step * (i + 1)}' for i in range(30)]
        lines += [f'a_created{{k="{i}"}} 1.7e9' for i in range(5)]
        lines.append(f"wide{{{wide}}} {step}")
        lines.append(f'g{{q="1"}} {rng.normal():.6f}')
        if step in (1, 9):
            lines.append(f'g{{q="1"}} {step}')  # duplicate: first wins
        if step in (3, 11):
            lines[3] = 'a_total{k="1"} NaN'
        if step >= 4:
            lines.append(f'late{{x="y"}} {step}')  # a new series mid-way
        if 6 <= step <= 10:  # a vanished series (steps 7-8 take the layout path), then back
            lines = [x for x in lines if 'k="7"' not in x]
        if step == 12:
            lines[2:32] = lines[2:32][::-1]  # same series, new order
        return "\n".join(lines) + "\n"

    # a ring of 4 wraps several times: a slot reused must not keep an old value of a vanished series
    fast, ref = SeriesStore(slots=4, max_labels=16), SeriesStore(slots=4, max_labels=16)
    drops_fast, drops_ref = [], []
    for step in range(14):
        text, t = page(step), 1000.0 + 5 * step
        r1 = fast.ingest_text(text, t, {"instance": "e"}, group="e")
        samples, _ = parse_exposition(text)
        r2 = ref.ingest_samples(samples, t, {"instance": "e"}, group="e")
        drops_fast.append((r1.samples, dict(r1.errors)))
        drops_ref.append((r2.samples, dict(r2.errors)))
        names = ["a_total", "g", "late", "wide"]
        assert _all_samples(fast, names, t - 20, t) == _all_samples(ref, names, t - 20, t), step
    assert drops_fast == drops_ref
    assert all(e.get("label_limit") == 1 for _, e in drops_fast)
    names = ["a_total", "g", "late", "wide"]
    got, want = _all_samples(fast, names, 990, 1100), _all_samples(ref, names, 990, 1100)
    assert got == want and len(got) == 32


def test_known_series_with_a_bad_value_fails_the_page():
    s = SeriesStore(slots=8)
    assert s.ingest_text('x{a="1"} 1\n', 1.0, {}, group="e").samples == 1
    r = s.ingest_text('x{a="1"} one\n', 2.0, {}, group="e")
    assert r.errors["parse"] == 1 and r.samples == 0


@pytest.mark.parametrize("path", ["text", "samples"])
def test_a_target_churning_its_labels_stays_within_twice_its_series_limit(path):
    """The per-target limit counts the series of the page being stored (an engine restarted under
    new labels is not refused for its old incarnation's series, which windows spanning the restart
    still read). A target that changes every label at every scrape is bounded all the same: after
    each scrape it holds its page's series plus at most ``max_series_per_group`` it no longer
    serves, those gone longest freed first; a page over the limit is still cut at it."""
    limit, page = 100, 90
    st = SeriesStore(slots=1000, max_series=10_000, max_series_per_group=limit)
    extra = {"instance": "t", "model": "m", "pool": "decode"}

    def scrape(incarnation: int, t: float, n: int = page):
        if path == "text":
            text = "".join(f'a_total{{pid="{incarnation}",i="{i}"}} {t}\n' for i in range(n))
            return st.ingest_text(text, t, extra, group="t")
        return st.ingest_samples([("a_total", {"pid": str(incarnation), "i": str(i)}, t) for i in range(n)], t,
                                 extra, group="t")

    for k in range(30):  # a crash loop: new labels at every scrape
        res = scrape(k, float(k))
        assert res.samples == page and not res.errors, (k, res.errors)
        assert st.series_count() <= page + limit
        # the newest incarnations are the ones kept: a window spanning the last restart reads both
        pids = {dict(lab)["pid"] for lab in st.instant("a_total", {}, float(k))}
        assert pids == {str(k)}
        if k >= 2:
            assert len(st.range("a_total", {"pid": str(k - 1)}, 0, k)) == page
    res = scrape(99, 100.0, n=3 * limit)  # a label bomb: cut at the limit, as before
    assert res.samples == limit and res.errors["series_limit"] == 2 * limit
