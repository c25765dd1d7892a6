"""Advisor core: sizing math, online learning and guardrails (pure functions, no I/O)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sla_guard.config import ConfigError, parse_config
from sla_guard.scale.core import DecodeKnobs, DecodeObs, PrefillKnobs, PrefillObs, Sizing, size_decode, size_prefill
from sla_guard.scale.guardrails import Decision, PoolMemory, Rails, apply_budget, decide
from sla_guard.scale.learn import (
    PrefillCapacity,
    StepModel,
    adapt_target_utilization,
    update_prefill_capacity,
    update_step_model,
)
from sla_guard.settings.advisor import AdvisorConfig

CAP = PrefillCapacity(tokens_per_s=10_000.0, samples=10)
# the knobs production runs: built from the advisor's default config (prefill target utilisation 0.5)
PK = PrefillKnobs.from_config(AdvisorConfig())
DK = DecodeKnobs.from_config(AdvisorConfig())


def _p(**kw) -> PrefillObs:
    base = dict(ready=2, starting=0, uncached_tps=8_000.0, requests_per_s=1.0, waiting=0.0)
    base.update(kw)
    return PrefillObs(**base)


def test_prefill_sizing_uses_uncached_tokens_and_target_utilization():
    s = size_prefill(_p(uncached_tps=30_000.0, requests_per_s=3.0), CAP, replace(PK, target_utilization=0.75))
    # 30k / (10k * 0.75) = 4 replicas
    assert s.desired == 4
    assert "prefill_demand_over_capacity" in s.reasons
    assert s.numbers["demand_uncached_tokens_per_s"] == 30_000.0


def test_prefill_backlog_and_queue_growth_add_demand():
    calm = size_prefill(_p(uncached_tps=4_000.0, requests_per_s=1.0), CAP, PK)
    queued = size_prefill(_p(uncached_tps=4_000.0, requests_per_s=1.0, waiting=20.0, waiting_slope=0.2), CAP, PK)
    assert calm.desired == 1
    assert queued.desired > calm.desired
    assert queued.numbers["backlog_tokens_per_s"] > 0


def test_prefill_backlog_is_sized_for_the_queue_the_ordered_replicas_meet():
    # a central queue (queue_moves): 100 requests of 4k tokens waiting and 2 more a second;
    # replicas serving in 600 s meet a queue that grew meanwhile; one that does not grow is sized as it is
    moves = replace(PK, queue_moves=True)
    obs = _p(uncached_tps=4_000.0, requests_per_s=1.0, waiting=100.0, waiting_slope=2.0, backlog_horizon_s=150.0)
    now = size_prefill(obs, CAP, moves)
    ahead = size_prefill(replace(obs, serve_in_s=600.0), CAP, moves)
    soon = size_prefill(replace(obs, serve_in_s=10.0), CAP, moves)
    assert now.numbers["backlog_ahead_tokens"] == 0.0
    assert ahead.numbers["backlog_ahead_tokens"] == 4_800_000.0  # 2/s x 600 s x 4k
    assert soon.numbers["backlog_ahead_tokens"] == 80_000.0  # 2/s x 10 s x 4k
    # (400k queued + 4.8M ahead) / 150 s against 400k / 150 s
    assert ahead.numbers["backlog_tokens_per_s"] == pytest.approx(13 * now.numbers["backlog_tokens_per_s"], abs=0.5)
    assert ahead.desired > now.desired and now.desired <= soon.desired <= ahead.desired
    flat = size_prefill(replace(obs, waiting_slope=0.0, serve_in_s=600.0), CAP, moves)
    assert flat.numbers["backlog_ahead_tokens"] == 0.0
    assert all(s.numbers["replicas_holding_backlog"] == 0 for s in (now, ahead, soon, flat))


def test_a_queue_the_ready_replicas_clear_before_a_new_one_serves_is_not_ordered_for():
    # an old queue (requests waited 150 s) that no longer grows: 8 ready replicas of 10k tok/s with
    # 20k tok/s arriving have 60k to spare, so 300 requests of 4k tokens (1.2M) are computed in
    # 20 s, long before a replica ordered now serves (600 s); with the pool busy (79k computed, 1k
    # to spare) half the queue is still there then. A queue of 3 s waits is a burst's, the early
    # sign of a load that keeps queueing, and a growing one a surge's: both stay backlog
    obs = _p(ready=8, uncached_tps=20_000.0, requests_per_s=5.0, waiting=300.0, backlog_horizon_s=150.0,
             queue_tail_s=150.0, waiting_slope=-0.5)
    now = size_prefill(obs, CAP, PK)
    later = size_prefill(replace(obs, start_s=600.0), CAP, PK)
    busy = size_prefill(replace(obs, uncached_tps=79_000.0, requests_per_s=19.75, start_s=600.0), CAP, PK)
    assert now.numbers["backlog_tokens_per_s"] == pytest.approx(8_000.0)  # 1.2M over 150 s, start unknown
    assert later.numbers["spare_tokens_per_s"] == pytest.approx(60_000.0)
    assert later.numbers["backlog_tokens_per_s"] == 0.0 and later.desired < now.desired
    assert busy.numbers["backlog_tokens_per_s"] == pytest.approx(4_000.0)  # 600k left over 150 s
    burst = size_prefill(replace(obs, start_s=600.0, queue_tail_s=3.0), CAP, PK)
    assert burst.numbers["backlog_tokens_per_s"] == pytest.approx(8_000.0) and burst.desired == now.desired
    growing = size_prefill(replace(obs, start_s=600.0, waiting_slope=0.5), CAP, PK)
    assert growing.numbers["spare_tokens_per_s"] == 0.0 and growing.numbers["backlog_tokens_per_s"] > 0.0


def test_a_queue_held_by_its_engine_is_not_ordered_for():
    # vLLM keeps each engine's queue (the default): replica 0 holds 600 requests of 4k tokens,
    # 240 s of its 10k tok/s, longer than the 150 s horizon; it carries no new arrivals meanwhile,
    # so the 8k tok/s of arrivals are sized on others (2 at 0.5 x 10k) and replica 0 counts as busy
    obs = _p(uncached_tps=8_000.0, requests_per_s=2.0, waiting=600.0, queues=(600.0, 0.0), backlog_horizon_s=150.0,
             ttft_tail_s=60.0, settled=True)
    held = size_prefill(obs, CAP, PK)
    assert held.numbers["replicas_holding_backlog"] == 1
    assert held.numbers["backlog_tokens_per_s"] == 0.0
    assert held.desired == 3 and "prefill_backlog" in held.reasons
    # the TTFT tail is the held queue's: more replicas never reach it, so no proportional rule
    assert "ttft_tail_from_held_queues" in held.reasons and "ttft_over_sla" not in held.reasons
    # a central queue moves to new replicas: sized for it (2.4M tokens over 150 s), and the tail asks too
    moved = size_prefill(obs, CAP, replace(PK, queue_moves=True))
    assert moved.numbers["replicas_holding_backlog"] == 0 and moved.desired > held.desired
    # a queue the replica drains within the horizon is a backlog as before, held by nobody
    short = size_prefill(replace(obs, waiting=200.0, queues=(200.0, 0.0), ttft_tail_s=None), CAP, PK)
    assert short.numbers["replicas_holding_backlog"] == 0
    assert short.numbers["backlog_tokens_per_s"] == pytest.approx(200 * 4_000 / 150, abs=0.5)
    # the growth until the ordered replicas serve lands on the replicas taking arrivals now
    # (2/s x 4k x 600 s over 2 replicas: 240 s each) and keeps them busy when the new ones serve
    growing = size_prefill(replace(obs, waiting=0.0, queues=(0.0, 0.0), waiting_slope=2.0, serve_in_s=600.0,
                                   ttft_tail_s=None), CAP, PK)
    assert growing.numbers["replicas_holding_backlog"] == 2
    assert growing.desired == 2 + math.ceil((8_000 + 8_000) / 5_000)  # arrivals = served + the queue's growth
    slow = size_prefill(replace(obs, waiting=0.0, queues=(0.0, 0.0), waiting_slope=1.0, serve_in_s=600.0,
                                ttft_tail_s=None), CAP, PK)
    assert slow.numbers["replicas_holding_backlog"] == 0  # 120 s each: drained within the horizon


def test_a_draining_prefill_queue_is_not_read_as_arrivals():
    """Replicas that came up after an overloaded start compute the new arrivals while the old
    ones empty the prefills they admitted: the pool computes more than arrives, and the excess is
    the queue's drain (waiting + running shrinking), not demand (blind step_down/s810)."""
    # 4 replicas computing 36k tok/s at 4 prefills/s (9k tokens each); the unfinished prefills
    # shrink by 2/s, so 18k tok/s of it is the drain and 18k arrives: 18k / (10k x 0.5) = 4
    # (the advisor passes the computed rate's peak over the window as peak_uncached_tps)
    obs = _p(ready=4, uncached_tps=36_000.0, requests_per_s=4.0, waiting=0.0, drain_slope=-2.0,
             peak_uncached_tps=36_000.0)
    drained = size_prefill(obs, CAP, PK)
    assert drained.numbers["demand_uncached_tokens_per_s"] == pytest.approx(18_000.0)
    assert drained.numbers["queue_drain_tokens_per_s"] == pytest.approx(18_000.0)  # in the reasons' numbers
    assert drained.desired == 4
    computed = size_prefill(replace(obs, drain_slope=0.0), CAP, PK)
    assert computed.desired == 8  # read as arrivals, the drain orders 4 more
    # the drain shrinks nothing: N-1 is judged on the computed peak
    assert drained.numbers["utilization_at_n_minus_1"] == computed.numbers["utilization_at_n_minus_1"]
    # a growing queue adds its growth as before (the drain slope is only ever <= 0)
    grows = size_prefill(replace(obs, drain_slope=0.0, waiting=10.0, waiting_slope=0.5), CAP, PK)
    assert grows.numbers["demand_uncached_tokens_per_s"] >= 36_000.0 + 0.5 * 9_000.0


