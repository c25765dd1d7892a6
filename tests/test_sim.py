"""The simulator: determinism, conservation, lifecycle, faults visible in the contract metrics, and
metrics over real HTTP matching the simulated events."""

from __future__ import annotations

import itertools

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporters import contract as c
from exporters.contract import Component
from sla_guard.sim.deployment import DOWN, DRAINING, READY, STARTING, STOPPED, Deployment
from sla_guard.sim.faults import FaultSchedule, parse_fault
from sla_guard.sim.harness import ClosedLoop, make_store
from sla_guard.sim.live import LiveEndpoints
from sla_guard.sim.profile import ProfileError, load_profile
from sla_guard.sim.traces import BUNDLED_MOONCAKE, Trace, TraceRequest, agentic_sessions, load_trace

PROFILE = load_profile("default")


@pytest.fixture(scope="module")
def mooncake():
    return load_trace(BUNDLED_MOONCAKE)


def _run(trace, seconds, *, seed=0, faults=(), p=2, d=2, record=False, profile=PROFILE, drain=300):
    dep = Deployment(profile, p, d, seed=seed, faults=FaultSchedule(faults), record=record)
    dep.submit(trace.scaled(duration_s=seconds))
    dep.run_until(seconds + drain)
    return dep


def _timings(dep):
    return [(r.rid, r.first_token, r.finish, r.generated) for r in dep.done]


def test_deterministic_for_a_seed(mooncake):
    a, b = _run(mooncake, 300, seed=7), _run(mooncake, 300, seed=7)
    assert _timings(a) == _timings(b)
    assert a.summary() == b.summary()
    other = _run(mooncake, 300, seed=8)
    assert _timings(other) != _timings(a)


def test_every_request_finishes_or_is_accounted(mooncake):
    faults = [{"kind": "crash", "replica": "d1", "at_s": 120.0, "restart_after_s": 60.0},
              {"kind": "transfer_failures", "start_s": 50, "end_s": 100, "prob": 0.5}]
    dep = _run(mooncake, 300, faults=faults, drain=900)
    s = dep.summary()
    assert s.requests == len(dep.requests) > 500
    assert s.finished + s.aborted + s.unfinished == s.requests
    assert s.aborted > 0  # the crash lost its in-flight requests
    assert s.unfinished == 0  # everything else drained
    assert all(r.generated == r.output_len for r in dep.done)
    assert {r.status for r in dep.aborted} == {"aborted"}


def test_a_summary_mid_run_counts_only_the_requests_sent_so_far(mooncake):
    """The demo submits the whole run's arrivals up front; an interrupted demo's report (5.3 of
    50 simulated minutes) counted all 11,605 as requests, 10,646 of them "unfinished" although
    never sent, and its attainment read 7.28%."""
    dep = Deployment(PROFILE, 2, 2, seed=0)
    dep.submit(mooncake.scaled(duration_s=600))
    dep.run_until(120)
    s = dep.summary()
    sent = sum(r.arrival <= 120 for r in dep.requests)
    assert 0 < sent < len(dep.requests) / 2
    assert s.requests == sent and s.finished + s.aborted + s.unfinished + s.rejected == sent
    assert s.slo_attainment > 0.5


def test_load_is_served_with_prefix_hits_and_spec_decode(mooncake):
    dep = _run(mooncake, 600)
    s = dep.summary()
    hit = sum(r.hit_tokens for r in dep.done) / sum(r.input_len for r in dep.done)
    assert 0.05 < hit < 0.6  # Mooncake reuses prefixes (ideal reuse ~37%)
    # MTP with [0.80, 0.65, 0.52] emits ~2.97 tokens per step: TPOT well under one step time
    assert s.tpot_mean_s < PROFILE.decode.step_base_s / 2
    assert 0 < s.ttft_p50_s < s.ttft_p90_s


def test_no_hashes_means_no_prefix_hits():
    reqs = tuple(TraceRequest(i * 0.5, 4000, 50) for i in range(100))
    dep = _run(Trace("flat", reqs), 60)
    assert sum(r.hit_tokens for r in dep.done) == 0
    assert dep.summary().finished == 100


