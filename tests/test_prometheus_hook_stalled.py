"""A hook that stopped recording, read through a REAL Prometheus (Prometheus mode).

An hour of five engines are backfilled into a real Prometheus, every sample written by the
test. On "stall" the sla-guard hook stops recording at 20 min (vLLM's elastic-EP scale-up drops its
logger): vLLM's own ``vllm:generation_tokens_total`` keeps rising, the hook's counters and TTFT
histogram stand still. The scraper catches that on the page (``hook_stalled``); in Prometheus mode
the pool's mean TTFT over 30 min read "ok" on the frozen requests before the stall (and, once the
window passed them, "0 requests"). "idle" moves nothing, "healthy" moves both, "sidecar" has no
vLLM series, "old" is an older plugin without ``slaguard_engine_steps_total``: none of them is a
stall. "quiet" stalls as "stall" does, then stops generating 10 min later; "restarted" is "quiet"
until a new process (every counter from 0, its hook working) at 40 min, serving again from 45 min."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import yaml
from prometheus_support import PrometheusProcess, Recording, backfilled, judged, prometheus_binary

from exporters import contract as c
from exporters import promql
from sla_guard.ingest.prometheus import PrometheusView
from sla_guard.model import Status

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)"),
]

STEP = 15  # seconds between scrapes
SCRAPES = 60 * 60 // STEP
STALL = 20 * 60 // STEP  # the scrape from which the stalled hook records nothing
QUIET = 30 * 60 // STEP  # "quiet" and "restarted": vLLM stops generating 10 min after the stall
RESTART = 40 * 60 // STEP  # "restarted": a new process (every counter from 0, the hook working)
BUSY_AGAIN = 45 * 60 // STEP  # "restarted": serving again, recorded by its hook
TTFT = c.latency_metric("ttft", None)
MODELS = ("stall", "idle", "healthy", "sidecar", "old", "quiet", "restarted")
SLOS = [{"model": "*", "pool": "decode", "objectives": [
    {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "window": "30m",
     "min_requests": 1}]}]


# the stall query as the view sends it (its first characters tell it from the other queries)
STALL_QUERY = promql.hook_stalled(c.HOOK_STALL_WINDOW_S, c.HOOK_STALL_SETTLE_S, c.HOOK_STALL_LOOKBACK_S,
                                  c.HOOK_STALL_STEP_S)


def _history(base: float) -> str:
    """Each engine serves 2 requests (0.2 s TTFT, 64 tokens) a scrape while it is busy."""
    lines: list[str] = []

    def counter(name: str, labels: str, values: list[float]) -> None:
        lines.extend(f"{name}{{{labels}}} {v:g} {base + STEP * i:.0f}" for i, v in enumerate(values))

    for model in MODELS:
        hook = f'instance="{model}:8000",job="engines",model="{model}",pool="decode",engine="0"'
        vllm = f'instance="{model}:8000",job="engines",model_name="{model}",engine="0"'
        busy = model != "idle"
        served = [(i if busy else 0) for i in range(SCRAPES)]
        recorded = [min(i, STALL) if model in ("stall", "quiet", "restarted") else n for i, n in enumerate(served)]
        if model in ("quiet", "restarted"):
            served = [min(i, QUIET) for i in range(SCRAPES)]
        if model == "restarted":
            served[RESTART:] = recorded[RESTART:] = [max(0, i - BUSY_AGAIN) for i in range(RESTART, SCRAPES)]
        if model != "sidecar":
            counter(c.VLLM_GENERATION_TOKENS, vllm, [64 * n for n in served])
        counter(c.GENERATION_TOKENS.series(), hook, [64 * n for n in recorded])
        if model != "old":
            counter(c.ENGINE_STEPS.series(), hook, [8 * n for n in recorded])
        for le in ("2.5", "+Inf"):
            counter(TTFT.series("_bucket"), f'{hook},le="{le}"', [2 * n for n in recorded])
        counter(TTFT.series("_count"), hook, [2 * n for n in recorded])
        counter(TTFT.series("_sum"), hook, [0.4 * n for n in recorded])
    return "\n".join([f"# TYPE {TTFT.series()} histogram", *lines, "# EOF", ""])


@pytest.fixture(scope="module")
def fleet():
    # Prometheus takes the backfill as history; on a whole minute, so the hook's last move falls on the
    # end of a step of the stall query's (HOOK_STALL_STEP_S) and "N min ago" is exact
    base = float(int(time.time()) // 60 * 60 - 3 * 3600)
    with backfilled(_history(base)) as prom:
        yield prom, base


def _judge(prom: PrometheusProcess, at: float,
           transport: httpx.BaseTransport | None = None) -> tuple[dict, PrometheusView]:
    pools, view = judged(prom, SLOS, at, transport)
    return {m: pools[(m, "decode")] for m in MODELS}, view


def test_prometheus_holds_what_the_stall_looks_like(fleet):
    """The data themselves: at 35 min vLLM counted 1,280 tokens on "stall" in the last 5 min while
    the hook's counters did not move; the pool's TTFT requests over 30 min are all from before."""
    prom, base = fleet
    at = base + 35 * 60
    sel = 'instance="stall:8000"'
    vllm = prom.query(f"increase({c.VLLM_GENERATION_TOKENS}{{{sel}}}[5m])", at)
    hook = prom.query(f"increase({c.ENGINE_STEPS.series()}{{{sel}}}[5m])", at)
    reqs = prom.query(f"increase({TTFT.series('_count')}{{{sel}}}[30m])", at)
    assert float(vllm[0]["value"][1]) == pytest.approx(1280), vllm
    assert float(hook[0]["value"][1]) == 0.0, hook
    assert float(reqs[0]["value"][1]) == pytest.approx(2 * 15 * 60 / STEP), reqs


def test_a_stalled_hook_reads_unknown_naming_the_engine_and_the_fix(fleet):
    """Before: "stall" read ok (mean 0.2 s over the 30 min, every request from before the stall)
    at 35 min, and at 55 min "0 requests in 30m", an idle pool. Now unknown, hook_stalled, naming
    the engine and the fix; the other pools are judged as before."""
    prom, base = fleet
    pools, view = _judge(prom, base + 35 * 60)
    stall = pools["stall"]
    assert stall.status is Status.UNKNOWN, (stall.status, stall.reason)
    assert view.errors == {"hook_stalled": 1}, view.last_error
    assert stall.reason.startswith("hook_stalled: the hook stopped recording on stall:8000 engine 0: vLLM generated "
                                   f"tokens there ({c.VLLM_GENERATION_TOKENS}) after a counter of the hook's last "
                                   "moved (15 min ago;"), stall.reason
    assert "restart that API server" in stall.reason, stall.reason
    assert all(s.reason == stall.reason for s in stall.slos), stall.slos
    assert {m: p.status for m, p in pools.items() if m not in ("stall", "quiet", "restarted")} == {
        "idle": Status.UNKNOWN, "healthy": Status.OK, "sidecar": Status.OK, "old": Status.OK}, pools
    assert "0 requests in 30m" in pools["idle"].reason, pools["idle"].reason
    # twenty minutes on, the frozen requests have left the window: not "0 requests", still the stall
    stall = _judge(prom, base + 55 * 60)[0]["stall"]
    assert stall.reason.startswith("hook_stalled: "), (stall.status, stall.reason)


def test_before_the_stall_settles_nothing_is_stalled(fleet):
    """At 20.5 min the hook's last rise is inside the window: not (yet) a stall."""
    prom, base = fleet
    pools, view = _judge(prom, base + 20 * 60 + 30)
    assert view.errors == {}, view.last_error
    assert pools["stall"].status is Status.OK, pools["stall"].reason


