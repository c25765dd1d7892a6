"""What the object census costs serving: inter-token latency of a REAL CPU vLLM engine with the
census off and on, side by side, on the same engine.

One server of the tiny model with the test-only plugin of tests/test_census_vllm.py (a pre-freeze
list in the KV manager growing at 20 elements/s) runs exactly the census of that test: a frames
walk every 5 s and the module walk continuously (the pace while a leak finding is open; the
default is every 10 min) under the default GIL budget (1 % of a core, slices <= 5 ms). Rounds
alternate census on / off (off, on, on, off, ...; "off" is a census request with ``pause``, so
the same process, core and caches serve both sides, and machine noise falls on both alike); each
keeps ``--concurrency`` streaming completions in flight for ``--round-s`` seconds. Three views of
the inter-token latency, side by side: the engine's own (the plugin's
``slaguard_inter_token_latency_seconds`` histogram from vLLM's per-step timestamps, 2-5 ms buckets
around the step time; increases over the rounds, quantiles as PromQL's histogram_quantile), the
client's gaps between streamed chunks, and each request's TPOT. The script prints p50 / p99 of
each, the ratios on/off (goal: p99 <= 1.05), the walks finished in each side's rounds, and the
census of the EngineCore; one JSON line at the end.

    .venv/bin/python bench/bench_census.py [--rounds 8] [--round-s 20] [--concurrency 4]

Runs from the project venv (vLLM runs as subprocesses in .venv-vllm, like the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import vllm_support as vs  # noqa: E402

PLUGIN_SRC = REPO / "tests" / "plugins" / "sla_guard_test_census"
CENSUS_ENV = {"SLA_GUARD_CENSUS_INTERVAL_S": "5", "SLA_GUARD_CENSUS_START_DELAY_S": "5"}


def install_plugin(tmp: Path) -> Path:
    import subprocess

    src = tmp / "plugin-src"
    shutil.copytree(PLUGIN_SRC, src)
    target = tmp / "plugin-site"
    subprocess.run([str(vs.VLLM_PYTHON), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(src)], check=True, capture_output=True, timeout=300)
    return target


def load_round(base_url: str, seconds: float, concurrency: int, max_tokens: int
               ) -> tuple[list[float], list[float], int]:
    """Client ITL gaps, per-request TPOT ((last - first token) / (tokens - 1)), errors."""
    stop = threading.Event()
    itls: list[float] = []
    tpots: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                got = vs.stream_token_gaps(base_url, f"client {i} request {n} " + "a b c d " * 20, max_tokens)
            except Exception:
                errors[0] += 1
                time.sleep(0.2)
                continue
            with lock:
                itls.extend(got)
                if got:
                    tpots.append(sum(got) / len(got))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for th in threads:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in threads:
        th.join(timeout=120)
    return itls, tpots, errors[0]


def engine_itl_buckets(metrics_url: str) -> dict[float, float]:
    """Cumulative bucket counts of the engine-side inter-token latency histogram
    (slaguard_inter_token_latency_seconds: measured by vLLM per engine step, fine buckets)."""
    out: dict[float, float] = {}
    for (name, labels), v in vs.scrape(metrics_url).items():
        if name == "slaguard_inter_token_latency_seconds_bucket":
            le = float(dict(labels)["le"])
            out[le] = out.get(le, 0.0) + v
    return out


def hist_quantile(q: float, buckets: dict[float, float]) -> float:
    """histogram_quantile over cumulative buckets (linear inside a bucket, as PromQL)."""
    bs = sorted(buckets.items())
    if not bs or bs[-1][1] <= 0:
        return float("nan")
    rank, prev_le, prev_c = q * bs[-1][1], 0.0, 0.0
    for le, cnt in bs:
        if cnt >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (cnt - prev_c) if cnt > prev_c else 0.0)
        prev_le, prev_c = le, cnt
    return bs[-1][0]


def pause_census(path: Path) -> None:
    """A census request with ``pause``: no walk starts or advances (docs/census.md)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"interval_s": 5, "until": time.time() + 3600, "pause": True}))
    tmp.replace(path)