def test_kv_full_preempts_and_still_finishes():
    small = PROFILE.model_copy(update={"kv": PROFILE.kv.model_copy(update={"decode_capacity_tokens": 50_000})})
    reqs = tuple(TraceRequest(i * 0.05, 8000, 1000) for i in range(40))
    dep = _run(Trace("burst", reqs), 10, profile=small, record=True, drain=3000)
    s = dep.summary()
    assert s.finished == 40
    pre = sum(r.metrics.registry.get_sample_value(c.PREEMPTIONS.exposed, {"model": "glm-5.2", "pool": "decode",
                                                                            "engine": r.name})
              for r in dep.replicas if r.pool == "decode")
    assert pre > 0


def test_scale_up_cold_starts_and_scale_down_drains(mooncake):
    dep = Deployment(PROFILE, 1, 1, record=False)
    dep.submit(mooncake.scaled(duration_s=900))
    dep.run_until(10)
    dep.set_replicas("prefill", 2)
    new = dep.replicas[-1]
    assert new.state == STARTING and dep.pool_counts("prefill")[READY] == 1
    dep.run_until(10 + PROFILE.cold_start_s + 1)
    assert new.state == READY
    dep.set_replicas("prefill", 1)
    dep.run_until(1200)
    assert sum(r.state == STOPPED for r in dep.replicas if r.pool == "prefill") == 1
    assert dep.scaling_actions == 2
    # GPU-hours: 2 replicas the whole time + the one that lived a while
    base = 2 * 1200 / 3600 * PROFILE.gpus_per_replica
    assert base < dep.gpu_hours() < base + 1200 / 3600 * PROFILE.gpus_per_replica
    assert dep.summary().unfinished == 0


def test_scale_down_drains_in_flight_work_nothing_is_aborted(mooncake):
    """Scale-down never loses a request (issue 15): a removed prefill replica finishes its queue
    and keeps its KV until decode has pulled it; a removed decode replica finishes its batch,
    its queue and the pulls it has in flight (decode requests waiting on remote KV)."""
    from sla_guard.sim.deployment import DRAINING

    dep = Deployment(PROFILE, 4, 3, record=False)
    dep.submit(mooncake.scaled(time_scale=0.5, duration_s=900))
    caught = {"prefill": 0, "decode": 0}  # in-flight requests on replicas told to go
    for t in range(60, 900, 97):
        dep.run_until(t)
        for pool in ("prefill", "decode"):
            ready = dep.pool_counts(pool)[READY]
            before = {r.name for r in dep.replicas if r.state == DRAINING}
            dep.set_replicas(pool, 1 if ready > 1 else 3)
            caught[pool] += sum(r.load() + len(getattr(r, "held", ())) for r in dep.replicas
                                if r.pool == pool and r.state == DRAINING and r.name not in before)
    dep.run_until(900 + 1800)
    s = dep.summary()
    assert caught["prefill"] > 0 and caught["decode"] > 0  # replicas went with work in flight
    assert s.aborted == 0 and s.unfinished == 0 and s.finished == s.requests
    assert not any(r.state == DRAINING for r in dep.replicas)  # every drain completed