def test_a_stall_holds_after_the_engine_goes_idle_until_a_restart(fleet):
    """"quiet": the hook stopped at 20 min, vLLM generated until 30 min and then stopped too. Judged
    over 5 min only, its stall was over by 37 min: the pool read ok at 40 min (a mean over the
    requests recorded before the stall) and "0 requests in 30m", an idle pool, at 55 min, the hook
    still dead (and its next traffic unseen for 5 min more). Now held until the hook's counter
    moves; "restarted" (a new process at 40 min, its hook working) is cleared at once."""
    prom, base = fleet
    for minute, ago in ((40, 20), (55, 35)):
        pools = _judge(prom, base + minute * 60)[0]
        quiet = pools["quiet"]
        assert quiet.status is Status.UNKNOWN, (minute, quiet.status, quiet.reason)
        assert quiet.reason.startswith("hook_stalled: the hook stopped recording on quiet:8000 engine 0: "), quiet
        assert f"last moved ({ago} min ago;" in quiet.reason, quiet.reason
    restarted = _judge(prom, base + 43 * 60)[0]["restarted"]
    assert "hook_stalled" not in restarted.reason, restarted.reason
    assert pools["restarted"].status is Status.OK, pools["restarted"].reason  # 55 min: serving, recorded


def test_the_stall_answer_serves_the_ticks_of_one_step(fleet):
    """The stall query is a subquery over the lookback (500 engines: 0.25 s over 1 h, 1.2 s over 6 h, against 23 ms for
    the 5-min query before it): the guard asks it once per HOOK_STALL_STEP_S, not every tick, and the
    ticks in between use that answer (still counted as stalls). Nor is it sent ahead with the next
    tick's queries (``prefetch``), which ran it a second time a step for an answer nobody read."""
    prom, base = fleet
    rec = Recording()
    view = PrometheusView(prom.url, timeout_s=30, transport=rec)
    try:
        at = base + 35 * 60
        first = view.hook_stalls(at)
        view.prefetch(at + c.HOOK_STALL_STEP_S / 2)  # the next tick, as the guard runs it
        again = view.hook_stalls(at + c.HOOK_STALL_STEP_S / 2)
        assert "stall:8000" in {r["instance"] for r in first or []} and again == first
        assert sum(q == STALL_QUERY for q in rec.sent) == 1 and view.errors == {"hook_stalled": 2}
        view.hook_stalls(at + c.HOOK_STALL_STEP_S)
        assert sum(q == STALL_QUERY for q in rec.sent) == 2
    finally:
        view.close()


