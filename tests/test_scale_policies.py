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


def _client_case(prefill_leg: float | None, decode_leg: float = 0.08):
    """2 prefill engines, lightly loaded, whose own TTFT is 0.5 s (inside the 2.5 s SLA), one
    decode engine; a proxy measuring ``prefill_leg`` + ``decode_leg`` per request (none if
    ``prefill_leg`` is None). Returns the advisor's decisions after two minutes."""
    from sla_guard.scale.advisor import Advisor

    cfg = AdvisorConfig.model_validate({"profile": {"prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01,
                                                    "decode_step_per_request_s": 0.0002}, "window_s": 60})
    adv = Advisor(cfg, model="m", slo_ttft_s=2.5)
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
