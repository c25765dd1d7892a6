"""Histograms whose series come and go between scrapes -- an engine upgraded with another bucket
set, restarted under a new label value, a page that breaks -- scraped by the real ``Scraper`` from
loopback HTTP servers whose page changes between scrapes, at simulated times; the same samples
backfilled into a real Prometheus show what PromQL makes of them. Every request is recorded by
the test, so each expected count is exact."""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Callable

import pytest
from guard_support import Served
from prometheus_support import backfilled, prometheus_binary

from exporters import contract as c
from sla_guard.config import parse_config
from sla_guard.exposition import parse_exposition
from sla_guard.ingest import build_store
from sla_guard.ingest.scrape import Scraper
from sla_guard.model import Status
from sla_guard.slo import SLOEvaluator

TPOT = c.REQUEST_TPOT.series()
TTFT = c.REQUEST_TTFT.series()
T0 = 1_700_000_000.0
UPGRADE = 100  # the scrape at which the engine runs its new version
OLD = (0.01, 0.025, 0.05)  # TPOT bounds before the upgrade: none at the 20 ms SLA
NEW = (0.01, 0.02, 0.025, 0.05)
ATTAINMENT = [
    {
        "name": "att",
        "indicator": "tpot",
        "objective": "attainment",
        "threshold_s": 0.02,
        "target": 0.99,
        "period": "1d",
        "window": "5m",
        "min_requests": 5,
    }
]
MEAN = [
    {"name": "mean", "indicator": "tpot", "objective": "mean", "threshold_s": 0.02, "window": "5m", "min_requests": 5}
]


def _hist(
    name: str,
    n: int,
    bounds: tuple[float, ...],
    took: float,
    labels: str = 'engine="0"',
    created: float | None = None,
    total: float | None = None,
) -> str:
    """One histogram child of ``n`` requests that each took ``took`` seconds (``total``: its
    ``_sum`` if not ``n * took``), with its ``_created`` sample as prometheus_client writes it."""
    out = [f'{name}_bucket{{{labels},le="{b}"}} {n if took <= b else 0}' for b in bounds]
    out += [
        f'{name}_bucket{{{labels},le="+Inf"}} {n}',
        f"{name}_count{{{labels}}} {n}",
        f"{name}_sum{{{labels}}} {n * took if total is None else total}",
    ]
    if created is not None:
        out.append(f"{name}_created{{{labels}}} {created}")
    return "\n".join(out) + "\n"


class _Rig:
    """Targets e0, e1... behind real loopback HTTP servers, target k serving ``pages[k](i)`` at
    scrape i (simulated time T0 + 5 i), scraped by the embedded Scraper; judged every third."""

    def __init__(self, pages: list[Callable[[int], str]], slos: list[dict]) -> None:
        self.i = 0
        self.servers = [Served(lambda p=p: p(self.i)) for p in pages]
        self.cfg = parse_config(
            {
                "source": {
                    "mode": "scrape",
                    "interval_s": 5,
                    "timeout_s": 2,
                    "targets": [
                        {"url": s.url, "model": "m", "pool": "decode", "name": f"e{k}"}
                        for k, s in enumerate(self.servers)
                    ],
                },
                "evaluation_interval_s": 15,
                "staleness_s": 60,
                "slos": [{"objectives": slos}],
            }
        )
        self.store = build_store(self.cfg)
        self.scraper = Scraper(self.cfg.source, self.store)
        self.ev = SLOEvaluator(self.cfg)
        self.loop = asyncio.new_event_loop()
        self.seen: dict[int, dict] = {}  # tick -> {slo name: result}

    @staticmethod
    def t(i: int) -> float:
        return T0 + 5 * i

    def run(self, until: int) -> None:
        for i in range(self.i, until):
            self.i = i

            async def scrape(t=self.t(i)):
                for target in self.cfg.source.targets:
                    await self.scraper.scrape_target(target, t)

            self.loop.run_until_complete(scrape())
            if i % 3 == 0:
                self.ev.evaluate(self.store, self.t(i))
                self.seen[i] = {s.slo: s for s in self.ev.pools[("m", "decode")].slos}
        self.i = until

    def ledger(self) -> tuple[float, float]:
        """(errors, requests) the attainment ledger holds over its day."""
        (led,) = self.ev._ledgers.values()
        return led.window(self.t(self.i - 1), 86400)

    def close(self) -> None:
        self.loop.run_until_complete(self.scraper.aclose())
        self.loop.close()
        for s in self.servers:
            s.stop()


