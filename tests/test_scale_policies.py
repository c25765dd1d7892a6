"""Replay policies: registered with the simulator, and `sla-guard replay --policy guard` prints its
JSON line on a real (short) slice of the shared Azure trace through the real simulator, store
and advisor. The queue and planner baselines are checked on hand-driven engines in the real store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from scale_support import Engine
from scale_support import run as _run
from scale_support import store as _store

from sla_guard.scale.core import PrefillKnobs, PrefillObs, size_prefill
from sla_guard.scale.learn import PrefillCapacity
from sla_guard.settings.advisor import AdvisorConfig
from sla_guard.sim.policy import (
    Observation,
    PlannerPolicy,
    PoolState,
    QueuePolicy,
    decode_batch_at_itl,
    get_policy,
    policy_names,
    prefill_tokens_per_s,
)
from sla_guard.sim.profile import load_profile
from sla_guard.sim.traces import BUNDLED_MOONCAKE

REPO = Path(__file__).resolve().parent.parent


def test_all_four_policies_are_registered():
    assert {"static", "queue", "planner", "guard"} <= set(policy_names())
    assert get_policy("guard").name == "guard"


def _obs(store, now, prefill=(2, 0), decode=(2, 0)) -> Observation:
    pools = {"prefill": PoolState("prefill", prefill[0], prefill[1], 0, 16),
             "decode": PoolState("decode", decode[0], decode[1], 0, 16)}
    return Observation(now=now, model="m", pools=pools, view=store, profile=load_profile("default"))


def test_queue_policy_follows_waiting_over_threshold_with_cooldown():
    store = _store()
    engines = [Engine("prefill", "p0"), Engine("prefill", "p1"), Engine("decode", "d0"), Engine("decode", "d1")]
    _run(engines, store, 0, 60, p0={"running": 4, "waiting": 9}, p1={"running": 4, "waiting": 8},
         d0={"running": 5, "waiting": 0}, d1={"running": 5, "waiting": 0})
    q = QueuePolicy()
    out = q.decide(60, _obs(store, 60))
    assert out["prefill"] == 4  # ceil(17 / 5)
    assert out["decode"] == 1  # no queue: down to the minimum (first action, no cooldown yet)
    _run(engines, store, 65, 120, p0={"running": 1, "waiting": 0}, p1={"running": 1, "waiting": 0},
         d0={"running": 5, "waiting": 0}, d1={"running": 5, "waiting": 0})
    # queue gone, but the last action was 60 s ago: 360 s cooldown holds the size
    assert "prefill" not in q.decide(120, _obs(store, 120, prefill=(4, 0)))


def test_planner_uses_profile_capacity_and_load_loop():
    prof = load_profile("default")
    assert prefill_tokens_per_s(prof, 12_000) > prefill_tokens_per_s(prof, 60_000) > 0
    # a looser ITL target admits a bigger batch
    assert decode_batch_at_itl(prof, 0.030, 12_000) > decode_batch_at_itl(prof, 0.020, 12_000) > 0
    store = _store()
    engines = [Engine("prefill", "p0"), Engine("decode", "d0")]
    # every prefill engine misses TTFT: the load loop adds one
    _run(engines, store, 0, 120, p0={"running": 3, "waiting": 0, "computed": 20_000, "prefills": 2, "ttft": 6.0},
         d0={"running": 10, "waiting": 0, "steps": 300, "tpot": 0.012})
    p = PlannerPolicy()
    p._next_throughput = 1e18  # exercise the load loop alone
    out = p.decide(120, _obs(store, 120, prefill=(1, 0), decode=(1, 0)))
    assert out.get("prefill") == 2
    # and nothing new while a scaling is in progress
    assert p.decide(125, _obs(store, 125, prefill=(1, 1), decode=(1, 0))) == {}


def test_proven_utilization_blocks_shrinking_into_unseen_load():
    obs = PrefillObs(ready=4, starting=0, uncached_tps=30_000.0, requests_per_s=3.0, waiting=0.0,
                     ttft_tail_s=1.0, peak_uncached_tps=40_000.0)
    cap = PrefillCapacity(35_000.0, 10)
    knobs = PrefillKnobs.from_config(AdvisorConfig())  # production: target 0.5, margin 0.2
    free = size_prefill(obs, cap, knobs)
    assert free.fits_at_n_minus_1  # 40k / (3 x 35k) = 0.38 <= 0.4
    held = size_prefill(obs, cap, PrefillKnobs.from_config(AdvisorConfig(), proven_utilization=0.25))
    assert not held.fits_at_n_minus_1
    assert held.numbers["proven_utilization"] == 0.25


def test_replay_policy_guard_prints_one_json_line():
    """The bundled copy of the Mooncake trace (always in the repo), first 5 minutes."""
    cmd = [sys.executable, "-m", "sla_guard.cli", "replay", "--trace", str(BUNDLED_MOONCAKE), "--policy", "guard",
           "--duration", "300", "--drain-s", "60"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if x.strip()]
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["policy"] == "guard"
    for key in ("slo_attainment", "gpu_hours", "scaling_actions", "ttft_p90_s", "tpot_p90_s"):
        assert key in line
    assert line["requests"] > 500 and 0 <= line["slo_attainment"] <= 1
    # Mooncake's prompt load needs more prefill and less decode than 2P2D: the guard acts
    assert line["scaling_actions"] >= 1 and line["eval_errors"] == 0


def test_guard_policy_turns_a_leak_finding_into_one_rolling_restart():
    from sla_guard.model import Finding
    from sla_guard.sim.policy import GuardPolicy

    store = _store()
    engines = [Engine("prefill", "p0"), Engine("decode", "d0")]
    _run(engines, store, 0, 60, p0={"running": 1, "waiting": 0, "computed": 5000, "prefills": 1},
         d0={"running": 10, "waiting": 0, "steps": 400})
    leak = Finding(detector="leak", key="leak:d0", severity="warning", summary="RSS grows",
                   labels={"model": "m", "pool": "decode", "instance": "d0", "process": "EngineCore_DP0"})
    pol = GuardPolicy()
    obs = _obs(store, 60, prefill=(1, 0), decode=(1, 0))
    obs = Observation(now=obs.now, model=obs.model, pools=obs.pools, view=store, findings=(leak,),
                      profile=obs.profile)
    out = pol.decide(60, obs)
    assert "decode" not in out or out["decode"] <= 1  # a leak is not a reason to scale
    assert pol.restarts() == ["d0"]
    pol.decide(75, obs)
    assert pol.restarts() == []  # the same finding does not restart the replica twice


# --- TTFT from the client scope ----------------------------------------------------------------


class _Proxy:
    """A P/D proxy's client scope recorded through the simulator's ``ClientMetrics`` and scraped
    into the store like an engine (pool="client", route="pd")."""

    def __init__(self) -> None:
        from sla_guard.sim.exposition import ClientMetrics

        self.m = ClientMetrics("m", "test-proxy")

    def tick(self, prefill_leg: float, decode_leg: float, proxy: float = 0.02, n: int = 20) -> None:
        self.m.first_tokens([prefill_leg + decode_leg + proxy] * n, [prefill_leg] * n, [decode_leg] * n, [proxy] * n)
        self.m.finished([0.012] * n, [5.0] * n)

    def scrape(self, store, t: float) -> None:
        store.ingest_samples(self.m.samples(), t, {"instance": "test-proxy"})


def _client_case(prefill_leg: float | None, decode_leg: float = 0.08, decode_shrunk_at: float | None = None):
    """2 prefill engines, lightly loaded, whose own TTFT is 0.5 s (inside the 2.5 s SLA), one
    decode engine; a proxy measuring ``prefill_leg`` + ``decode_leg`` per request (none if
    ``prefill_leg`` is None). Returns the advisor's decisions after two minutes."""
    from sla_guard.scale.advisor import Advisor

    cfg = AdvisorConfig.model_validate({"profile": {"prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01,
                                                    "decode_step_per_request_s": 0.0002}, "window_s": 60})
    adv = Advisor(cfg, model="m", slo_ttft_s=2.5)
    if decode_shrunk_at is not None:
        adv.memory["decode"].last_down_t = decode_shrunk_at
    store = _store()
    engines = [Engine("prefill", "p0"), Engine("prefill", "p1"), Engine("decode", "d0")]
    # running 0 at every scrape: too idle to learn capacity from, so the prior (10k tokens/s) holds
    light = {"running": 0, "waiting": 0, "computed": 10_000, "prefills": 4, "ttft": 0.5, "steps": 5}
    proxy = _Proxy() if prefill_leg is not None else None
    t = 1000.0
    while t <= 1120:
        for e in engines:
            # decode: 5 ms steps at a batch of 10, TPOT 5 ms: far inside its limits
            e.tick(**(light if e.name.startswith("p") else {"running": 10, "waiting": 0, "steps": 1000,
                                                              "tpot": 0.005}))
            e.scrape(store, t)
        if proxy is not None:
            proxy.tick(prefill_leg, decode_leg)
            proxy.scrape(store, t)
        t += 5
    decs, _ = adv.step(store, 1120, {"prefill": (2, 0), "decode": (1, 0)})
    return decs