def test_a_tail_of_waits_longer_than_the_horizon_orders_nothing():
    """Requests that waited longer than the backlog horizon did so on a queue their engine held
    (a replica that drains within the horizon has none that old): replicas ordered now take none
    of them, so the proportional rule stays out and says why (surge_after_quiet/s2 of the tuning
    suite: a 160 s tail of requests that had waited up to 640 s on one replica took prefill
    13 -> 16 after the last arrival). A central queue moves to new replicas: there it asks."""
    obs = _p(ready=10, uncached_tps=8_000.0, requests_per_s=2.0, waiting=96.0, queues=(96.0,) + (0.0,) * 9,
             backlog_horizon_s=150.0, ttft_tail_s=160.0, queue_tail_s=640.0, long_busy_share=1.0, settled=True)
    s = size_prefill(obs, CAP, PK)
    assert s.numbers["replicas_holding_backlog"] == 0  # 96 x 4k tokens: 38 s of p0, inside the horizon
    assert "ttft_over_sla" not in s.reasons and "ttft_tail_from_held_queues" in s.reasons
    assert "ttft_over_sla" in size_prefill(obs, CAP, replace(PK, queue_moves=True)).reasons
    assert "ttft_over_sla" in size_prefill(replace(obs, queue_tail_s=100.0), CAP, PK).reasons  # as before


def test_prefill_scale_down_only_if_n_minus_1_fits():
    # 3 replicas, 9k tokens/s: 1.8 replicas needed, but at N-1=2 utilisation 0.45 > 0.5 x (1 - 0.2)
    assert PK.target_utilization == 0.5 and PK.scale_down_margin == 0.2
    s = size_prefill(_p(ready=3, uncached_tps=9_000.0), CAP, PK)
    assert s.desired == 2
    assert not s.fits_at_n_minus_1
    assert "prefill_n_minus_1_would_not_fit" in s.reasons
    # the test N-1 failed is a reason of its own: what an operator asks of a pool that is held
    assert "n_minus_1_utilization" in s.reasons and "n_minus_1_ttft_tail" not in s.reasons
    s2 = size_prefill(_p(ready=3, uncached_tps=6_000.0), CAP, PK)  # 0.3 at N-1: fits
    assert s2.fits_at_n_minus_1 and not [r for r in s2.reasons if r.startswith("n_minus_1_")]


def test_ttft_tail_over_sla_adds_one_and_blocks_scale_down():
    s = size_prefill(_p(ready=2, uncached_tps=10_000.0, waiting=1.0, ttft_tail_s=4.0), CAP, PK)
    # proportional to the tail: ceil(2 x 4.0 / 2.5) = 4
    assert s.desired == 4 and "ttft_over_sla" in s.reasons
    assert not s.fits_at_n_minus_1