def test_an_unanswered_stall_check_is_unknown_not_ok(fleet):
    """Where the stall query fails, a frozen pool is not ruled out: no pool reads ok."""
    prom, base = fleet
    pools, view = _judge(prom, base + 35 * 60, Recording(fail=STALL_QUERY[:80]))
    assert view.failed_queries == 1, view.last_error
    healthy = pools["healthy"]
    assert healthy.status is Status.UNKNOWN and "could not check that the sla-guard hook" in healthy.reason, healthy
    assert "0 requests in 30m" in pools["idle"].reason, pools["idle"].reason  # its own reason kept


def test_check_reads_the_stall_through_prometheus(tmp_path):
    """`sla-guard check` with a Prometheus source (a subprocess, as users run it) judges at its own
    now: the same hour backfilled to end now, and the stalled pool's row names the stall."""
    with backfilled(_history(float(int(time.time()) - SCRAPES * STEP + 20))) as prom:
        f = tmp_path / "guard.yaml"
        f.write_text(yaml.safe_dump({"source": {"mode": "prometheus", "url": prom.url, "timeout_s": 10},
                                     "slos": SLOS}))
        r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(f)],
                           capture_output=True, text=True, timeout=120)
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:] if line.split()[0] in MODELS}
    assert r.returncode == 2, r.stdout + r.stderr
    assert "unknown  hook_stalled: the hook stopped recording on stall:8000 engine 0" in rows["stall"], r.stdout
    assert rows["healthy"].split()[-1] == "ok", r.stdout