def census_walks(run: Path) -> float:
    """Walks finished so far, summed over the processes' census files."""
    total = 0.0
    for p in run.glob("census-*.json"):
        with contextlib.suppress(OSError, ValueError):
            total += float(json.loads(p.read_text()).get("walks") or 0)
    return total


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1)))] if s else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side (alternating)")
    ap.add_argument("--round-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=6.0, help="after switching the census, before measuring")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=15.0, help="load before measuring")
    args = ap.parse_args(argv)
    reason = vs.vllm_unavailable_reason()
    if reason:
        print(f"bench_census: skipped, {reason}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-census-"))
    model = vs.build_tiny_model(tmp / "model")
    site = install_plugin(tmp)
    run, req = tmp / "run", tmp / "census-request.json"
    server = vs.start_server(model, env={"PYTHONPATH": str(site), **CENSUS_ENV, "SLA_GUARD_RUN_DIR": str(run),
                                         "SLA_GUARD_CENSUS_REQUEST_FILE": str(req)}, log_dir=tmp)
    census: list[dict] = []
    try:
        load_round(server.base_url, args.warmup_s, args.concurrency, args.max_tokens)
        itls: dict[str, list[float]] = {"off": [], "on": []}
        tpots: dict[str, list[float]] = {"off": [], "on": []}
        engine: dict[str, dict[float, float]] = {"off": {}, "on": {}}
        errors = {"off": 0, "on": 0}
        busy = {"off": 0.0, "on": 0.0}
        for r in range(args.rounds):
            for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                if side == "off":  # polled every <= 5 s, hence the settling time
                    pause_census(req)
                else:
                    req.unlink(missing_ok=True)
                time.sleep(args.settle_s)
                before = engine_itl_buckets(server.metrics_url)
                walks0 = census_walks(run)
                got, tp, err = load_round(server.base_url, args.round_s, args.concurrency, args.max_tokens)
                time.sleep(1.0)  # the stat logger flushes every 0.5 s
                after = engine_itl_buckets(server.metrics_url)
                busy[side] += census_walks(run) - walks0
                for le, v in after.items():
                    engine[side][le] = engine[side].get(le, 0.0) + v - before.get(le, 0.0)
                itls[side] += got
                tpots[side] += tp
                errors[side] += err
            p99 = {k: 1000 * hist_quantile(0.99, engine[k]) for k in ("off", "on")}
            print(f"round {r + 1}/{args.rounds}: engine ITL p99 off {p99['off']:.2f} ms, on {p99['on']:.2f} ms",
                  flush=True)
        census = [json.loads(p.read_text()) for p in run.glob("census-*.json")]
    finally:
        server.stop()
    core = max(census, key=lambda d: len(d.get("growers") or []), default=None)
    res = {side: {"engine_itl_p50_ms": round(1000 * hist_quantile(0.5, engine[side]), 3),
                  "engine_itl_p99_ms": round(1000 * hist_quantile(0.99, engine[side]), 3),
                  "client_itl_p50_ms": round(1000 * statistics.median(v), 3),
                  "client_itl_p99_ms": round(1000 * pct(v, 0.99), 3),
                  "tpot_p50_ms": round(1000 * statistics.median(tpots[side]), 3),
                  "tpot_p99_ms": round(1000 * pct(tpots[side], 0.99), 3),
                  "itl_mean_ms": round(1000 * statistics.fmean(v), 3), "tokens": len(v),
                  "requests": len(tpots[side]), "errors": errors[side]}
           for side, v in itls.items()}
    for k in ("engine_itl_p50_ms", "engine_itl_p99_ms", "client_itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        res[f"ratio_{k[:-3]}"] = round(res["on"][k] / res["off"][k], 4) if res["off"][k] else None
    res["walks_finished"] = busy
    if core is not None:
        top = (core.get("growers") or [{}])[0]
        res["census"] = {"walks": core.get("walks"), "walk": core.get("walk"), "full_walk": core.get("full_walk"),
                         "top_owner": top.get("owner"), "top_growth_per_s": round(top.get("growth_per_h", 0) / 3600, 3)}
    print(f"\n{'':10} {'engine ITL p50':>15} {'p99':>8} {'client ITL p99':>15} {'TPOT p50':>9} {'p99':>8} "
          f"{'tokens':>7}")
    for side in ("off", "on"):
        r = res[side]
        print(f"census {side:3} {r['engine_itl_p50_ms']:13.2f}ms {r['engine_itl_p99_ms']:6.2f}ms "
              f"{r['client_itl_p99_ms']:13.2f}ms {r['tpot_p50_ms']:7.2f}ms {r['tpot_p99_ms']:6.2f}ms {r['tokens']:7d}")
    print(f"ratio on/off: engine ITL p50 {res['ratio_engine_itl_p50']}, p99 {res['ratio_engine_itl_p99']}; client ITL "
          f"p99 {res['ratio_client_itl_p99']}; TPOT p50 {res['ratio_tpot_p50']}, p99 {res['ratio_tpot_p99']} "
          f"(goal: p99 <= 1.05)")
    if core is not None:
        print(f"census (EngineCore): {res['census']['walks']} walks, top grower {res['census']['top_owner']} "
              f"+{res['census']['top_growth_per_s']}/s (injected 20/s)")
    print(json.dumps(res))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