def test_missing_data_holds_and_says_what_is_missing():
    """A bare hold_missing_data left the operator guessing (the KEDA 503 said "targets down" while
    a lightly loaded pool without a profile only lacked a learned capacity)."""
    s = size_prefill(_p(uncached_tps=None), CAP, PK)
    assert s.desired is None and s.reasons == ["hold_missing_data", "prefill_no_token_or_queue_data"]
    unknown = PrefillCapacity(tokens_per_s=0.0, samples=0)
    assert size_prefill(_p(), unknown, PK).reasons == ["hold_missing_data", "prefill_capacity_not_learned"]
    assert size_decode(DecodeObs(ready=2, starting=0, running=None), StepModel(a=0.008, b=0.0004, samples=5),
                       DK).reasons == ["hold_missing_data", "decode_no_running_data"]
    assert size_decode(DecodeObs(ready=2, starting=0, running=10.0), StepModel(a=0.0, b=0.0), DK).reasons \
        == ["hold_missing_data", "decode_step_time_not_learned"]
    d = decide("prefill", 100.0, 2, 0, Sizing(None, ["hold_missing_data"]), PoolMemory(), Rails())
    assert d.action == "hold" and d.desired == 2 and d.confidence == 0.0


def test_step_model_learns_linear_step_time():
    m = StepModel(a=0.0, b=0.0)
    for i in range(200):
        b = 4 + (i * 7) % 60
        m = update_step_model(m, b, 0.008 + 0.0002 * b)
    assert m.a == pytest.approx(0.008, rel=0.05)
    assert m.b == pytest.approx(0.0002, rel=0.05)
    # batch that keeps a step under 17 ms
    assert m.batch_for_step_time(0.017) == pytest.approx(45, rel=0.05)


def test_step_model_one_slow_step_does_not_reset_the_intercept():
    """Small batches, where step time hardly moves with the batch, then one slow step (after an
    idle spell) whose update would turn the slope negative: the slope is held at its bound and
    the intercept moves only as far as the fit's covariance says, not to that one sample (it
    used to: a TPOT floor over the SLA from one sample, and decode grew at a 14.5 ms tail)."""
    m = StepModel(a=0.036, b=9.7e-5)
    for i in range(40):
        batch = 2 + i % 6
        m = update_step_model(m, batch, 0.0366 + 1e-5 * batch + (0.0004 if i % 2 else -0.0004))
    assert m.a == pytest.approx(0.0366, abs=0.002)
    slow = update_step_model(m, 1.0, 0.066)
    assert slow.b == pytest.approx(1e-7)
    assert slow.a < 0.045, slow  # one sample moves it, but not to 66 ms
    assert slow.a >= m.a


def test_spec_decode_acceptance_raises_decode_capacity():
    m = StepModel(a=0.008, b=0.0004, samples=50)
    obs = DecodeObs(ready=2, starting=0, running=100.0, accepted_len=1.0)
    no_spec = size_decode(obs, m, DK)
    with_spec = size_decode(DecodeObs(ready=2, starting=0, running=100.0, accepted_len=2.5), m, DK)
    assert with_spec.desired < no_spec.desired


def test_kv_usage_caps_decode_batch_and_preemptions_force_growth():
    m = StepModel(a=0.001, b=0.00001, samples=50)  # TPOT never binds
    s = size_decode(DecodeObs(ready=2, starting=0, running=100.0, kv_usage=0.95), m, DK)
    assert s.desired == 3 and "decode_concurrency_over_kv_limit" in s.reasons
    p = size_decode(DecodeObs(ready=2, starting=0, running=20.0, kv_usage=0.3, preemptions_per_s=0.5), m, DK)
    assert p.desired == 3 and "kv_preemptions" in p.reasons


def test_prefill_capacity_is_throughput_over_busy_share():
    prior = PrefillCapacity(tokens_per_s=100_000.0, samples=0, prior=100_000.0)
    # half busy at 20k tok/s -> 40k flat out; the first real sample replaces the prior
    first = update_prefill_capacity(prior, 20_000.0, busy_share=0.5)
    assert first.tokens_per_s == pytest.approx(40_000.0) and first.samples == 1
    # nearly idle windows teach nothing (an idle replica is not a slow one)
    assert update_prefill_capacity(first, 1_000.0, busy_share=0.05) == first
    assert update_prefill_capacity(first, 10_000.0, busy_share=0.3) == first  # too lightly loaded
    nxt = update_prefill_capacity(first, 30_000.0, busy_share=1.0, alpha_down=0.5)
    assert nxt.tokens_per_s == pytest.approx(35_000.0)
    up = update_prefill_capacity(first, 60_000.0, busy_share=1.0, alpha_up=0.5)
    assert up.tokens_per_s == pytest.approx(50_000.0)


def test_target_utilization_adapts_to_ttft_outcomes():
    # TTFT tail broke the SLA at 40% busy: the target drops below it at once
    assert adapt_target_utilization(0.5, 0.4, 3.0, 2.5) == pytest.approx(0.36)
    # comfortably inside the SLA while hotter than the target: creep up slowly
    up = adapt_target_utilization(0.3, 0.5, 1.0, 2.5)
    assert 0.3 < up < 0.32
    assert adapt_target_utilization(0.3, None, 1.0, 2.5) == 0.3


def _sz(desired: int, fits: bool = True) -> Sizing:
    return Sizing(desired, ["x"], {}, fits, 1.0)


def test_scale_down_waits_for_stabilization_and_needs_fit():
    # the window alone (no extra no-reversal span; test_scale_down_waits_out_a_load_that_recurs)
    mem, rails = PoolMemory(), Rails(stabilization_down_s=300, cooldown_s=0, no_reversal_s=0)
    assert decide("decode", 0, 4, 0, _sz(4), mem, rails).direction == "none"
    # raw desire drops, but 4 was wanted inside the window
    d = decide("decode", 100, 4, 0, _sz(2), mem, rails)
    assert d.direction == "none" and "hold_stabilization_window" in d.reasons
    # after the window: one step down only
    d = decide("decode", 401, 4, 0, _sz(2), mem, rails)
    assert (d.direction, d.desired) == ("down", 3)
    # N-1 would not fit -> hold even though raw is lower
    mem2 = PoolMemory(first_t=0.0)
    d = decide("decode", 1000, 4, 0, _sz(2, fits=False), mem2, rails)
    assert d.direction == "none" and "hold_n_minus_1_would_not_fit" in d.reasons


