"""`sla-guard check --config FILE`: one evaluation, a readable table on stdout, and an exit code
for CI and cron: 0 when every SLO holds (ok or at risk), 1 on a violation, 2 when something
cannot be judged (unknown) or the check itself failed (bad config, no data)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from sla_guard.commands import number
from sla_guard.config import ConfigError, load_config
from sla_guard.detect.stages import StageBreakdownEvaluator
from sla_guard.model import Status
from sla_guard.service import CHECK_STALL_WAIT_S

EXIT = {Status.OK: 0, Status.AT_RISK: 0, Status.VIOLATED: 1, Status.UNKNOWN: 2}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="evaluate the SLOs once, print a table, exit 0/1/2")
    p.add_argument("--config", required=True, help="guard configuration (YAML)")
    p.add_argument("--wait", type=number(0, above=False), default=0.0, metavar="SECONDS",
                   help="embedded mode: scrape twice this far apart and use PromQL windows over that; a wait "
                        f"over {CHECK_STALL_WAIT_S:g} s adds a scrape between them, so that a hook that stopped "
                        "recording is seen (default 0: one scrape, judge each engine since its start)")
    p.add_argument("--json", action="store_true", help="print the SLO snapshot as JSON instead of a table")
    return p


def _fmt_value(indicator: str, objective: str, v: float | None) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if objective == "attainment":
        return f"{100 * v:.2f}%"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"


def _fmt_objective(s: dict) -> str:
    thr = s["threshold_s"]
    if thr is None:  # availability: a share of requests, no latency
        return f"{100 * s['target']:g}% {s['indicator']}"
    thr_s = f"{thr * 1000:g} ms" if thr < 1 else f"{thr:g} s"
    if s["objective"] == "mean":
        return f"mean {s['indicator']} <= {thr_s}"
    if s["objective"] == "percentile":
        return f"p{100 * s['percentile']:g} {s['indicator']} <= {thr_s}"
    return f"{100 * s['target']:g}% {s['indicator']} <= {thr_s}"


def render_table(snapshot: dict) -> str:
    """The SLO snapshot as an aligned text table, one row per (model, pool, objective)."""
    head = ("MODEL", "POOL", "SLO", "OBJECTIVE", "VALUE", "REQUESTS", "WINDOW", "BUDGET", "STATUS", "NOTE")
    rows = []
    for p in snapshot["pools"]:
        for s in p["slos"]:
            budget = s.get("budget_remaining")
            req = s.get("requests")
            rows.append((p["model"], p["pool"], s["slo"], _fmt_objective(s),
                         _fmt_value(s["indicator"], s["objective"], s.get("value")),
                         "-" if req is None else f"{req:.0f}", s["window"],
                         "-" if budget is None else f"{100 * budget:.0f}%", s["status"], s.get("reason", "")))
        if p.get("goodput_lower_bound") is not None:
            rows.append((p["model"], p["pool"], "goodput", "ttft & tpot met", f"{100 * p['goodput_lower_bound']:.1f}%"
                         f"..{100 * p['goodput_upper_bound']:.1f}%", "", "", "", "", "bounds from the marginals"))
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (head, *rows)]
    why = snapshot.get("reason")  # nothing judged, or pools left unjudged: why
    lines.append(f"overall: {snapshot['status']}" + (f" ({why})" if why else ""))
    return "\n".join(lines)


def render_breakdown(snapshot: dict) -> str:
    """Where each P/D model's client TTFT went, one line per stage: models with a client scope or
    with both a prefill and a decode stage (empty otherwise)."""
    out = []
    for b in snapshot.get("models", []):
        names = {s["stage"] for s in b["stages"]}
        pd = bool(names & {"prefill_queue", "prefill_compute"}) and bool(names & {"decode_queue", "first_decode_step"})
        if not (b["client_ttft_s"] is not None or pd):
            continue
        what = "estimated from the engine stages" if b["estimated"] else "measured at the router"
        ttft = b["ttft_s"]
        out.append(f"\nwhere the TTFT went: {b['model']}, TTFT {_fmt_value('ttft', 'mean', ttft)} ({what})")
        for s in b["stages"]:
            share = "" if s["share"] is None else f"{100 * s['share']:5.1f}%"
            out.append(f"  {s['stage']:<18} {_fmt_value('ttft', 'mean', s['seconds']):>10}  {share:>6}  {s['source']}")
        out += [f"  note: {n}" for n in b["notes"]]
    return "\n".join(out)


def _failed(args: argparse.Namespace, message: str) -> int:
    """No verdict: the reason on stderr, and with --json also an object on stdout, so a script
    reading stdout gets ``status: unknown`` rather than nothing to parse."""
    print(message, file=sys.stderr)
    if args.json:
        print(json.dumps({"status": "unknown", "error": message}, indent=2))
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        return _failed(args, str(err))
    from sla_guard.compose import compose

    # the source and the SLOs only: the detectors need history, and the advisor must not
    # actuate from a one-shot check
    breakdown = StageBreakdownEvaluator(cfg)  # where the client TTFT went; no findings book
    guard = compose(cfg, detectors=False, advisor=False, extra_evaluators=[breakdown]).guard

    # the whole check is bounded: three collections, the wait, one tick's query budget, slack
    src_timeout = getattr(cfg.source, "timeout_s", 10.0)
    limit = 3 * src_timeout + max(0.0, args.wait) + guard.tick_budget_s + 5.0

    async def once():
        try:
            return await asyncio.wait_for(guard.check_once(args.wait), limit)
        finally:
            await asyncio.wait_for(guard.source.aclose(), 2.0)

    try:
        result = asyncio.run(once())
    except TimeoutError:
        return _failed(args, f"check failed: no verdict within {limit:g}s (source timeouts {src_timeout:g}s)")
    except Exception as err:  # the check itself failed: say why, exit 2
        return _failed(args, f"check failed: {type(err).__name__}: {err}")
    ev = guard.evaluator("slo")
    snap = ev.snapshot()
    stages = breakdown.snapshot()
    down = [{"target": t.name, "url": t.url, "error": t.last_error} for t in guard.source.targets() if not t.up]
    failed = {name: str(err) for name, err in result.errors.items()}
    if args.json:
        from sla_guard.model import jsonable

        out = {**snap, "ttft_breakdown": stages, "targets_down": down, "evaluator_errors": failed}
        if failed:  # exit 2: the JSON says the same
            out["status"] = "unknown"
        print(json.dumps(jsonable(out), indent=2))
    else:
        print(render_table(snap))
        text = render_breakdown(stages)
        if text:
            print(text)
    for t in down:
        print(f"target {t['target']} ({t['url']}) down: {t['error']}", file=sys.stderr)
    if failed:
        for name, err in failed.items():
            print(f"evaluator {name} failed: {err}", file=sys.stderr)
        return 2
    return EXIT[ev.overall()]