def test_advisor_judges_ttft_on_the_client_scope_where_it_exists():
    """The prefill engines report TTFT 0.5 s, the client sees ~3.9 s, spent in the prefill leg:
    the advisor grows prefill on the client's TTFT; reading the prefill pool's TTFT it would not
    (the same engines without a proxy: no breach, no growth)."""
    without = _client_case(None)["prefill"]
    assert without.direction != "up" and "ttft_over_sla" not in without.reasons
    assert "ttft_from_client" not in without.numbers and without.numbers["ttft_tail_s"] < 2.5
    decs = _client_case(prefill_leg=3.8)
    pre = decs["prefill"]
    assert pre.direction == "up" and pre.desired > 2 and "ttft_over_sla" in pre.reasons
    assert pre.numbers["ttft_from_client"] == 1.0 and pre.numbers["client_ttft_tail_s"] > 2.5
    assert pre.numbers["ttft_outside_prefill_s"] == pytest.approx(0.1)  # decode leg 0.08 + proxy 0.02
    assert pre.confidence > 0
    assert "client_ttft_over_sla_decode_leg" not in decs["decode"].reasons


def test_a_slow_decode_leg_is_blamed_on_decode_not_prefill():
    """The client's TTFT (~3.9 s) is over the SLA but the time goes to the decode first leg (KV
    hand-off, decode queue): prefill is not grown for it, decode is, with its own reason."""
    decs = _client_case(prefill_leg=0.4, decode_leg=3.4)
    pre, dec = decs["prefill"], decs["decode"]
    assert pre.direction != "up" and "ttft_over_sla" not in pre.reasons
    assert pre.numbers["client_ttft_tail_s"] > 2.5 and pre.numbers["ttft_tail_s"] < pre.numbers["ttft_slo_s"]
    assert dec.direction == "up" and "client_ttft_over_sla_decode_leg" in dec.reasons
    assert dec.numbers["decode_first_leg_tail_s"] > dec.numbers["prefill_leg_tail_s"]
    # a measured tail, not a forecast: it undoes a decode scale-down even within the no-reversal span
    dec = _client_case(prefill_leg=0.4, decode_leg=3.4, decode_shrunk_at=1000.0)["decode"]
    assert dec.direction == "up" and "hold_forecast_within_no_reversal" not in dec.reasons