def test_no_reversal_within_window_and_cooldown():
    mem, rails = PoolMemory(first_t=0.0), Rails(stabilization_down_s=300, cooldown_s=120)
    up = decide("prefill", 1000, 2, 0, _sz(3), mem, rails)
    assert up.direction == "up"
    # load vanished right after the scale-up: no reversal within the window
    mem.history.clear()
    d = decide("prefill", 1060, 3, 0, _sz(1), mem, rails)
    assert d.direction == "none" and "hold_no_reversal_within_window" in d.reasons
    # cooldown after a scale-down
    mem3 = PoolMemory(last_action_t=1000.0, last_down_t=1000.0, first_t=0.0)
    d = decide("prefill", 1050, 4, 0, _sz(2), mem3, Rails(stabilization_down_s=0, cooldown_s=120))
    assert "hold_cooldown" in d.reasons


def test_a_forecast_does_not_undo_a_scale_down_within_the_no_reversal_span():
    """bursty/s2 of the tuning suite: decode went 2 -> 1 after a 21-min lull and 1 -> 2 75 s later
    on a burst's concurrency trend (52 running against a limit of 70, forecast 81), the TPOT tail
    inside the SLA. Within the no-reversal span a scale-up needs what is measured now."""
    rails = Rails(no_reversal_s=600, cooldown_s=0, stabilization_up_s=0)
    obs = DecodeObs(ready=1, starting=0, running=52.0, running_slope=0.5, waiting=0.0, tpot_tail_s=0.018)
    sized = size_decode(obs, StepModel(a=0.012, b=0.0001, samples=50), DK)
    assert sized.desired > 1 and sized.desired_now == 1  # the trend asks, the batch now does not
    mem = PoolMemory(first_t=0.0, last_down_t=2100.0, last_action_t=2100.0)
    d = decide("decode", 2175, 1, 0, sized, mem, rails)
    assert d.direction == "none" and "hold_forecast_within_no_reversal" in d.reasons
    assert decide("decode", 2175, 1, 0, _sz(2), PoolMemory(first_t=0.0, last_down_t=2100.0), rails).direction == "up"
    assert decide("decode", 2800, 1, 0, sized, mem, rails).direction == "up"  # after the span


def test_decode_forecast_projects_at_most_half_the_batch():
    """A burst's ramp-in reads as a steep concurrency slope: projected over the whole forecast
    horizon it ordered decode for 1.6x the burst's peak (blind bursty/s807: 267 against a peak of
    167). The projection is held to half the batch, as prefill's arrival trend is held to half the
    served demand; a gentle slope is projected in full."""
    model = StepModel(a=0.012, b=0.0001, samples=50)
    steep = size_decode(DecodeObs(ready=2, starting=0, running=100.0, running_slope=2.0, waiting=0.0,
                                  tpot_tail_s=0.015), model, DK)
    assert steep.numbers["concurrency_forecast"] == pytest.approx(150.0)
    gentle = size_decode(DecodeObs(ready=2, starting=0, running=100.0, running_slope=0.1, waiting=0.0,
                                   tpot_tail_s=0.015), model, DK)
    assert gentle.numbers["concurrency_forecast"] == pytest.approx(100.0 + 0.1 * DK.forecast_horizon_s)


def test_starting_replicas_count_no_double_scaling():
    mem, rails = PoolMemory(), Rails(cooldown_s=60)
    d = decide("prefill", 0, 2, 0, _sz(3), mem, rails)
    assert (d.direction, d.desired) == ("up", 3)
    # next tick: the new replica is starting; the same raw desire is already met
    d = decide("prefill", 15, 2, 1, _sz(3), mem, rails)
    assert d.direction == "none" and d.current == 3
    # even if more is wanted, wait for the starting one within the cooldown
    d = decide("prefill", 30, 2, 1, _sz(5), mem, rails)
    assert d.direction == "none" and "hold_replicas_starting" in d.reasons


def test_max_step_and_bounds():
    d = decide("decode", 0, 2, 0, _sz(9), PoolMemory(), Rails(max_step_up=2, max_replicas=8))
    assert d.desired == 4 and "max_step_up" in d.reasons
    d = decide("decode", 0, 0, 0, _sz(0), PoolMemory(), Rails(min_replicas=1))
    assert d.desired == 1


def test_gpu_budget_goes_to_pool_under_pressure():
    decs = {
        "prefill": Decision("prefill", 3, 5, "up", [], {}, 1.0),
        "decode": Decision("decode", 2, 4, "up", [], {}, 1.0),
    }
    out = apply_budget(decs, {"prefill": 8, "decode": 8}, 56, {"prefill": 1.5, "decode": 1.1})
    # 40 GPUs used, 16 free -> two replicas, prefill first then decode
    assert out["prefill"].desired == 4 and out["decode"].desired == 3
    assert "gpu_budget_exhausted" in out["prefill"].reasons


def test_advisor_config_errors_name_field_path():
    with pytest.raises(ConfigError) as e:
        parse_config({"advisor": {"pools": {"decode": {"min_replicas": 5, "max_replicas": 2}}}})
    assert "advisor.pools.decode" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config({"advisor": {"cooldown": 5}})
    assert "advisor.cooldown" in str(e.value) and "unknown field" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config({"advisor": {"mode": "active"}})
    assert "actuation" in str(e.value)
    assert parse_config({}).advisor.mode == AdvisorConfig().mode == "advisory"


def test_window_runs_from_when_started_replicas_serve():
    """A scale-up whose replicas took 10 minutes to start must not be reversed the moment they serve."""
    mem, rails = PoolMemory(first_t=0.0), Rails(stabilization_down_s=300, cooldown_s=60)
    assert decide("prefill", 1000, 2, 0, _sz(3), mem, rails).direction == "up"
    for t in range(1015, 1600, 15):
        decide("prefill", t, 2, 1, _sz(3), mem, rails)  # still starting
    mem.history.clear()
    d = decide("prefill", 1700, 3, 0, _sz(2), mem, rails)
    assert d.direction == "none" and "hold_no_reversal_within_window" in d.reasons


def test_first_scale_down_needs_evidence_and_overwhelming_fit():
    rails = Rails(stabilization_down_s=300, cooldown_s=0, min_evidence_s=60)
    mem = PoolMemory()
    strong = Sizing(1, ["x"], {}, True, 0.8, strong_fit=True)
    assert decide("decode", 0, 2, 0, strong, mem, rails).direction == "none"  # no evidence yet
    assert decide("decode", 30, 2, 0, strong, mem, rails).direction == "none"
    assert decide("decode", 60, 2, 0, strong, mem, rails).direction == "down"
    # an ordinary fit waits for the full window
    mem2 = PoolMemory()
    plain = Sizing(1, ["x"], {}, True, 0.8, strong_fit=False)
    for t in (0, 60, 120, 240):
        assert decide("decode", t, 2, 0, plain, mem2, rails).direction == "none"
    assert decide("decode", 300, 2, 0, plain, mem2, rails).direction == "down"


