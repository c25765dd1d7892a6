"""A new prefill replica's empty prefix cache is not demand (issue 15).

The sessions routed to a replica that has just begun serving recompute their whole history
until their next turns have filled its cache. On step_down/s5 of the tuning suite that passing
work read as 164k uncached tokens/s against 35k arriving and ordered prefill to 16 replicas that
served after it had gone. The advisor counts a young replica's prompt tokens at the warm
replicas' miss ratio instead, for as long as a start time."""

from __future__ import annotations

from scale_support import Engine
from scale_support import run as _run
from scale_support import store as _store

from sla_guard.scale.advisor import Advisor
from sla_guard.settings.advisor import AdvisorConfig

TICK = 5.0
WARM = {"running": 1, "waiting": 0, "computed": 2500, "hit": 7500, "prefills": 1}  # 500 of 2000 tokens/s computed
COLD = {"running": 1, "waiting": 0, "computed": 10_000, "hit": 0, "prefills": 1}  # 2000 of 2000 computed


def _advisor() -> Advisor:
    cfg = AdvisorConfig.model_validate({"warmup_s": 0, "window_s": 30, "cold_start_s": 600})
    return Advisor(cfg, model="m")


def _demand(adv: Advisor, store, t: float, prefill: tuple[int, int]):
    decs, _ = adv.step(store, t, {"prefill": prefill, "decode": (1, 0)})
    return decs["prefill"].numbers


def _pool(store, t0: float, t1: float, engines: list[Engine], **ticks) -> None:
    _run(engines, store, t0, t1, dt=TICK, **ticks)


def test_a_young_replica_counts_at_the_warm_miss_ratio_until_a_start_time_has_passed():
    store, adv = _store(), _advisor()
    p0, p1, d0 = Engine("prefill", "p0"), Engine("prefill", "p1"), Engine("decode", "d0")
    _pool(store, 0, 60, [p0, p1, d0], p0=WARM, p1=WARM, d0={"running": 1, "waiting": 0})
    n = _demand(adv, store, 60, (2, 0))
    assert abs(n["demand_uncached_tokens_per_s"] - 1000) < 60 and "cold_cache_tokens_per_s" not in n

    p2 = Engine("prefill", "p2")  # ordered earlier, serving from t = 65 with an empty cache
    ticks = {"p0": WARM, "p1": WARM, "p2": COLD, "d0": {"running": 1, "waiting": 0}}
    _pool(store, 65, 180, [p0, p1, p2, d0], **ticks)
    for t in range(75, 181, 15):  # the advisor sees p2 from its first scrape on
        n = _demand(adv, store, t, (3, 0))
    # computed: 500 + 500 + 2000; p2's 2000 prompt tokens/s count at the warm ratio 0.25
    assert abs(n["demand_uncached_tokens_per_s"] - 1500) < 90
    assert abs(n["cold_cache_tokens_per_s"] - 1500) < 90

    _pool(store, 185, 700, [p0, p1, p2, d0], **ticks)
    n = _demand(adv, store, 700, (3, 0))  # a start time on, what p2 computes is demand again
    assert abs(n["demand_uncached_tokens_per_s"] - 3000) < 150 and "cold_cache_tokens_per_s" not in n


def test_without_a_warm_replica_the_computed_rate_stands():
    store, adv = _store(), _advisor()
    p0, d0 = Engine("prefill", "p0"), Engine("decode", "d0")
    _pool(store, 0, 60, [p0, d0], p0=COLD, d0={"running": 1, "waiting": 0})
    n = _demand(adv, store, 60, (1, 0))
    assert abs(n["demand_uncached_tokens_per_s"] - 2000) < 120 and "cold_cache_tokens_per_s" not in n
