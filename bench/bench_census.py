"""What the object census costs serving: inter-token latency of a REAL CPU vLLM engine with the
census off and on, side by side.

Two servers of the tiny model start together, identical but for ``SLA_GUARD_CENSUS`` (0 / 1);
both carry the test-only plugin of tests/test_census_vllm.py (a pre-freeze list in the KV
manager growing at 20 elements/s), so the "on" server runs exactly the census of that test: a
walk every 5 s (the pace while a leak finding is open; the default is every 10 min) under the
default GIL budget (1 % of a core, slices <= 5 ms). The load alternates between the two servers
in rounds (off, on, on, off, ...) so that machine noise falls on both alike: each round keeps
``--concurrency`` streaming completions in flight for ``--round-s`` seconds; every streamed
token's arrival is stamped and the gaps between tokens of a request are its inter-token
latencies. The script prints p50 / p99 ITL of each side, the ratios (goal: p99 on/off <= 1.05),
and the census cost the "on" server's EngineCore reports; one JSON line at the end.

    .venv/bin/python bench/bench_census.py [--rounds 6] [--round-s 20] [--concurrency 4]

Runs from the project venv (vLLM runs as subprocesses in .venv-vllm, like the tests).
"""

from __future__ import annotations

import argparse
import itertools
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


def stream_itls(base_url: str, prompt: str, max_tokens: int) -> list[float]:
    """One streamed completion; the gaps between consecutive token chunks (seconds)."""
    import httpx

    body = {"model": vs.MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


def load_round(base_url: str, seconds: float, concurrency: int, max_tokens: int) -> tuple[list[float], int]:
    stop = threading.Event()
    itls: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                got = stream_itls(base_url, f"client {i} request {n} " + "a b c d " * 20, max_tokens)
            except Exception:
                errors[0] += 1
                time.sleep(0.2)
                continue
            with lock:
                itls.extend(got)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for th in threads:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in threads:
        th.join(timeout=120)
    return itls, errors[0]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1)))] if s else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="rounds per side (alternating)")
    ap.add_argument("--round-s", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=10.0, help="load on each server before measuring")
    args = ap.parse_args(argv)
    reason = vs.vllm_unavailable_reason()
    if reason:
        print(f"bench_census: skipped, {reason}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-census-"))
    model = vs.build_tiny_model(tmp / "model")
    site = install_plugin(tmp)
    common = {"PYTHONPATH": str(site), **CENSUS_ENV}
    runs = {"off": tmp / "run-off", "on": tmp / "run-on"}
    servers = {}
    try:
        for side in ("off", "on"):
            servers[side] = vs.start_server(model, env={**common, "SLA_GUARD_RUN_DIR": str(runs[side]),
                                                        "SLA_GUARD_CENSUS": "0" if side == "off" else "1"},
                                            log_dir=tmp, wait=False)
        for s in servers.values():
            vs.wait_healthy(s)
        for side in ("off", "on"):
            load_round(servers[side].base_url, args.warmup_s, args.concurrency, args.max_tokens)
        itls: dict[str, list[float]] = {"off": [], "on": []}
        errors = {"off": 0, "on": 0}
        for r in range(args.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for side in order:
                got, err = load_round(servers[side].base_url, args.round_s, args.concurrency, args.max_tokens)
                itls[side] += got
                errors[side] += err
            print(f"round {r + 1}/{args.rounds}: p99 off {1000 * pct(itls['off'], 0.99):.2f} ms, "
                  f"on {1000 * pct(itls['on'], 0.99):.2f} ms", flush=True)
        census = [json.loads(p.read_text()) for p in runs["on"].glob("census-*.json")]
        assert not list(runs["off"].glob("census-*.json")), "census files from the 'off' server"
    finally:
        for s in servers.values():
            s.stop()
    engine = max(census, key=lambda d: len(d.get("growers") or []), default=None)
    res = {side: {"itl_p50_ms": round(1000 * statistics.median(v), 3), "itl_p99_ms": round(1000 * pct(v, 0.99), 3),
                  "itl_mean_ms": round(1000 * statistics.fmean(v), 3), "tokens": len(v), "errors": errors[side]}
           for side, v in itls.items()}
    res["p50_ratio_on_off"] = round(res["on"]["itl_p50_ms"] / res["off"]["itl_p50_ms"], 4)
    res["p99_ratio_on_off"] = round(res["on"]["itl_p99_ms"] / res["off"]["itl_p99_ms"], 4)
    if engine is not None:
        res["census"] = {"walks": engine.get("walks"), "walk": engine.get("walk"), "full_walk": engine.get("full_walk"),
                         "top_owner": (engine.get("growers") or [{}])[0].get("owner"),
                         "top_growth_per_s": round((engine.get("growers") or [{}])[0].get("growth_per_h", 0) / 3600, 3)}
    print(f"\n{'':8} {'ITL p50':>10} {'ITL p99':>10} {'mean':>10} {'tokens':>8}")
    for side in ("off", "on"):
        r = res[side]
        print(f"census {side:3} {r['itl_p50_ms']:8.2f}ms {r['itl_p99_ms']:8.2f}ms {r['itl_mean_ms']:8.2f}ms "
              f"{r['tokens']:8d}")
    print(f"ratio on/off: p50 {res['p50_ratio_on_off']:.3f}, p99 {res['p99_ratio_on_off']:.3f} (goal p99 <= 1.05)")
    if engine is not None:
        print(f"census (EngineCore): {res['census']['walks']} walks, top grower {res['census']['top_owner']} "
              f"+{res['census']['top_growth_per_s']}/s (injected 20/s)")
    print(json.dumps(res))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