def test_a_size_that_had_to_be_grown_back_from_is_not_retried_at_the_same_load():
    """Shrink 2 -> 1, the SLA breaks, grow back: the next shrink to 1 at a similar load is held,
    and allowed again once the load has fallen well below the load 1 replica failed at."""
    rails = Rails(stabilization_down_s=300, cooldown_s=0, failed_size_memory_s=3600, failed_size_load_ratio=0.8)
    mem = PoolMemory(first_t=0.0)

    def sz(desired: int, load: float) -> Sizing:
        return Sizing(desired, ["x"], {}, True, 0.8, load=load)

    assert decide("prefill", 1000, 2, 0, sz(1, 10_000.0), mem, rails).direction == "down"
    up = decide("prefill", 1060, 1, 0, sz(2, 9_000.0), mem, rails)
    assert up.direction == "up" and "learned_size_too_small" in up.reasons
    assert mem.failed[1][1] == 9_000.0  # the lower of the judged and the breaking load
    mem.history.clear()
    held = decide("prefill", 2000, 2, 0, sz(1, 8_000.0), mem, rails)
    assert held.direction == "none" and "hold_size_failed_recently" in held.reasons
    assert held.numbers["failed_size"] == 1
    # the window's peak load must fall below 0.8 x 9000 before 1 replica is tried again
    mem.loads.clear()
    assert decide("prefill", 2400, 2, 0, sz(1, 5_000.0), mem, rails).direction == "down"
    # growing because the load grew is not a failure of the shrunk size ...
    mem2 = PoolMemory(first_t=0.0)
    assert decide("decode", 1000, 3, 0, sz(2, 100.0), mem2, rails).direction == "down"
    assert decide("decode", 3000, 2, 0, sz(3, 300.0), mem2, rails).direction == "up"
    assert mem2.failed == {}
    # ... but growing back at the same load is, however long after the shrink (within the memory)
    mem3 = PoolMemory(first_t=0.0)
    assert decide("decode", 1000, 3, 0, sz(2, 100.0), mem3, rails).direction == "down"
    assert decide("decode", 3000, 2, 0, sz(3, 110.0), mem3, rails).direction == "up"
    assert mem3.failed[2][1] == 100.0


def test_trend_ignores_a_fill_from_zero_and_needs_a_whole_span():
    """Least squares on (0, 139, 136) reads a flat load that started at the first scrape as
    +9 requests/s; Theil-Sen on a whole span does not."""
    from collections import deque

    from sla_guard.scale.advisor import Advisor
    from sla_guard.scale.learn import slope
    from sla_guard.settings.advisor import AdvisorConfig

    assert slope([0, 15, 30], [0, 139, 136]) is None  # too few points for a trend
    ts = [0, 15, 30, 45, 60, 75, 90, 105, 120]
    flat = [0, 139, 136, 157, 141, 121, 129, 143, 158]
    assert abs(slope(ts, flat)) < 1.0
    ramp = [100 + 2 * t for t in ts]
    assert slope(ts, ramp) == pytest.approx(2.0)
    adv = Advisor(AdvisorConfig(), model="*", slo_ttft_s=2.5, slo_tpot_s=0.02)
    hist: deque = deque(maxlen=64)
    # no trend until the history covers the whole span, however steep the first points are
    assert [adv._trend(hist, t, v, 120.0) for t, v in zip(ts[:8], flat[:8], strict=True)] == [None] * 8
    assert adv._trend(hist, 120, 158, 120.0) is not None


def test_head_of_line_risk_keeps_a_second_replica_for_heavy_tailed_prompts():
    """Two prefill replicas at 8% mean utilisation, each 20% of the time on a prefill longer than
    half the TTFT SLA: one replica would leave ~40% of arrivals behind a long prompt, so N-1 does
    not fit although utilisation says it does; without long prompts the same pool may shrink."""
    from sla_guard.scale.core import head_of_line_risk

    assert head_of_line_risk(0.2, ready=2, replicas=1) == pytest.approx(0.4)
    assert head_of_line_risk(0.2, ready=3, replicas=2) == pytest.approx(0.09)
    assert head_of_line_risk(0.02, ready=3, replicas=2) == pytest.approx(0.0009)
    assert head_of_line_risk(0.9, ready=4, replicas=1) == 1.0  # capped: a share, not a rate
    cap = PrefillCapacity(tokens_per_s=100_000.0, samples=10)
    calm = _p(uncached_tps=16_000.0, ttft_tail_s=0.8)
    heavy = _p(uncached_tps=16_000.0, ttft_tail_s=0.8, long_busy_share=0.2)
    light = _p(uncached_tps=16_000.0, ttft_tail_s=0.8, long_busy_share=0.01)
    knobs = PK  # target utilisation 0.5, head-of-line budget 1 - learn_quantile = 5%
    assert size_prefill(calm, cap, knobs).fits_at_n_minus_1
    s = size_prefill(heavy, cap, knobs)
    assert not s.fits_at_n_minus_1 and "prefill_n_minus_1_would_not_fit" in s.reasons
    assert [r for r in s.reasons if r.startswith("n_minus_1_")] == ["n_minus_1_head_of_line_risk"]
    assert s.numbers["head_of_line_risk_at_n_minus_1"] == pytest.approx(0.4)
    assert size_prefill(light, cap, knobs).fits_at_n_minus_1


def test_head_of_line_check_is_held_to_the_recent_long_prompt_burst():
    """Between two bursts of long prompts the window's share is small and N-1 looks safe; the
    share the check is held to (``hol_busy_share``, the burst seen within the recurrence horizon)
    keeps the replica that routes around the next burst."""
    cap = PrefillCapacity(tokens_per_s=100_000.0, samples=10)
    between = _p(uncached_tps=16_000.0, ttft_tail_s=0.8, long_busy_share=0.01)
    assert size_prefill(between, cap, PK).fits_at_n_minus_1
    remembered = _p(uncached_tps=16_000.0, ttft_tail_s=0.8, long_busy_share=0.01, hol_busy_share=0.2)
    s = size_prefill(remembered, cap, PK)
    assert not s.fits_at_n_minus_1 and s.numbers["head_of_line_risk_at_n_minus_1"] == pytest.approx(0.4)


