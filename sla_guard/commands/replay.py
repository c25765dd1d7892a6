"""`sla-guard replay --trace FILE [--policy NAME] [--out DIR]`: replay a trace on the simulated
P/D deployment as fast as possible (no HTTP), the guard and the scaling policy evaluating in
simulated time, and print ONE JSON line of results."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

from sla_guard.commands import COUNT
from sla_guard.commands import number as _number
from sla_guard.defaults import TPOT_SLO_S, TTFT_SLO_S


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("replay", help="replay a trace on the simulated P/D deployment; print one JSON line",
                       description=__doc__)
    p.add_argument("--trace", required=True,
                   help="a .jsonl or .csv trace (Mooncake, aiperf mooncake_trace, Azure 2023/2024, BurstGPT, or "
                        "columns named like arrival_time/timestamp, input_tokens/prompt_tokens, "
                        "output_tokens/completion_tokens; rows with 0 output tokens are failed requests, skipped "
                        "and counted in rows_skipped), or 'agentic[:N]' (generated coding-agent sessions)")
    # the names of sim.policy.POLICIES, spelled out so --help needs no simulator import (a test holds them equal)
    p.add_argument("--policy", default="static",
                   help="scaling policy: static (default), guard, or a baseline: queue, keda-hpa, slo-keda, "
                        "planner, planner-throughput, planner-load")
    p.add_argument("--out", type=Path, default=None, help="write summary.json, actions.jsonl, timeline.csv here")
    p.add_argument("--speed", type=_number(0), default=1.0,
                   help="trace rate multiplier: 2 replays the trace's arrivals twice as fast (default 1)")
    p.add_argument("--duration", type=_number(0), default=None, help="replay only the first N trace seconds")
    p.add_argument("--rate", type=_number(0), default=None,
                   help="requests/s, Poisson arrivals (seeded by --seed) for a trace without arrival times "
                        "(prompt_len/output_len benchmark files)")
    p.add_argument("--profile", default="default", help="profile name in sla_guard/sim/profiles or a YAML path")
    p.add_argument("--prefill", type=_number(0, **COUNT), default=2, help="initial prefill replicas (default 2)")
    p.add_argument("--decode", type=_number(0, **COUNT), default=2, help="initial decode replicas (default 2)")
    p.add_argument("--min-replicas", type=_number(0, **COUNT), default=1)
    p.add_argument("--max-replicas", type=_number(1, **COUNT), default=16)
    p.add_argument("--gpu-budget", type=_number(0, integer=True), default=None, help="GPUs both pools may use together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", action="append", default=[], metavar="JSON",
                   help='fault to inject, e.g. \'{"kind":"leak","replica":"d0","mib_per_hour":48}\' (repeatable)')
    p.add_argument("--slo-ttft", type=_number(0), default=TTFT_SLO_S,
                   help=f"TTFT target in seconds (default {TTFT_SLO_S:g})")
    p.add_argument("--slo-tpot", type=_number(0), default=TPOT_SLO_S,
                   help=f"TPOT target in seconds (default {TPOT_SLO_S:.3f})")
    p.add_argument("--scrape-interval", type=_number(0), default=15.0, help="simulated seconds between scrapes")
    p.add_argument("--eval-interval", type=_number(0), default=15.0)
    p.add_argument("--drain-s", type=_number(0, above=False), default=600.0,
                   help="simulated time after the last arrival")
    p.add_argument("--no-detectors", action="store_true", help="run the guard without the leak/drift detectors")
    p.add_argument("--no-metrics", action="store_true",
                   help="pure simulation: no contract metrics, no store (policy must be static)")
    return p


def _fault(text: str) -> dict:
    """One --fault: a JSON object. A list, string or number was passed over without a word, and the
    replay ran without the fault it was asked for."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--fault {text}: not JSON ({err})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--fault {text}: must be a JSON object, e.g. '{{\"kind\": \"leak\", \"replica\": \"d0\"}}'")
    return obj


MAX_SPIKE = 1000.0  # a load_spike's factor: that many copies of each request in its window