def _upgrade_page(variant: str) -> Callable[[int], str]:
    """Every request takes 15 ms. The engine is upgraded at scrape UPGRADE and comes back with a
    20 ms bucket. ``created``: prometheus_client's ``_created`` samples tell when each histogram
    began; ``reset``: none, but the old buckets drop (a restart); ``unproven``: none and no drop
    either (the old engine was idle at 10 requests, the new one has 12 at its first scrape)."""

    def page(i: int) -> str:
        restart = T0 + 5 * (UPGRADE - 1) + 2.0
        created = (T0 - 86400 if i < UPGRADE else restart) if variant == "created" else None
        if variant == "unproven":
            n = 10 if i < UPGRADE else 12 + 2 * (i - UPGRADE)
        else:
            n = 1000 + 2 * i if i < UPGRADE else 2 * (i - UPGRADE + 1)
        return _hist(TPOT, n, OLD if i < UPGRADE else NEW, 0.015, created=created)

    return page


@pytest.mark.parametrize("variant", ["created", "reset", "unproven"])
def test_an_upgrade_adding_the_threshold_bucket_judges_every_request_as_it_was(variant):
    """All requests take 15 ms, under the 20 ms threshold. The upgrade adds the 20 ms bucket; its
    series had no sample before, so (as in PromQL) it counted nothing of the restart interval
    while the old +Inf bucket counted it through its reset, and nothing of the window before the
    upgrade while +Inf counted all of it: attainment read 5 %, 'violated', and the ledger kept
    2 errors for the day (the whole budget of a 99 % target at these rates). Now the new bucket
    starts from 0 where its start is known (``_created``, or its histogram's reset), and the
    buckets are compared only over what they all saw."""
    rig = _Rig([_upgrade_page(variant)], ATTAINMENT)
    try:
        rig.run(2 * UPGRADE)
        assert rig.seen[UPGRADE - 1]["att"].status is Status.UNKNOWN  # no 20 ms bucket yet
        after = [rig.seen[i]["att"] for i in sorted(rig.seen) if i > UPGRADE]
        # judged from the first tick (6 requests); "unproven" has 4 then: too few, unknown
        assert after[0].status is (Status.UNKNOWN if variant == "unproven" else Status.OK), after[0]
        judged = [s for s in after if s.value is not None]
        assert len(judged) >= len(after) - 1 and {s.value for s in judged} == {1.0}, [
            s.value for s in judged if s.value != 1.0
        ][:3]
        assert {s.status for s in after[1:]} == {Status.OK}
        errors, total = rig.ledger()
        last = max(rig.seen)
        served = 2 * (last - UPGRADE + 1)  # requests of the new engine up to the last tick
        # where the new bucket's start is unknown, the restart interval is judged by no bucket
        assert (errors, total) == (0.0, served if variant != "unproven" else served - 2), (errors, total)
    finally:
        rig.close()


def test_a_bound_removed_by_an_upgrade_is_unknown_not_a_count_of_zero():
    """All requests take 15 ms. The upgrade drops the 20 ms bucket: its series stops with the
    requests before the upgrade while +Inf goes on, so the window read down to 6 %, 'violated',
    and the ledger took the requests of the ticks after as errors (30). The bound is missing now:
    the objective is unknown and says why, and the ledger spends nothing."""

    def page(i: int) -> str:
        return _hist(TPOT, 1000 + 2 * i if i < UPGRADE else 2 * (i - UPGRADE + 1), NEW if i < UPGRADE else OLD, 0.015)

    rig = _Rig([page], ATTAINMENT)
    try:
        rig.run(2 * UPGRADE)
        assert rig.seen[UPGRADE - 1]["att"].status is Status.OK
        after = [rig.seen[i]["att"] for i in rig.seen if i > UPGRADE]
        assert {s.status for s in after} == {Status.UNKNOWN}, [(s.status, s.value) for s in after][:3]
        assert all("not a bucket boundary" in s.reason and "SLA_GUARD_TPOT_SLO_S" in s.reason for s in after), after[0]
        errors, total = rig.ledger()
        assert errors == 0.0 and total == 2 * (UPGRADE - 1), (errors, total)
    finally:
        rig.close()