def test_advisor_remembers_long_prefill_work_not_share():
    """The remembered burst is work (replicas kept busy), so a burst of 0.6 replicas' work seen on
    2 replicas (30% each) is 15% on 4 replicas; it is forgotten after the recurrence horizon."""
    from sla_guard.scale.advisor import Advisor

    adv = Advisor(AdvisorConfig.model_validate({"recurrence_horizon_s": 3600}), model="*")
    assert adv._long_busy_recent(0.0, 0.6, 2) == pytest.approx(0.3)
    assert adv._long_busy_recent(600.0, 0.0, 4) == pytest.approx(0.15)
    assert adv._long_busy_recent(1200.0, None, 4) == pytest.approx(0.15)  # no reading: still remembered
    assert adv._long_busy_recent(3700.0, 0.04, 4) == pytest.approx(0.01)  # the burst is past the horizon


def test_advisor_does_not_remember_long_work_read_while_a_backlog_drained():
    """A replica working through a backlog is busy all the time and shares each step among the
    prompts it admitted, so every prefill reads as long whatever its length: such a window is
    not remembered as long-prompt work (it held step_down/s4's start of 12 replicas for 40
    minutes). A wait of a few seconds behind long prompts is their work, and is remembered."""
    from sla_guard.scale.advisor import Advisor

    adv = Advisor(AdvisorConfig(), model="*", slo_ttft_s=2.5)
    backlog = {"long_busy_replicas": 12.0, "queue_tail_s": 150.0, "waiting": 300.0}
    behind_long = {"long_busy_replicas": 1.6, "queue_tail_s": 3.0, "waiting": 5.0}
    assert adv._queued(backlog, 12) and not adv._queued(behind_long, 2)
    assert adv._queued({"queue_tail_s": None, "waiting": 30.0}, 12) is True  # no queue histogram: the queue now
    assert adv._long_busy_recent(0.0, 12.0, 12, queued=True) is None
    assert adv._long_busy_recent(600.0, 1.2, 12) == pytest.approx(0.1)
    assert adv._long_busy_recent(900.0, 1.6, 2) == pytest.approx(0.8)  # the long prompts' own work
    assert adv._long_busy_recent(1200.0, 0.2, 4) == pytest.approx(0.4)


def test_long_prefill_work_counts_the_replicas_that_did_it():
    """On the tick new replicas come up, the window's long-prefill work is still the old
    replicas' (2 of them, busy with long prompts): 2 replicas of work, a third of each of the 6
    ready now, not 6 (step_up/s5 of the tuning suite held 6 replicas at 20-30 % utilisation
    to the end of the run on it). Both the stabilisation-window peak and the remembered burst."""
    from sla_guard.scale.advisor import Advisor
    from sla_guard.scale.core import head_of_line_risk

    adv = Advisor(AdvisorConfig(), model="*", slo_ttft_s=2.5)
    assert adv._long_busy_recent(0.0, 2.0, 6) == pytest.approx(1 / 3)
    assert adv._long_work("prefill_long_busy", 0.0, 2.0, 6) == pytest.approx(1 / 3)
    # the next window is read over the 6 replicas that served it; the peak is still 2 replicas' work
    assert adv._long_work("prefill_long_busy", 15.0, 0.6, 6) == pytest.approx(1 / 3)
    assert head_of_line_risk(1 / 3, ready=6, replicas=5) < 0.05 < head_of_line_risk(1.0, ready=6, replicas=5)
    assert adv._long_work("prefill_long_busy", 30.0, 1.0, 0) is None  # no ready replica to spread it over


def test_long_prefill_seconds_from_histogram_buckets():
    """Per-le increases (cumulative, ``increase(..._bucket[w])`` by le via promql.split_le) -> seconds spent on
    prefills longer than the threshold, at bucket midpoints (+Inf at its lower bound)."""
    from sla_guard.scale.observe import long_prefill_seconds

    b = {0.5: 50.0, 1.0: 60.0, 2.5: 64.0, 5.0: 66.0, float("inf"): 67.0}
    # over 1.0 s: 4 in (1, 2.5] at 1.75, 2 in (2.5, 5] at 3.75, 1 above 5 at 5
    assert long_prefill_seconds(b, 1.0) == pytest.approx(4 * 1.75 + 2 * 3.75 + 5.0)
    assert long_prefill_seconds(b, 2.5) == pytest.approx(2 * 3.75 + 5.0)
    # over 1.25 s (half a 2.5 s SLA, inside the (1, 2.5] bucket): 5/6 of its 4 prefills, at 1.875
    assert long_prefill_seconds(b, 1.25) == pytest.approx(4 * (1.25 / 1.5) * 1.875 + 2 * 3.75 + 5.0)
    assert long_prefill_seconds({}, 1.0) is None


def test_decode_does_not_chase_a_tpot_that_no_replica_count_reaches():
    """TPOT = step / accepted length, and a step costs at least ``a`` however few sequences it
    carries. When MTP acceptance collapses the floor reaches the SLA and replicas cannot help."""
    m = StepModel(a=0.036, b=0.0001, samples=50)

    def obs(alen: float, tail: float) -> DecodeObs:
        return DecodeObs(ready=2, starting=0, running=200.0, accepted_len=alen, tpot_tail_s=tail)

    healthy = size_decode(obs(2.97, 0.015), m, DK)  # floor 12 ms
    assert "decode_tpot_unreachable_by_scaling" not in healthy.reasons
    assert healthy.numbers["batch_limit_tpot"] == pytest.approx((0.017 * 2.97 - 0.036) / 0.0001, rel=0.01)
    # floor 17.1 ms: above the 17 ms headroom target, below the SLA: the headroom goes first
    between = size_decode(obs(2.1, 0.0205), m, DK)
    assert between.numbers["batch_limit_tpot"] == pytest.approx(60.0, rel=0.01) and between.desired == 4
    # a tail inside the SLA at today's batch (100 per replica) proves that batch, whatever the fit
    proven = size_decode(obs(2.1, 0.018), m, DK)
    assert proven.numbers["batch_limit_tpot"] == pytest.approx(100.0) and proven.desired == 2
    # floor 20 ms: no batch meets 20 ms; the tail over the SLA adds nothing
    collapsed = size_decode(obs(1.8, 0.024), m, DK)
    assert "decode_tpot_unreachable_by_scaling" in collapsed.reasons and "tpot_over_sla" not in collapsed.reasons
    assert collapsed.desired == 1 and collapsed.numbers["tpot_at_empty_batch_s"] == pytest.approx(0.02)