def _fault_target(faults, profile) -> str | None:
    """Why a fault would inject nothing (None: it would). The deployment names its replicas p0, p1, ...
    and d0, d1, ... (``Deployment._add``; more as it scales up), and a leak grows one of the profile's
    processes: a leak on "decode-0" or role "enginecore", or a crash of "D0", matched nothing and the
    replay ran without it. A load spike's copies are submitted up front: a factor of 1e300 never ended."""
    from sla_guard.sim.faults import KINDS, AcceptanceDrift, Leak, LoadSpike

    kinds = {cls: name for name, cls in KINDS.items()}
    roles = sorted({pm.role for pm in profile.processes})
    for f in faults.faults:
        replica = getattr(f, "replica", None)
        decode = isinstance(f, AcceptanceDrift)  # acceptance is a decode replica's
        if replica is not None and not re.fullmatch(r"d\d+" if decode else r"[pd]\d+", replica):
            return (f"--fault {kinds[type(f)]}: replica {replica!r} is no {'decode ' if decode else ''}replica of "
                    f"the deployment; name one as {'d0, d1' if decode else 'p0, p1, d0, d1'}, ...")
        if isinstance(f, LoadSpike) and f.factor > MAX_SPIKE:  # copies of each request, submitted up front
            return (f"--fault load_spike: factor {f.factor:g} is over {MAX_SPIKE:g} (each request is copied that "
                    f"often, up front)")
        if isinstance(f, Leak) and f.role not in roles:
            return f"--fault leak: role {f.role!r} is no process of profile {profile.name!r}; use one of {roles}"
    return None


def run(args: argparse.Namespace) -> int:
    from sla_guard.sim.faults import FaultSchedule
    from sla_guard.sim.profile import ProfileError, load_profile
    from sla_guard.sim.run import ReplaySpec, replay
    from sla_guard.sim.traces import TraceError, load_trace

    try:
        profile = load_profile(args.profile)
        trace = load_trace(args.trace, rate=args.rate, seed=args.seed)
        faults = FaultSchedule(_fault(f) for f in args.fault)
    except (ProfileError, TraceError, ValueError) as err:
        print(f"sla-guard replay: {err}", file=sys.stderr)
        return 2
    if (problem := _fault_target(faults, profile)) is not None:
        print(f"sla-guard replay: {problem}", file=sys.stderr)
        return 2
    if args.min_replicas > args.max_replicas:
        print(f"sla-guard replay: --min-replicas {args.min_replicas} is over --max-replicas {args.max_replicas}",
              file=sys.stderr)
        return 2
    # the start is held to the limits the policy's decisions are held to (it ran over them until
    # the policy first changed that pool)
    for flag, n in (("--prefill", args.prefill), ("--decode", args.decode)):
        if not args.min_replicas <= n <= args.max_replicas:
            print(f"sla-guard replay: {flag} {n} is outside --min-replicas {args.min_replicas} .. --max-replicas "
                  f"{args.max_replicas}", file=sys.stderr)
            return 2
    start_gpus = (args.prefill + args.decode) * profile.gpus_per_replica
    if args.gpu_budget is not None and start_gpus > args.gpu_budget:
        print(f"sla-guard replay: the start ({args.prefill}P{args.decode}D x {profile.gpus_per_replica} GPUs = "
              f"{start_gpus}) is over --gpu-budget {args.gpu_budget}", file=sys.stderr)
        return 2
    try:  # the SLO's own checks (a threshold beyond the histograms is in ms, not s)
        from sla_guard.config import SLO, Indicator, Objective

        for flag, ind, v in (("--slo-ttft", Indicator.TTFT, args.slo_ttft),  # noqa: B007 - named in the error
                             ("--slo-tpot", Indicator.TPOT, args.slo_tpot)):
            SLO(name="check", indicator=ind, objective=Objective.MEAN, threshold_s=v)
    except ValueError as err:
        msg = err.errors()[0]["msg"] if hasattr(err, "errors") else str(err)
        print(f"sla-guard replay: {flag}: {msg.removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    if args.no_metrics and args.policy != "static":
        print("sla-guard replay: --no-metrics needs --policy static (other policies read metrics)", file=sys.stderr)
        return 2
    if args.out is not None:  # before the replay: a file there was a traceback after it, its results lost
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            print(f"sla-guard replay: --out {args.out}: cannot make this directory: {err.strerror or err}",
                  file=sys.stderr)
            return 2
    spec = ReplaySpec(profile=profile, trace=trace.scaled(1.0 / args.speed, args.duration), policy=args.policy,
                      prefill=args.prefill, decode=args.decode, seed=args.seed, faults=faults,
                      min_replicas=args.min_replicas, max_replicas=args.max_replicas, gpu_budget=args.gpu_budget,
                      slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, scrape_interval_s=args.scrape_interval,
                      eval_interval_s=args.eval_interval, drain_s=args.drain_s, metrics=not args.no_metrics,
                      with_detectors=not args.no_detectors)
    t0 = time.perf_counter()
    try:
        result = replay(spec)
    except ValueError as err:
        print(f"sla-guard replay: {err}", file=sys.stderr)
        return 2
    line = {"trace": trace.name, "policy": args.policy, **asdict(result.summary)}
    line["rows_skipped"] = trace.skipped  # rows of the file that were no request (0 output tokens)
    line.pop("extra", None)
    line.update(result.summary.extra)
    line["wall_s"] = round(time.perf_counter() - t0, 3)
    if args.out is not None:
        result.write(args.out, line)
    print(json.dumps(line, separators=(", ", ": ")))
    return 0