@pytest.mark.parametrize("created", [True, False])
def test_a_histogram_under_a_new_label_value_counts_from_zero_when_its_start_is_known(created):
    """The engine restarts as engine="1": a whole new histogram child. With its ``_created``
    after the last scrape its first 2 requests count (the ledger missed them, as PromQL's
    increase does); without it they are left out of good and total alike."""

    def page(i: int) -> str:
        if i < UPGRADE:
            return _hist(TPOT, 1000 + 2 * i, NEW, 0.015, created=T0 - 86400 if created else None)
        return _hist(
            TPOT,
            2 * (i - UPGRADE + 1),
            NEW,
            0.015,
            labels='engine="1"',
            created=T0 + 5 * (UPGRADE - 1) + 2.0 if created else None,
        )

    rig = _Rig([page], ATTAINMENT)
    try:
        rig.run(2 * UPGRADE)
        errors, total = rig.ledger()
        served = 2 * (UPGRADE - 1) + 2 * (max(rig.seen) - UPGRADE + 1)
        assert (errors, total) == (0.0, served if created else served - 2), (errors, total)
        assert {rig.seen[i]["att"].value for i in rig.seen if i > UPGRADE} == {1.0}
    finally:
        rig.close()


@pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)")
@pytest.mark.prometheus
def test_prometheus_on_the_same_samples_reads_the_upgrade_as_a_violation_and_agrees_elsewhere():
    """What PromQL makes of the upgrade's samples (backfilled into a real Prometheus): the 20 ms
    bucket holds 6 of the 120 requests of a window that spans the upgrade, attainment 5 %. The
    guard judges them all (100 %). On a window after the upgrade, and on a second histogram whose
    +Inf and 0.5 s buckets reset without the others (a partial restart), the guard's
    ``sum by (le) (increase(...[5m]))`` is Prometheus's."""
    upgrade = _upgrade_page("reset")
    end = 2 * UPGRADE

    def page(i: int) -> str:
        n = 10 * i if i < 150 else 10 * i - 600  # +Inf and le=0.5 drop at 150, le=0.1 does not
        partial = "\n".join(
            f'{TTFT}_bucket{{engine="0",le="{le}"}} {v}' for le, v in (("0.1", 4 * i), ("0.5", n - 2 * i), ("+Inf", n))
        )
        return upgrade(i) + partial + f'\n{TTFT}_count{{engine="0"}} {n}\n{TTFT}_sum{{engine="0"}} {0.2 * n}\n'

    base = float(int(time.time()) - 3 * 3600)  # Prometheus takes the backfill as history
    series: dict[str, list[str]] = defaultdict(list)
    for i in range(end):
        for name, labels, v in parse_exposition(page(i))[0]:
            text = ",".join(f'{k}="{x}"' for k, x in sorted(labels.items()))
            series[f"{name}{{{text}}}"].append(f"{v} {base + 5 * i:.0f}")
    history = [
        f"# TYPE {TPOT} histogram",
        *(f"{s} {p}" for s, ps in series.items() if s.startswith(TPOT) for p in ps),
        f"# TYPE {TTFT} histogram",
        *(f"{s} {p}" for s, ps in series.items() if s.startswith(TTFT) for p in ps),
        "# EOF",
        "",
    ]
    with backfilled("\n".join(history)) as prom:
        rig = _Rig([page], ATTAINMENT)
        try:
            rig.run(end)

            def promql(name: str, i: int) -> dict[float, float]:
                got = prom.query(f"sum by (le) (increase({name}_bucket[5m]))", base + 5 * i)
                return {float(r["metric"]["le"]): float(r["value"][1]) for r in got}

            def guard(name: str, i: int) -> dict[float, float]:
                return rig.store.bucket_increase(name, {}, 300, rig.t(i))[()]

            spans = UPGRADE + 2
            assert promql(TPOT, spans)[0.02] / promql(TPOT, spans)[math.inf] == pytest.approx(0.05)
            assert guard(TPOT, spans)[0.02] == guard(TPOT, spans)[math.inf] > 0
            assert rig.seen[spans]["att"].value == 1.0
            for name, i in ((TPOT, end - 1), (TTFT, 160), (TTFT, end - 1)):
                want, got = promql(name, i), guard(name, i)
                assert got.keys() == want.keys() and all(got[le] == pytest.approx(want[le], rel=1e-9) for le in want), (
                    name,
                    i,
                    got,
                    want,
                )
        finally:
            rig.close()