def test_scale_down_window_stretches_to_the_observed_start_time():
    """Capacity given back on a dip shorter than a cold start is bought back with a cold start of
    misses: once the advisor has seen replicas take 615 s to serve, it waits that long."""
    from sla_guard.scale.advisor import Advisor
    from sla_guard.settings.advisor import AdvisorConfig

    adv = Advisor(AdvisorConfig(stabilization_down_s=300), model="*")
    assert adv._rails("prefill").stabilization_down_s == 300
    for t, starting in ((0.0, 1), (300.0, 1), (615.0, 0)):
        adv.memory["prefill"].watch_start(t, starting)
    assert adv.memory["prefill"].start_s == 615.0
    assert adv._rails("prefill").stabilization_down_s == 675.0  # start time + cooldown (break-even)
    assert adv._rails("decode").stabilization_down_s == 300  # per pool


def test_observed_start_time_runs_from_the_last_order_not_the_first():
    """Orders staggered over a surge (3 replicas at 0 s, 2 more at 420 s, 600 s cold starts) are
    two starts of 600 s, not one of 1020 s: the start time is measured from the last order seen
    (starting count rising) to the first tick with nothing starting. Measured from the first
    order, the scale-down window (start + cooldown) doubled after every staggered surge."""
    from sla_guard.scale.advisor import Advisor
    from sla_guard.settings.advisor import AdvisorConfig

    adv = Advisor(AdvisorConfig(stabilization_down_s=300), model="*")
    mem = adv.memory["prefill"]
    for t, starting in ((0.0, 3), (300.0, 3), (420.0, 5), (600.0, 2), (900.0, 2), (1020.0, 0)):
        mem.watch_start(t, starting)
    assert mem.start_s == 600.0
    assert adv._rails("prefill").stabilization_down_s == 660.0


def test_prefill_is_held_to_the_client_sla_minus_the_time_outside_prefill():
    """With a client scope the prefill pool's TTFT signal is the client's tail minus the mean time
    spent outside prefill (decode first leg + proxy), against the SLA minus the same: over budget
    exactly when the client's tail is over the SLA; a slow decode side is not prefill's."""
    from sla_guard.scale.advisor import prefill_ttft_share
    from sla_guard.scale.observe import ClientReading

    healthy_decode = ClientReading(requests=500, ttft_tail_s=2.7, ttft_learn_s=3.0, decode_first_leg_mean_s=0.15,
                                   proxy_mean_s=0.05)
    sig = prefill_ttft_share(healthy_decode, 2.5)
    assert sig.tail_s == pytest.approx(2.5) and sig.budget_s == pytest.approx(2.3)
    assert sig.tail_s > sig.budget_s  # client 2.7 > 2.5: the prefill part (2.5) is over its budget (2.3)
    assert sig.learn_s == pytest.approx(2.8)
    assert sig.numbers["client_ttft_tail_s"] == 2.7 and sig.numbers["ttft_outside_prefill_s"] == 0.2
    within = prefill_ttft_share(replace(healthy_decode, ttft_tail_s=2.4), 2.5)
    assert within.tail_s < within.budget_s
    # the decode leg takes 3 s: prefill's budget never drops under half the SLA, its part is 0.8 s
    slow_decode = replace(healthy_decode, ttft_tail_s=4.0, decode_first_leg_mean_s=3.15)
    sig = prefill_ttft_share(slow_decode, 2.5)
    assert sig.budget_s == 1.25 and sig.tail_s == pytest.approx(0.8)
    # a router exporting TTFT without stages: the whole client TTFT is prefill's, against the SLA
    no_stages = ClientReading(requests=500, ttft_tail_s=2.7, ttft_learn_s=3.0)
    sig = prefill_ttft_share(no_stages, 2.5)
    assert (sig.tail_s, sig.learn_s, sig.budget_s) == (2.7, 3.0, 2.5)


def test_scale_down_waits_out_a_load_that_recurs():
    """A lull must outlast the longest recent lull that ended with the load back, plus the
    no-reversal span: bursts 20 minutes apart do not get their capacity taken away between them."""
    mem, rails = PoolMemory(first_t=0.0), Rails(stabilization_down_s=660, cooldown_s=60, no_reversal_s=600)
    t = 0.0
    for burst_at in (0.0, 1200.0, 2400.0):  # 3 replicas wanted for 2 minutes every 20 minutes
        while t < burst_at + 120:
            decide("prefill", t, 3, 0, _sz(3), mem, rails)
            t += 15
        while t < burst_at + 1200 and burst_at < 2400:
            d = decide("prefill", t, 3, 0, _sz(2), mem, rails)
            if burst_at > 0:  # the first lull knows no recurrence yet (break-even only)
                assert d.direction == "none"  # the previous lull lasted ~18 min: wait for 18 + 10
            t += 15
    while t < 2400 + 120 + 17.5 * 60 + 600:
        d = decide("prefill", t, 3, 0, _sz(2), mem, rails)
        assert d.direction == "none", t
        t += 15
    assert "hold_load_recurs" in d.reasons and d.numbers["lull_needed_s"] > 1600
    for _ in range(20):
        d = decide("prefill", t, 3, 0, _sz(2), mem, rails)
        t += 15
        if d.direction == "down":
            break
    assert d.direction == "down" and d.desired == 2


@pytest.mark.parametrize("interval_s", [1.0, 5.0, 15.0])
def test_memories_cover_their_span_at_any_decision_interval(interval_s):
    """The advisor's bounded histories hold points a span / bound apart, not one per tick: a
    long-prefill burst stays remembered over the 2 h recurrence horizon, the 5-minute demand
    trend is computed, and a pool's recurrence memory sees a need 100 minutes back, at 1 s
    ticks as at 15 s (a bound of N ticks covered 43 min of the horizon at 5 s, and no demand
    trend was ever computed below 4.7 s)."""
    from collections import deque

    from sla_guard.scale.advisor import TREND_POINTS, Advisor

    adv = Advisor(AdvisorConfig.model_validate({"interval_s": interval_s}), model="*")
    mem = PoolMemory()
    hist: deque = deque(maxlen=TREND_POINTS)
    ticks = [i * interval_s for i in range(int(6600 / interval_s))]
    trends = []
    for t in ticks:
        adv._long_busy_recent(t, 0.8 if t == 0 else 0.02, 2)
        mem.remember_long(t, 3 if t == 0 else 1, 7200.0)
        trends.append(adv._trend(hist, t, 100.0 + 0.5 * t, 300.0))
    assert adv._long_busy_recent(6600.0, 0.02, 2) == pytest.approx(0.4)
    assert len(adv.learned.waiting_hist["prefill_long_work"]) <= 1024
    assert trends[-1] == pytest.approx(0.5)
    lull, _, recent = mem.lulls(1, 6600.0)
    assert recent and lull == pytest.approx(6600.0, abs=2 * 7200.0 / 2000)
    assert len(mem.raw_long) <= 2048