def test_issue15_baselines_are_registered():
    assert {"keda-hpa", "planner-throughput", "planner-load", "slo-keda"} <= set(policy_names())
    assert get_policy("planner-throughput").mode == "throughput"
    assert get_policy("planner-load").mode == "load"


def test_keda_hpa_tolerance_and_300s_scale_down_stabilisation():
    """HPA on an External AverageValue target: desired = ceil(total / 5); inside the 10%
    tolerance nothing moves; a scale-down waits for the highest recommendation of 300 s."""
    from sla_guard.sim.policy import KedaHpaPolicy

    store = _store()
    engines = [Engine("prefill", "p0"), Engine("prefill", "p1"), Engine("decode", "d0")]
    _run(engines, store, 0, 60, p0={"running": 4, "waiting": 10}, p1={"running": 4, "waiting": 10},
         d0={"running": 5, "waiting": 0})
    k = KedaHpaPolicy()
    out = k.decide(60, _obs(store, 60, decode=(1, 0)))
    assert out["prefill"] == 4  # ceil(20 / 5); usage ratio 2.0 is outside the tolerance
    _run(engines, store, 65, 120, p0={"running": 4, "waiting": 10}, p1={"running": 4, "waiting": 11},
         d0={"running": 5, "waiting": 0})
    # 21 waiting on 4 replicas: ratio 1.05, within 10%: hold
    assert "prefill" not in k.decide(120, _obs(store, 120, prefill=(4, 0), decode=(1, 0)))
    _run(engines, store, 125, 400, p0={"running": 1, "waiting": 0}, p1={"running": 1, "waiting": 0},
         d0={"running": 5, "waiting": 0})
    # the queue is gone, but 300 s of recommendations still hold 4
    assert "prefill" not in k.decide(300, _obs(store, 300, prefill=(4, 0), decode=(1, 0)))
    for t in range(315, 460, 15):
        out = k.decide(t, _obs(store, t, prefill=(4, 0), decode=(1, 0)))
    assert out.get("prefill") == 1  # 300 s after the last recommendation of 4