def test_a_nan_or_inf_in_the_slo_histograms_refuses_the_page():
    """Engine e1 serves 100 ms TPOTs (e0 5 ms): the pool's mean is 52.5 ms, over 20 ms. e1's
    ``_sum`` turns +Inf for 80 scrapes: +Inf - +Inf is NaN, which the pool's sum skipped, so the
    mean read 2.5 ms from e0's sum over both engines' requests, 'ok'. Then one NaN in e1's 20 ms
    bucket: every ledger bucket it touched stayed NaN, attainment unknown for the whole period.
    Now such a page is refused (``non_finite``, e1 down, the series named) and nothing of it is
    kept."""
    broken: dict[int, str] = {}

    def engine(k: int, took: float) -> Callable[[int], str]:
        def page(i: int) -> str:
            fault = broken.get(i) if k == 1 else None
            text = _hist(TPOT, 2 * i, NEW, took, labels=f'engine="{k}"', total=math.inf if fault == "inf" else None)
            if fault == "nan":
                text = text.replace('le="0.02"} 0', 'le="0.02"} NaN')
            return text

        return page

    rig = _Rig([engine(0, 0.005), engine(1, 0.1)], MEAN + ATTAINMENT)
    try:
        broken.update({i: "inf" for i in range(50, 130)})
        broken[150] = "nan"
        rig.run(121)
        st = {s.name: s for s in rig.scraper.targets()}
        assert not st["e1"].up and st["e1"].errors.get("non_finite", 0) == 71
        assert f"{TPOT}_sum" in st["e1"].last_error and st["e0"].up
        mean = rig.seen[120]["mean"]
        assert mean.status is Status.UNKNOWN and "1 of 2 targets down" in mean.reason, mean
        rig.run(200)
        assert rig.scraper.targets()[1].errors["non_finite"] == 81
        final = rig.seen[198]
        assert final["mean"].status is Status.VIOLATED and final["mean"].value == pytest.approx(0.0525)
        att = final["att"]
        assert att.status is Status.VIOLATED and att.value == 0.5, att  # judged again after the NaN
        errors, total = rig.ledger()
        assert errors / total == pytest.approx(0.5, abs=0.01)
    finally:
        rig.close()


def test_a_sample_stamped_older_than_the_last_one_is_dropped_as_prometheus_drops_it():
    """A cache in front of the engine serves, at scrape 8, the page of scrape 5 again, with its
    exposition timestamps. Stored at the scrape's time, its counter dropped from 170 to 150 and
    rose again: a reset, and 260 tokens counted instead of 90. The sample is left out
    (``out_of_order``, as Prometheus drops it); in the SLOs' histograms the page is refused."""
    stale_page = {8: 5, 28: 25}  # scrape -> the older scrape whose page the cache serves

    def page(i: int) -> str:
        j = stale_page.get(i, i)
        ms = int((T0 + 5 * j) * 1000)
        text = f'engine_tokens_total{{engine="0"}} {100 + 10 * j} {ms}\n'
        if i >= 10:  # the SLOs' histogram carries timestamps too
            text += "".join(f"{line} {ms}\n" for line in _hist(TPOT, 2 * j, NEW, 0.015).splitlines())
        return text

    rig = _Rig([page], MEAN)
    try:
        rig.run(10)
        st = rig.scraper.targets()[0]
        assert st.up and st.errors == {"out_of_order": 1}, st.errors
        assert rig.store.counter_delta("engine_tokens_total", {}, T0, rig.t(9)) == {(): 90.0}
        rig.run(29)
        st = rig.scraper.targets()[0]
        assert not st.up and st.errors == {"out_of_order": 2}, st.errors
        assert f"{TPOT}_bucket" in st.last_error and "older than the last one" in st.last_error, st.last_error
        rig.run(31)
        assert rig.scraper.targets()[0].up
    finally:
        rig.close()