def test_a_tail_from_a_backlog_that_is_gone_is_not_load_now():
    """A 137 s tail whose requests waited 137 s in a queue that has since drained (one request
    waiting on 7 replicas) is an old backlog's: replicas ordered now meet none of it, so neither
    the proportional rule nor the utilisation target acts on it (step_down/s5 of the tuning suite
    went 7 -> 11 prefill replicas for it). While the queue is still there, or with a wait a burst
    makes (a few seconds), the tail stays load's."""
    from sla_guard.scale.core import tail_from_load

    # utilisation, target, waiting, ready, long share, queue tail, excess, held wait, SLA (a
    # backlog's wait: over 4 x 2.5 s)
    assert not tail_from_load(0.37, 0.5, 1.0, 7, None, 137.0, 134.5, 150.0, 2.5)
    assert tail_from_load(0.37, 0.5, 300.0, 7, None, 137.0, 134.5, 150.0, 2.5)  # the queue is still there
    assert tail_from_load(0.37, 0.5, 1.0, 7, None, 6.0, 5.0, 150.0, 2.5)  # a burst's wait
    gone = _p(ready=7, uncached_tps=25_000.0, requests_per_s=6.0, waiting=1.0, ttft_tail_s=137.0,
              queue_tail_s=137.0, backlog_horizon_s=150.0, settled=True)
    s = size_prefill(gone, CAP, PK)
    assert "ttft_over_sla" not in s.reasons and "ttft_tail_not_from_load" in s.reasons and s.desired <= 7


def test_only_a_tail_that_load_made_counts():
    """A TTFT tail over the budget teaches the utilisation target and feeds the proportional rule
    only when load made it: without long prompts any tail is load's; with them, a queue or a busy
    share of 25%, and under the target utilisation with the queue-time tail measured, the queue's
    tail must reach the tail's excess over the budget (a 4.5 s tail against a 2.4 s budget with an
    empty queue is the prompts' length). Arguments: utilisation, target, waiting, ready, long-prompt
    share, queue tail, excess."""
    from sla_guard.scale.core import tail_from_load

    assert not tail_from_load(0.25, 0.5, 0.0, 10, 0.2, 0.05, 2.1)  # no queueing: prompt length
    assert tail_from_load(0.25, 0.5, 0.0, 10, 0.2, 2.5, 2.1)  # queueing explains the excess
    assert not tail_from_load(0.14, 0.5, 0.0, 10, 0.2, 2.5, 2.1)  # ... but at 14% with long prompts
    assert tail_from_load(0.14, 0.5, 30.0, 10, 0.2, 2.5, 2.1)  # a queue: load's
    assert tail_from_load(0.3, 0.5, 0.0, 10, 0.2, 0.0, -1.4)  # within budget: learning may raise the target
    assert tail_from_load(0.6, 0.5, 0.0, 10, 0.2, 0.05, 2.1)  # over the target: sharing
    assert tail_from_load(0.1, 0.5, 0.0, 10, None, 0.05, 2.1)  # no long prompts: any tail is load's
    # no queue histogram: utilisation >= 25%, or a queue, or no long prompts
    assert tail_from_load(0.25, 0.5, 0.0, 10, 0.2, None, 2.1)
    assert not tail_from_load(0.10, 0.5, 0.0, 10, 0.2, None, 2.1)


def test_a_tail_with_no_queue_under_the_target_does_not_grow_prefill():
    """The TTFT proportional rule grows prefill for a tail that load made. A pool at 28% (under
    its 50% target) with nobody waiting and a queue-time tail of 10 ms has a 3.7 s tail from its
    prompts' length: no growth (bursty/s0 of the tuning suite went 6 -> 10 on it). The same tail
    with the queue's tail covering the excess, or with requests waiting, still grows the pool."""
    cap = PrefillCapacity(tokens_per_s=36000.0, samples=10)
    base = dict(ready=6, starting=0, uncached_tps=61000.0, requests_per_s=10.0, waiting=0.0, ttft_tail_s=3.7,
                ttft_slo_s=2.4, long_busy_share=0.2, settled=True)
    quiet = size_prefill(PrefillObs(**base, queue_tail_s=0.01), cap, PK)
    assert "ttft_over_sla" not in quiet.reasons and quiet.desired <= 6
    assert "ttft_tail_not_from_load" in quiet.reasons
    queued = size_prefill(PrefillObs(**base, queue_tail_s=1.5), cap, PK)
    assert "ttft_over_sla" in queued.reasons and queued.desired > 6
    assert "ttft_over_sla" in size_prefill(PrefillObs(**base), cap, PK).reasons  # no queue histogram: as before
    waiting = size_prefill(PrefillObs(**{**base, "waiting": 20.0}, queue_tail_s=0.01), cap, PK)
    assert "ttft_over_sla" in waiting.reasons


def test_tpot_spread_recovers_the_per_request_scatter_from_histogram_buckets():
    import numpy as np

    from exporters.contract import TPOT_BUCKETS
    from sla_guard.scale.learn import TpotSpread, tpot_headroom, update_tpot_spread

    rng = np.random.default_rng(7)
    edges = (*TPOT_BUCKETS, math.inf)
    for sigma in (0.03, 0.08, 0.25):
        sp = TpotSpread()
        assert sp.sigma() is None  # no evidence: the configured headroom stands
        for _ in range(15):  # windows of 80 requests at means spread over 13-19 ms
            mean = rng.uniform(0.013, 0.019)
            x = mean * np.exp(rng.normal(-sigma ** 2 / 2, sigma, 80))
            sp = update_tpot_spread(sp, {e: float((x <= e).sum()) for e in edges}, float(x.mean()))
        assert sp.sigma() == pytest.approx(sigma, rel=0.3)
    # p95 of a lognormal factor with mean 1: exp(-s^2/2 + 1.645 s); the headroom is its inverse
    assert tpot_headroom(0.1, 0.95) == pytest.approx(math.exp(0.005 - 1.6449 * 0.1), rel=1e-3)
    assert tpot_headroom(0.0, 0.95) == pytest.approx(1.0)