def test_slo_keda_dead_band_and_credit_for_warming_replicas():
    from sla_guard.sim.policy import SloKedaPolicy

    store = _store()
    engines = [Engine("prefill", "p0"), Engine("decode", "d0")]
    # TTFT p90 at 2x the 2.5 s SLA: s clamps at 2 -> ceil(1 x 2 / 0.55) = 4
    _run(engines, store, 0, 120, p0={"running": 3, "waiting": 0, "ttft": 6.0},
         d0={"running": 5, "waiting": 0, "tpot": 0.009})
    p = SloKedaPolicy()
    out = p.decide(120, _obs(store, 120, prefill=(1, 0), decode=(1, 0)))
    assert out.get("prefill") == 4 and "decode" not in out  # TPOT 9 ms / 20 ms = 0.45: dead band
    # the 3 ordered replicas are warming up: credited, nothing more is ordered
    assert "prefill" not in p.decide(135, _obs(store, 135, prefill=(1, 3), decode=(1, 0)))


def test_workload_suite_halves_are_disjoint_and_deterministic():
    from sla_guard.sim.workloads import FAMILIES, generated, phased, suite

    tuning, sealed = suite("tuning", traces=False), suite("sealed", traces=False)
    assert {w.family for w in tuning} == {w.family for w in sealed} == set(FAMILIES)
    assert not {(w.family, w.seed) for w in tuning} & {(w.family, w.seed) for w in sealed}
    a, b = generated("step_up", 3, 1800.0), generated("step_up", 3, 1800.0)
    assert a.requests == b.requests and len(a.requests) > 100
    # the step shows in the arrivals: the second half carries about twice the first
    late = sum(r.t >= 1000 for r in a.requests) / 800
    early = sum(r.t < 700 for r in a.requests) / 700
    assert late > 1.7 * early
    src = generated("diurnal", 1, 1200.0)
    ph = phased(src, [0.5, 2.0], 300.0)
    first = sum(r.t < 300 for r in ph.requests)
    assert ph.duration_s <= 600 and first < sum(r.t >= 300 for r in ph.requests) / 2