def test_profile_errors_name_the_field(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text(PROFILE.model_dump_json().replace('"num_spec_tokens":3', '"num_spec_tokens":2'))
    with pytest.raises(ProfileError, match="spec"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="not found; use one of: default"):
        load_profile("nope")
    with pytest.raises(ValueError, match="unknown field"):
        parse_fault({"kind": "leak", "replica": "d0", "mib_per_h": 1})
    with pytest.raises(ValueError, match="unknown"):
        parse_fault({"kind": "meteor"})


def _scrape(url: str) -> dict:
    """Parse an exposition into {(sample name, frozenset(labels)): value}."""
    text = httpx.get(url, timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _sum(samples: dict, name: str, **match) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and all((k, x) in lab for k, x in match.items()))


def test_metrics_over_http_match_the_simulated_events(mooncake):
    """Real loopback HTTP servers, one per engine; a real parser reads what they serve."""
    dep = Deployment(PROFILE, 2, 2, record=True)
    dep.submit(mooncake.scaled(duration_s=120))
    with LiveEndpoints(dep) as ep:
        dep.every(5, lambda d, now: d.sample_processes(), start_s=0)
        dep.run_until(400)
        assert dep.summary().unfinished == 0
        per = {r.name: _scrape(ep.url(r)) for r in dep.replicas}
    done = dep.done
    for rep in dep.replicas:
        s = per[rep.name]
        mine_p = [r for r in done if r.p_replica is rep]
        mine_d = [r for r in done if r.d_replica is rep]
        if rep.pool == "prefill":
            assert _sum(s, c.REQUEST_TTFT.series("_count")) == len(mine_p)
            assert _sum(s, c.GENERATION_TOKENS.exposed) == len(mine_p)  # max_tokens=1 on prefill
            assert _sum(s, c.PROMPT_TOKENS.exposed, source="local_cache_hit") == sum(r.hit_tokens for r in mine_p)
            assert _sum(s, c.REQUEST_TPOT.series("_count")) == 0
        else:
            assert _sum(s, c.REQUEST_TTFT.series("_count")) == len(mine_d)
            assert _sum(s, c.REQUEST_TPOT.series("_count")) == sum(r.generated > 1 for r in mine_d)
            assert _sum(s, c.GENERATION_TOKENS.exposed) == sum(r.generated for r in mine_d)
            assert _sum(s, c.PROMPT_TOKENS.exposed, source="external_kv_transfer") == sum(
                r.xfer_tokens for r in mine_d)
            assert _sum(s, c.KV_XFER_DURATION.series("_count")) == len(mine_d)
            tpot_sum = sum((r.finish - r.first_token) / (r.generated - 1) for r in mine_d if r.generated > 1)
            assert _sum(s, c.REQUEST_TPOT.series("_sum")) == pytest.approx(tpot_sum, rel=1e-9)
            drafted = _sum(s, c.SPEC_DRAFT_TOKENS.exposed)
            acc = _sum(s, c.SPEC_ACCEPTED_TOKENS.exposed)
            assert 0.55 < acc / drafted < 0.77  # profile: (0.80 + 0.65 + 0.52) / 3 = 0.657
            pos = [_sum(s, c.SPEC_ACCEPTED_TOKENS_POS.exposed, position=str(i)) for i in range(3)]
            assert pos[0] > pos[1] > pos[2] > 0 and sum(pos) == acc
            # every generated token is 1 per request-step plus accepted drafts (capped at output_len)
            assert acc <= _sum(s, c.GENERATION_TOKENS.exposed)
        rss = [v for (n, lab), v in s.items() if n == c.PROCESS_RSS.name]
        assert len(rss) == len(PROFILE.processes) and all(1e9 < v < 1e10 for v in rss)
    # every family of the engine, KV-transfer and process components is exposed by the deployment
    names = {n for s in per.values() for n, _ in s}
    # the census's growers exist only while a container grows (a leak fault that names it:
    # tests/test_census.py); its walk statistics always
    growers = {c.CENSUS_CONTAINER_LENGTH, c.CENSUS_CONTAINER_GROWTH, c.CENSUS_CONTAINER_BYTES, c.CENSUS_RSS_EXPLAINED}
    for m in c.ALL:
        if m.component in (Component.ENGINE, Component.KV_TRANSFER, Component.PROCESS) and m not in growers:
            assert any(n.startswith(m.name) for n in names), m.name


def _rss_slope_mib_h(store, dep, engine, role, ref_engine, end_s=None):
    """Slope of an RSS series minus its twin's (same start, same warm-up and GC phase): the leak."""
    end = dep.epoch + (dep.now if end_s is None else end_s)
    (s,) = store.range(c.PROCESS_RSS.name, {"engine": engine, "role": role}, dep.epoch, end)
    (r,) = store.range(c.PROCESS_RSS.name, {"engine": ref_engine, "role": role}, dep.epoch, end)
    t, a, b = np.intersect1d(s.t, r.t, return_indices=True)
    slope = np.polyfit(t, s.v[a] - r.v[b], 1)[0]
    return slope * 3600 / 2**20


def test_faults_are_visible_in_the_metrics(mooncake):
    """Leak slope on one EngineCore only, acceptance drop, transfer slowdown, counter reset on restart."""
    faults = [{"kind": "leak", "replica": "d0", "role": "engine_core", "mib_per_hour": 48, "start_s": 0},
              {"kind": "acceptance_drift", "start_s": 1200, "end_s": 1500, "to_factor": 0.5},
              {"kind": "transfer_slowdown", "start_s": 1200, "end_s": 2400, "factor": 5.0},
              {"kind": "crash", "replica": "p1", "at_s": 2000, "restart_after_s": 100}]
    dep = Deployment(PROFILE, 2, 2, faults=FaultSchedule(faults))
    dep.submit(mooncake.scaled(duration_s=2400))
    store = make_store(interval_s=15)
    ClosedLoop(dep, store=store, scrape_interval_s=15)
    start_times = {}

    def info(d, now):
        r = next(x for x in d.replicas if x.name == "p1")
        start_times[now] = r.sampler.started_at if r.metrics is not None else None

    dep.every(100, info)
    dep.run_until(2400)
    at = dep.epoch + dep.now
    # leak: ~48 MiB/h on d0's EngineCore over what its twin d1 shows (same warm-up growth), no leak on p0
    assert 38 < _rss_slope_mib_h(store, dep, "d0", "engine_core", "d1") < 58
    assert abs(_rss_slope_mib_h(store, dep, "p0", "engine_core", "p1", end_s=1990)) < 10
    # acceptance: ~0.657 before, ~0.5 x that after the drift
    def acceptance(t):
        a = store.increase(c.SPEC_ACCEPTED_TOKENS.exposed, {"pool": "decode"}, 600, t, ())
        d = store.increase(c.SPEC_DRAFT_TOKENS.exposed, {"pool": "decode"}, 600, t, ())
        return sum(a.values()) / sum(d.values())

    before, after = acceptance(dep.epoch + 1200), acceptance(at)
    assert 0.6 < before < 0.72 and after < 0.75 * before
    # transfer slowdown: mean transfer duration several times higher
    def xfer_mean(t):
        s = store.increase(c.KV_XFER_DURATION.series("_sum"), {}, 600, t, ())
        n = store.increase(c.KV_XFER_DURATION.series("_count"), {}, 600, t, ())
        return sum(s.values()) / sum(n.values())

    assert xfer_mean(at) > 3 * xfer_mean(dep.epoch + 1150)
    # crash + restart: p1 went dark, came back with a new process and counters from zero
    assert start_times[1900] is not None and start_times[2000] is None and start_times[2200] is not None
    assert start_times[2200] != start_times[1900]
    (gen,) = store.range(c.GENERATION_TOKENS.exposed, {"instance": "p1"}, dep.epoch, at)
    drops = np.flatnonzero(np.diff(gen.v) < 0)
    assert len(drops) == 1 and 1950 < gen.t[drops[0] + 1] - dep.epoch < 2250
    up = store.range("up", {"instance": "p1"}, dep.epoch, at)
    assert any((u.v == 0).any() for u in up)


def test_load_spike_adds_requests(mooncake):
    base = Deployment(PROFILE, 2, 2, record=False)
    n0 = base.submit(mooncake.scaled(duration_s=600))
    spiky = Deployment(PROFILE, 2, 2, record=False,
                       faults=FaultSchedule([{"kind": "load_spike", "start_s": 100, "end_s": 200, "factor": 3}]))
    n1 = spiky.submit(mooncake.scaled(duration_s=600))
    in_window = sum(1 for r in mooncake.requests if 100 <= r.t < 200)
    assert n1 - n0 == 2 * in_window


def test_agentic_sessions_shape():
    tr = agentic_sessions(n_sessions=10, duration_s=1800, seed=3)
    assert tr.requests and tr.duration_s <= 1800
    by_agent: dict[int, list] = {}
    for r in tr.requests:
        by_agent.setdefault(r.agent, []).append(r)
    outs = [r.output_len for r in tr.requests]
    assert 150 < float(np.median(outs)) < 450
    # main agents: the context grows turn over turn and keeps its prefix blocks
    grown = 0
    for reqs in by_agent.values():
        reqs.sort(key=lambda r: r.t)
        for a, b in itertools.pairwise(reqs):
            if b.hash_ids[: len(a.hash_ids)] == a.hash_ids and b.input_len > a.input_len:
                grown += 1
    assert grown > len(tr.requests) * 0.7
    gaps = np.diff(sorted(r.t for r in by_agent[0]))
    assert np.median(gaps) < 30 < gaps.max()  # seconds-to-minutes pauses
    # sub-agents: several agents per session, sharing the session's first (system) block
    sessions = {r.session for r in tr.requests}
    assert len(by_agent) > 2 * len(sessions)
    first = {}
    for r in tr.requests:
        first.setdefault(r.session, set()).add(r.hash_ids[0])
    assert all(len(v) == 1 for v in first.values())


def test_crash_of_a_down_target_reads_503(mooncake):
    dep = Deployment(PROFILE, 1, 1, faults=FaultSchedule([{"kind": "crash", "replica": "d0", "at_s": 30}]))
    dep.submit(mooncake.scaled(duration_s=60))
    with LiveEndpoints(dep) as ep:
        dep.run_until(20)
        assert httpx.get(ep.url("d0")).status_code == 200
        dep.run_until(40)
        assert next(r for r in dep.replicas if r.name == "d0").state in (DOWN, STARTING)
        assert httpx.get(ep.url("d0")).status_code == 503


# --- the client scope: what the simulated P/D proxy measures ----------------------------------


def _hist(samples, metric, suffix, **match) -> float:
    return sum(v for n, lab, v in samples if n == metric.series(suffix) and all(lab.get(k) == x
                                                                                 for k, x in match.items()))


def _mean(samples, metric, **match) -> float:
    return _hist(samples, metric, "_sum", **match) / _hist(samples, metric, "_count", **match)


def test_client_ttft_is_the_sum_of_the_simulated_stages(mooncake):
    """Client TTFT mean = prefill queue + prefill (the prefill engines' queue and prefill
    histograms) + KV transfer + decode queue + first step (the decode engines' queue and prefill
    histograms) + four front-end hops + the proxy's own time, all read from the exposed
    histograms; and the router-measured stages split it the same way."""
    fe, ro = 0.004, 0.009
    prof = PROFILE.model_copy(update={"frontend_s": fe, "router_overhead_s": ro})
    dep = Deployment(prof, 2, 2, faults=FaultSchedule([{"kind": "transfer_failures", "start_s": 60, "end_s": 90,
                                                         "prob": 0.3}]))
    dep.submit(mooncake.scaled(duration_s=240))
    dep.run_until(900)
    s = dep.summary()
    assert s.finished == s.requests > 300 and not dep.aborted
    client = dep.proxy.metrics.samples()
    pre = [x for r in dep.replicas if r.pool == "prefill" for x in r.metrics.samples()]
    dec = [x for r in dep.replicas if r.pool == "decode" for x in r.metrics.samples()]
    n = _hist(client, c.CLIENT_TTFT, "_count")
    assert n == s.finished == _hist(pre, c.REQUEST_QUEUE, "_count") == _hist(dec, c.REQUEST_QUEUE, "_count")
    p_queue, p_compute = _mean(pre, c.REQUEST_QUEUE), _mean(pre, c.REQUEST_PREFILL)
    d_wait, d_first = _mean(dec, c.REQUEST_QUEUE), _mean(dec, c.REQUEST_PREFILL)  # KV + decode queue, 1st step
    assert min(p_queue, p_compute, d_wait, d_first) > 0
    ttft = _mean(client, c.CLIENT_TTFT)
    assert ttft == pytest.approx(p_queue + p_compute + d_wait + d_first + 4 * fe + ro, rel=1e-9, abs=1e-9)
    # the stages as the proxy measures them: each leg includes its two HTTP hops
    pleg = _mean(client, c.CLIENT_STAGE, stage="prefill_leg")
    dleg = _mean(client, c.CLIENT_STAGE, stage="decode_first_leg")
    proxy = _mean(client, c.CLIENT_STAGE, stage="proxy")
    assert pleg == pytest.approx(p_queue + p_compute + 2 * fe, rel=1e-9)
    assert dleg == pytest.approx(d_wait + d_first + 2 * fe, rel=1e-9)
    assert proxy == pytest.approx(ro, rel=1e-6)
    assert ttft == pytest.approx(pleg + dleg + proxy, rel=1e-9)
    # the summary's TTFT is the client's; TPOT and e2e as the proxy sees them
    ttfts = np.array([dep.client_ttft(r) for r in dep.done])
    assert ttfts.mean() == pytest.approx(ttft, rel=1e-9)
    assert s.ttft_p50_s == pytest.approx(float(np.quantile(ttfts, 0.5)), abs=1e-6)
    multi = [r for r in dep.done if r.generated > 1]
    assert _hist(client, c.CLIENT_TPOT, "_count") == len(multi)
    assert _hist(client, c.CLIENT_TPOT, "_sum") == pytest.approx(
        sum((r.finish - r.first_token) / (r.generated - 1) for r in multi), rel=1e-9)
    assert _mean(client, c.CLIENT_E2E) == pytest.approx(
        np.mean([r.finish + fe + ro / 3 - r.arrival for r in dep.done]), rel=1e-9)
    assert _hist(client, c.CLIENT_REQUESTS, "", outcome="ok") == s.finished


def test_a_prompt_over_max_model_len_is_the_clients_error_as_the_proxy_counts_it():
    """vLLM refuses a prompt plus max_tokens over max_model_len with a 400; the proxy counts an
    engine's 4xx as ``client_error`` (contract.outcome_of_status), not as the service failing. The
    simulated proxy counted it ``error``, against the operator's error budget."""
    reqs = tuple(TraceRequest(i * 0.5, 500_000 if i % 2 else 2000, 50) for i in range(6))
    dep = Deployment(PROFILE, 1, 1)
    dep.submit(Trace("too-long", reqs))
    dep.run_until(600)
    client = dep.proxy.metrics.samples()
    assert len(dep.rejected) == 3 and not dep.aborted
    got = {o.value: _hist(client, c.CLIENT_REQUESTS, "", outcome=o.value) for o in c.Outcome}
    assert got == {"ok": 3, "error": 0, "client_error": 3, "aborted": 0}
    assert _hist(client, c.CLIENT_E2E, "_count") == 6  # the refused got a whole answer


def test_client_scope_is_served_scraped_and_labelled_as_the_contract_says(mooncake):
    """The proxy is one more /metrics endpoint (pool="client", router="sim-proxy"): every
    client-scope family with exactly the contract's labels, in-flight while requests are served,
    a crash's lost requests as errors; and the harness scrapes it into the guard's store."""
    dep = Deployment(PROFILE, 2, 2, faults=FaultSchedule([{"kind": "crash", "replica": "d1", "at_s": 100,
                                                            "restart_after_s": 30}]))
    dep.submit(mooncake.scaled(duration_s=200))
    store = make_store(interval_s=15)
    ClosedLoop(dep, store=store, scrape_interval_s=15)
    with LiveEndpoints(dep) as ep:
        assert (ep.url("sim-proxy"), {"instance": "sim-proxy", "model": "glm-5.2", "pool": "client"}) in ep.targets()
        dep.run_until(60)
        busy = _scrape(ep.url("sim-proxy"))
        dep.run_until(900)
        done = _scrape(ep.url("sim-proxy"))
    assert _sum(busy, c.CLIENT_IN_FLIGHT.name) > 0 and _sum(done, c.CLIENT_IN_FLIGHT.name) == 0 == dep.in_flight
    base = {"model": "glm-5.2", "pool": "client", "route": "pd", "router": "sim-proxy"}
    assert set(base) == set(c.CLIENT_LABELS)
    extra = {c.CLIENT_REQUESTS.name: {"outcome"}, c.CLIENT_STAGE.name: {"stage"}}
    families = set()
    for name, labels in done:
        fam = max((m for m in c.ALL if name.startswith(m.name)), key=lambda m: len(m.name))
        assert fam.component is Component.ROUTER, name
        families.add(fam.name)
        lab = dict(labels)
        assert {k: lab[k] for k in base} == base
        assert set(lab) - {"le"} == set(c.CLIENT_LABELS) | extra.get(fam.name, set()), (name, lab)
    assert families == {m.name for m in c.by_component(Component.ROUTER)}
    assert {dict(lab)["stage"] for n, lab in done if n.startswith(c.CLIENT_STAGE.name)} == {s.value for s in c.Stage}
    s = dep.summary()
    assert s.aborted > 0 and s.unfinished == 0
    outcome = {o: _sum(done, c.CLIENT_REQUESTS.exposed, outcome=o) for o in ("ok", "error", "aborted")}
    assert outcome == {"ok": s.finished, "error": s.aborted, "aborted": 0}
    assert _sum(done, c.CLIENT_E2E.series("_count")) == s.finished + s.aborted
    # scraped into the store with the target's labels: the guard sees a client scope
    at = dep.epoch + dep.now
    got = store.increase(c.CLIENT_TTFT.series("_count"), {"pool": "client", "route": "pd"}, 900, at, ("instance",))
    assert list(got) and all(dict(k)["instance"] == "sim-proxy" for k in got)
    assert not store.increase(c.CLIENT_TTFT.series("_count"), {"pool": "prefill"}, 900, at, ())


def test_a_prefill_queue_waits_in_waiting_as_in_vllm_v1():
    """vLLM V1's scheduler gives the step's token budget to the running requests first and admits a
    waiting request only while budget is left, so behind a long prompt the queue is `waiting`, not
    `running`, and each prompt's prefill time is its own compute. (Admitting up to max_num_seqs at
    once put a queue in `running` and stretched every prefill time by the prompts admitted before.)"""
    reqs = tuple(TraceRequest(i * 0.001, 30_000, 2) for i in range(10))
    dep = Deployment(PROFILE, 1, 1, record=False)
    dep.submit(Trace("docs", reqs))
    pre = next(r for r in dep.replicas if r.pool == "prefill")
    seen = []
    for t in (0.05, 0.3, 0.6, 1.0, 2.0):
        dep.run_until(t)
        seen.append((len(pre.running), len(pre.waiting)))
    fits = 1 + PROFILE.prefill.chunk_tokens // 30_000  # prompts one step's budget reaches
    assert max(run for run, _ in seen) <= fits, seen
    assert seen[0][1] >= 8, seen
    dep.run_until(120)
    phases = [r.p_done - r.p_sched for r in dep.done]
    assert len(phases) == 10
    # a prompt shares a step with the one or two others the budget reaches (2.6x a lone prompt's
    # phase on average here), not with the whole queue (5x when all ten were admitted at once)
    assert sum(phases) / len(phases) < 3.5 * min(phases), phases


def test_a_failing_policy_is_logged_not_only_counted(caplog):
    """A scaling policy that raises holds the size and the run goes on (as the guard does), but
    the traceback is logged: the run used to end with eval_errors 40 and no word of why."""
    import logging

    from sla_guard.sim.policy import StaticPolicy

    class Broken(StaticPolicy):
        name = "broken"

        def decide(self, now, obs):
            raise RuntimeError("the policy's own bug")

    dep = Deployment(PROFILE, 1, 1)
    dep.submit(Trace("t", tuple(TraceRequest(float(i), 1000, 10) for i in range(20)), 512))
    loop = ClosedLoop(dep, store=make_store(interval_s=15), policy=Broken())
    with caplog.at_level(logging.ERROR, logger="sla_guard.sim.harness"):
        dep.run_until(600)
    assert loop.eval_errors >= 10
    logged = [r for r in caplog.records if "scaling policy broken failed" in r.getMessage()]
    assert 1 <= len(logged) <= 3 and "the policy's own bug" in (logged[0].exc_text or "")


def test_the_gpu_budget_holds_when_both_pools_grow_in_one_tick():
    """Both pools asking for more in the same decision: each pool's share of the budget is what
    the other holds after its own change of this tick (each used to see the other's old size:
    2P2D -> 4P4D = 128 GPUs under a 96-GPU budget)."""

    class Grow:
        name, interval_s = "grow", 15.0

        def decide(self, now, obs):
            return {"prefill": 4, "decode": 4}

    dep = Deployment(PROFILE, 2, 2, record=False)
    loop = ClosedLoop(dep, policy=Grow(), gpu_budget=6 * PROFILE.gpus_per_replica)
    dep.run_until(100)
    held = sum(r.state in (STARTING, READY) for r in dep.replicas) * PROFILE.gpus_per_replica
    assert held <= 6 * PROFILE.gpus_per_replica, loop.actions
    assert loop.actions == [{"t": 15.0, "pool": "decode", "from": 2, "to": 4}]


def _kv_bound_burst(crash: str, p: int = 1, record: bool = False):
    """20 long requests into 1 decode replica with KV for 3 of them: 17 queue there for KV space
    while their prompts' KV waits on the prefill side; ``crash`` crashes at 15 s (back at 25 s)."""
    small = PROFILE.model_copy(update={"kv": PROFILE.kv.model_copy(update={"decode_capacity_tokens": 30_000})})
    dep = Deployment(small, p, 1, record=record,
                     faults=FaultSchedule([{"kind": "crash", "replica": crash, "at_s": 15.0, "restart_after_s": 10.0}]))
    dep.submit(Trace("burst", tuple(TraceRequest(i * 0.2, 8000, 3000) for i in range(20))))
    return dep


def test_a_decode_crash_frees_the_prefill_kv_of_its_queue():
    """Requests queued at a crashed decode replica are aborted, and the prefill KV they were
    waiting to pull is freed: it was held for ever, so a prefill replica told to go never
    stopped (its GPUs counted to the end of the run)."""
    dep = _kv_bound_burst("d0", p=2)
    dep.run_until(14.9)
    assert sum(len(r.held) for r in dep.replicas if r.pool == "prefill") > 10  # queued at d0, KV held
    dep.run_until(100)
    assert all(not r.held and r.active_tokens == 0 for r in dep.replicas if r.pool == "prefill")
    dep.set_replicas("prefill", 1)
    dep.run_until(4000)
    assert sum(r.state == STOPPED for r in dep.replicas if r.pool == "prefill") == 1
    assert dep.gpu_hours() == pytest.approx((100 + 2 * 4000) * PROFILE.gpus_per_replica / 3600)


def test_a_decode_crash_counts_its_errors_as_the_proxy_does_before_or_after_the_first_token():
    """The simulated proxy records what sla-guard-proxy records: each request the crash failed is an error and,
    as every simulated request streams, failed before its first token (a client TTFT attainment miss) or after
    it (a TPOT miss), once."""
    dep = _kv_bound_burst("d0", p=2, record=True)
    dep.run_until(100)
    client = dep.proxy.metrics.samples()
    errors = _hist(client, c.CLIENT_REQUESTS, "", outcome="error")
    before = sum(r.first_token < 0 for r in dep.aborted)
    assert errors == len(dep.aborted) > before > 0
    assert _hist(client, c.CLIENT_FAILED_BEFORE_FIRST_TOKEN, "") == before
    assert _hist(client, c.CLIENT_FAILED_AFTER_FIRST_TOKEN, "") == errors - before


def test_a_replica_that_crashes_while_draining_stays_gone():
    """A replica told to go that crashes before its drain ends stops there: it used to restart
    and come back READY, a replica nobody ordered (and its GPUs counted to the end)."""
    reqs = tuple(TraceRequest(i * 0.5, 8000, 2000) for i in range(40))
    dep = Deployment(PROFILE, 1, 2, record=False,
                     faults=FaultSchedule([{"kind": "crash", "replica": "d0", "at_s": 25.0, "restart_after_s": 30.0}]))
    dep.submit(Trace("t", reqs))
    dep.run_until(20)
    dep.set_replicas("decode", 1)
    d0 = next(r for r in dep.replicas if r.name == "d0")
    assert d0.state == DRAINING and d0.load() > 0
    dep.run_until(200)
    assert d0.state == STOPPED and dep.pool_counts("decode")[READY] == 1
    assert d0.gpu_seconds == pytest.approx(25.0)


def test_a_pull_from_a_crashed_prefill_replica_fails():
    """A decode request whose prompt's KV died with its prefill replica cannot pull it: the
    transfer fails and decode recomputes. The check read the state DOWN, which a crashed replica
    leaves at once (it is restarting), so every such pull succeeded from a replica without it."""
    from sla_guard.sim.deployment import DecodeReplica

    dep = _kv_bound_burst("p0")
    outcomes = []
    done = DecodeReplica._xfer_done

    def spy(self, arg):
        outcomes.append(arg[2])
        return done(self, arg)

    dep.run_until(14.9)
    queued = len(dep.replicas[1].waiting)
    assert queued > 10
    try:
        DecodeReplica._xfer_done = spy
        dep.run_until(3000)
    finally:
        DecodeReplica._xfer_done = done
    assert sum(outcomes) >= queued
    assert dep.summary().finished == 20


def test_the_timeline_counts_restarting_replicas():
    """timeline.csv (and the bench's GPU-hours to the last arrival, read from it) counts a
    replica from the moment its GPUs are held: a rolling restart's surge replica and a crashed
    replica restarting were left out until ready."""

    def from_timeline(dep):
        tl = [*dep.timeline, (dep.now, 0, 0, 0, 0)]
        return sum((b[0] - a[0]) * (a[3] + a[4]) for a, b in itertools.pairwise(tl)) * PROFILE.gpus_per_replica / 3600

    dep = Deployment(PROFILE, 2, 2, record=False)
    dep.run_until(100)
    assert dep.rolling_restart("p0")
    dep.run_until(2000)
    assert from_timeline(dep) == pytest.approx(dep.gpu_hours())
    crash = FaultSchedule([{"kind": "crash", "replica": "d0", "at_s": 100.0}])
    dep = Deployment(PROFILE, 2, 2, record=False, faults=crash)
    dep.run_until(2000)
    assert from_timeline(dep) == pytest.approx(dep.gpu_hours())