def test_a_missing_shared_trace_is_warned_about_not_dropped_silently(tmp_path, monkeypatch):
    """The Azure cells need the shared trace; where it is not found (a package installed
    elsewhere, a worktree in another folder) the suite says so and names the setting that fixes
    it, and ``$SLA_GUARD_TRACES`` points the suite at the folder. Mooncake falls back to its
    bundled copy either way."""
    from sla_guard.sim import workloads as wl

    monkeypatch.setenv(wl.TRACES_ENV, str(tmp_path))
    with pytest.warns(UserWarning, match="azure trace is not in .*SLA_GUARD_TRACES"):
        names = [w.name for w in wl.suite("tuning")]
    assert not [n for n in names if n.startswith("azure@")] and [n for n in names if n.startswith("mooncake@")]
    (tmp_path / wl.TRACE_FILES["azure"]).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert wl.shared_trace_path("azure") == tmp_path / wl.TRACE_FILES["azure"]
    assert [w.name for w in wl.suite("tuning") if w.name.startswith("azure@")]


def test_a_surge_is_met_in_one_step_counting_starting_replicas():
    """A sizing driven by demand may add replicas while others still start (they are counted as
    present), and by up to max_step_up at once; a tail rule waits for the starting ones."""
    from sla_guard.scale.core import Sizing
    from sla_guard.scale.guardrails import PoolMemory, Rails, decide

    mem, rails = PoolMemory(), Rails(cooldown_s=60, max_step_up=4)
    d = decide("prefill", 0, 1, 0, Sizing(5, ["prefill_demand_over_capacity"], {}, demand_driven=True), mem, rails)
    assert (d.direction, d.desired) == ("up", 5)  # 1 -> 5 in one step
    d = decide("prefill", 15, 1, 4, Sizing(7, ["prefill_demand_over_capacity"], {}, demand_driven=True), mem, rails)
    assert (d.direction, d.desired) == ("up", 7)  # demand grew past what is starting: ordered now
    d = decide("prefill", 30, 1, 6, Sizing(8, ["ttft_over_sla"], {}), mem, rails)
    assert d.direction == "none" and "hold_replicas_starting" in d.reasons


def test_decode_holds_while_prefill_grows():
    """Prefill and decode decided together: a prefill backlog raises decode's forecast
    concurrency (upstream gain) and decode gives nothing back while prefill grows."""
    from sla_guard.scale.advisor import Advisor
    from sla_guard.scale.core import Sizing

    pre = Sizing(4, ["prefill_backlog"], {"demand_uncached_tokens_per_s": 100_000.0, "backlog_tokens_per_s": 50_000.0,
                                          "demand_trend_tokens_per_s": 0.0}, demand_driven=True)
    gain, growing = Advisor._upstream(pre, (2, 0))
    assert gain == pytest.approx(1.5) and growing
    gain, growing = Advisor._upstream(Sizing(2, ["prefill_steady"], {}), (2, 0))
    assert gain == 1.0 and not growing


def test_a_surge_on_one_replica_is_not_ordered_for_its_pinned_queue():
    """The simulator routes each request to a prefill replica at arrival and never moves it, as
    vLLM engines behind a P/D proxy do. A surge of long prompts after a quiet spell piles up on
    the one replica left: sizing for that queue (``queue_moves: true``) orders replicas that never
    reach it; sizing the arrivals on the others buys the same attainment for far fewer GPU-hours."""
    from sla_guard.sim import workloads
    from sla_guard.sim.run import ReplaySpec, replay

    w = workloads._gen_workload("surge_after_quiet", 2, "tuning", 1800.0)  # a tuning seed
    trace, profile = w.trace(), w.profile(load_profile("default"))
    out = {}
    for moves in (False, True):
        res = replay(ReplaySpec(profile=profile, trace=trace, policy="guard", scrape_interval_s=15.0,
                                with_guard=False, with_detectors=False,
                                policy_kwargs={"config": {"queue_moves": moves}}))
        out[moves] = (res.summary, max(row[3] for row in res.dep.timeline))
    (held, held_peak), (moved, moved_peak) = out[False], out[True]
    assert held.aborted == moved.aborted == 0
    assert held_peak < moved_peak
    assert held.gpu_hours < 0.8 * moved.gpu_hours
    assert held.slo_attainment >= moved.slo_attainment - 0.01
