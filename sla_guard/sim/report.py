"""Report of a simulated run: Markdown plus PNG plots (matplotlib, Agg backend).

Plots come from what the guard saw (its store), not from the simulator's internals, so the
report shows the contract doing its job: TTFT and TPOT per pool against the SLA, spec-decode
acceptance, RSS per process, replicas per pool.

matplotlib is an optional dependency (the ``report`` extra: it is heavy and the guard itself never
draws). Without it the report is still written, with a note saying how to get the plots.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

from exporters import contract as c
from sla_guard.sim.deployment import Deployment, Summary
from sla_guard.sim.harness import HistoryPoint

GIB = 1024**3
PLOTS_HINT = "pip install 'sla-guard[report]'"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@functools.cache
def plots_unavailable() -> str | None:
    """Why plots cannot be drawn here (one line, with the fix), or None when matplotlib imports.

    Checked once, before drawing, so a missing optional dependency never costs the report."""
    try:
        _plt()
    except ImportError as err:
        missing = getattr(err, "name", None) or "matplotlib"
        return f"plots skipped: {missing} is not installed; {PLOTS_HINT} adds them"
    return None


def _series(history: list[HistoryPoint], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for h in history:
        if key in h.values:
            xs.append(h.t / 60.0)
            ys.append(h.values[key])
    return xs, ys


def _save(fig, path: Path) -> tuple[Path, str]:
    """Save and close ``fig``; returns the path and a caption naming what each panel draws, taken
    from the drawn lines' labels (so the report's caption cannot say what the plot does not show)."""
    parts = []
    for ax in fig.axes:
        labels = list(dict.fromkeys(lbl for lbl in ax.get_legend_handles_labels()[1] if not lbl.startswith("_")))
        more = f" and {len(labels) - 12} more" if len(labels) > 12 else ""
        parts.append(f"{ax.get_title()}: {', '.join(labels[:12])}{more}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return path, "; ".join(parts)


def plot_latency(history: list[HistoryPoint], out: Path, indicator: str, slo_s: float, pools: Iterable[str],
                 p90_slo_s: float | None = None) -> tuple[Path, str]:
    """Mean and p90 per scope against the SLA (and the p90 objective where there is one); the
    client scope is where the guard judges TTFT, so it is drawn when there."""
    plt = _plt()
    pools = tuple(pools)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    unit, scale = ("ms", 1000.0) if indicator == "tpot" else ("s", 1.0)
    for i, pool in enumerate(pools):
        for stat, style in (("mean", "-"), ("p90", ":")):
            xs, ys = _series(history, f"{pool}_{indicator}_{stat}")
            if xs:
                ax.plot(xs, [y * scale for y in ys], style, color=f"C{i}", lw=1.0, label=f"{pool} {stat}")
    ax.axhline(slo_s * scale, color="red", lw=1.2, ls="--", label=f"SLA {slo_s * scale:g} {unit}")
    if p90_slo_s is not None:
        ax.axhline(p90_slo_s * scale, color="red", lw=1.0, ls=":", label=f"p90 objective {p90_slo_s * scale:g} {unit}")
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel(f"{indicator.upper()} ({unit})")
    where = "at the client (judged) and per pool (engine-side)" if "client" in pools else "per pool (engine-side)"
    ax.set_title(f"{indicator.upper()} {where}, 1-min windows, vs SLA")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return _save(fig, out / f"{indicator}.png")


def plot_acceptance(history: list[HistoryPoint], out: Path) -> tuple[Path, str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    xs, ys = _series(history, "acceptance")
    ax.plot(xs, ys, label="decode pool")
    ax.set_ylim(0, 1)
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel("accepted / drafted")
    ax.set_title("Speculative-decoding acceptance rate")
    ax.grid(alpha=0.3)
    return _save(fig, out / "acceptance.png")


def engine_styles(engines: Iterable[str]) -> dict[str, tuple[tuple, str]]:
    """(color, line style) per engine, the same in every panel and no two alike: matplotlib's
    10-color cycle gave the 11th engine the 1st one's color (p7 drawn like the leaking d1)."""
    _plt()
    import matplotlib

    colors = matplotlib.colormaps["tab20"].colors
    styles = ("-", "--", ":", "-.")
    # ten dark hues, then light ones shifted by five hues (engine 11 is not engine 1's twin); past
    # twenty, the line style changes
    return {e: (colors[2 * ((i + 5 * (i // 10 % 2)) % 10) + i // 10 % 2], styles[i // 20 % 4])
            for i, e in enumerate(sorted(set(engines)))}


def rss_figure(store, dep: Deployment):
    """The RSS figure: one panel per process role (API server, EngineCore, worker), so a leak
    stands out from its twins."""
    plt = _plt()
    series = store.range(c.PROCESS_RSS.series(), {}, dep.epoch, dep.epoch + dep.now + 1)
    roles = sorted({s.label("role") for s in series}) or ["-"]
    style = engine_styles(s.label("engine") for s in series)
    fig, axes = plt.subplots(len(roles), 1, figsize=(8, 2.4 * len(roles)), sharex=True, squeeze=False)
    for ax, role in zip(axes[:, 0], roles, strict=True):
        for s in sorted((s for s in series if s.label("role") == role), key=lambda s: s.label("engine")):
            color, ls = style[s.label("engine")]
            ax.plot((s.t - dep.epoch) / 60.0, s.v / GIB, lw=0.8, color=color, ls=ls,
                    label=f"{s.label('engine')} {s.label('process')}")
        ax.set_ylabel("RSS (GiB)")
        ax.set_title(f"Host RSS: {role}", fontsize=9)
        ax.legend(fontsize=6, ncol=4, loc="upper left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time (min)")
    return fig


def plot_rss(store, dep: Deployment, out: Path) -> tuple[Path, str]:
    return _save(rss_figure(store, dep), out / "rss.png")


def plot_replicas(dep: Deployment, out: Path, recommended: list | None = None) -> tuple[Path, str]:
    """Actual replicas per pool (ready, and including starting ones) and, when an advisor ran, what
    it recommended each tick (after its guardrails) and what its sizing alone asked for."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 3.4))
    tl = [*dep.timeline, (dep.now, *dep.timeline[-1][1:])]
    xs = [t / 60.0 for t, *_ in tl]
    # ready drawn wide and pale under the recommendation's thin line: where the two agree both show
    ax.step(xs, [x[1] for x in tl], where="post", color="C0", lw=2.5, alpha=0.6, label="prefill ready")
    ax.step(xs, [x[2] for x in tl], where="post", color="C1", lw=2.5, alpha=0.6, label="decode ready")
    ax.step(xs, [x[3] for x in tl], where="post", ls=":", color="C0", label="prefill incl. starting")
    ax.step(xs, [x[4] for x in tl], where="post", ls=":", color="C1", label="decode incl. starting")
    if recommended:
        rt = [r[0] / 60.0 for r in recommended]
        ax.step(rt, [r[1] for r in recommended], where="post", color="C2", lw=0.9, label="prefill recommended")
        ax.step(rt, [r[2] for r in recommended], where="post", color="C3", lw=0.9, label="decode recommended")
        ax.plot(rt, [r[3] for r in recommended], ".", color="C2", ms=2, alpha=0.5, label="prefill sizing (raw)")
        ax.plot(rt, [r[4] for r in recommended], ".", color="C3", ms=2, alpha=0.5, label="decode sizing (raw)")
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel("replicas")
    ax.set_title("Replicas per pool: actual and recommended" if recommended else "Replicas per pool")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot: inside, it hid the lines
    ax.grid(alpha=0.3)
    return _save(fig, out / "replicas.png")


DECISION_ROWS = 80  # the report's table; decisions.jsonl holds them all
# the detectors that can see each injected fault (a load surge has none: the advisor answers it)
FAULT_FINDINGS = {"leak": ("leak",), "acceptance_drift": ("acceptance_drift", "tpot_drift"),
                  "transfer_slowdown": ("ttft_stage",), "transfer_failures": ("ttft_stage",)}


def _fault_start(f: dict) -> float:
    return float(f.get("start_s", f.get("at_s", 0.0)) or 0.0)


def _fault_text(f: dict) -> str:
    """One fault in words, times in simulated minutes."""
    kind = f.get("kind")
    end = f" until {f['end_s'] / 60:.1f} min" if f.get("end_s") is not None else ""
    if kind == "leak":
        return f"leak of {f.get('mib_per_hour', 0):g} MiB/h in {f.get('replica')}'s {f.get('role', 'engine_core')}"
    if kind == "load_spike":
        return f"load surge: {f.get('factor', 1):g}x the arrivals{end}"
    if kind == "acceptance_drift":
        by = f" by {f['end_s'] / 60:.1f} min, then held" if f.get("end_s") is not None else ""
        return (f"spec-decode acceptance falling to {f.get('to_factor', 1):g}x of the profile's{by}, on "
                f"{f.get('replica') or 'every decode replica'}")
    rest = {k: v for k, v in f.items() if k not in ("kind", "start_s", "at_s", "end_s")}
    return f"{kind} {json.dumps(rest)}{end}"


def fault_story(faults: list[dict], findings: list[dict], actions: list[dict], decisions: list[dict] | None,
                stopped: dict[str, float], end_s: float) -> list[tuple[float, str]]:
    """The run in time order: each fault's onset, the findings that followed (with the delay from
    the onset of the fault that explains them) and what the policy did, with the advisor's reasons.
    ``stopped``: replica -> when it stopped (a fault in a replica gone before its onset never ran);
    times in simulated seconds."""
    events: list[tuple[float, int, str]] = []
    ran = [f for f in faults if _fault_start(f) <= end_s]
    for f in faults:
        t0 = _fault_start(f)
        if t0 > end_s:
            continue
        gone = stopped.get(str(f.get("replica") or ""))
        note = "" if gone is None or gone > t0 else f" ({f['replica']} had stopped at {gone / 60:.1f} min: never ran)"
        events.append((t0, 0, f"fault: {_fault_text(f)}{note}"))
    explained: set[int] = set()
    for fd in findings:
        t = float(fd.get("opened_min", 0.0)) * 60
        det, eng = fd.get("detector"), fd.get("engine") or ""
        cands = [(i, f) for i, f in enumerate(ran) if det in FAULT_FINDINGS.get(f.get("kind"), ())
                 and _fault_start(f) <= t and (not f.get("replica") or not eng or f["replica"] == eng)]
        on = f" on {eng}" if eng else ""
        if cands:
            i, f = max(cands, key=lambda c: _fault_start(c[1]))
            explained.add(i)
            why = f"{(t - _fault_start(f)) / 60:.1f} min after the onset of the {f.get('kind')} fault"
        else:
            why = "no injected fault explains it"
        events.append((t, 1, f"finding: {det}{on} ({fd.get('severity', '')}), {why}: {fd.get('summary', '')}"))
        if fd.get("resolved_min") is not None:
            how = f" ({fd['resolution']})" if fd.get("resolution") else ""
            events.append((float(fd["resolved_min"]) * 60, 3, f"resolved{how}: {det}{on}"))
    why_at = {}
    for d in decisions or []:
        key = (round(d["t"], 3), d["pool"]) if d.get("direction") != "restart" else (round(d["t"], 3), d.get("replica"))
        why_at[key] = d
    for a in actions:
        if "restart" in a:
            d = why_at.get((round(a["t"], 3), a["restart"]))
            what = f"rolling restart of {a['restart']}"
        else:
            d = why_at.get((round(a["t"], 3), a.get("pool")))
            what = f"{a.get('pool')} {a.get('from')} -> {a.get('to')}"
        reasons = f" ({', '.join(d['reasons'])})" if d else ""
        events.append((float(a["t"]), 2, f"policy: {what}{reasons}"))
    for i, f in enumerate(ran):
        gone = stopped.get(str(f.get("replica") or ""))
        never_ran = gone is not None and gone <= _fault_start(f)
        if f.get("kind") in FAULT_FINDINGS and i not in explained and not never_ran:
            events.append((end_s, 4, f"not detected by the end of the run: {_fault_text(f)}"))
    return [(t, text) for t, _, text in sorted(events, key=lambda e: (e[0], e[1]))]


def _fmt(x: float, fmt: str, scale: float = 1.0) -> str:
    """A number, or n/a when there is none (no finished request yet)."""
    return "n/a" if x is None or x != x else fmt.format(x * scale)


def write_report(out: Path, *, dep: Deployment, summary: Summary, history: list[HistoryPoint], store,
                 guard_status: dict | None, findings: list[dict], faults: list[dict], actions: list[dict],
                 meta: dict, decisions: list[dict] | None = None, recommended: list | None = None) -> Path:
    """Write report.md (and the plots when matplotlib is installed) into ``out``; returns the Markdown
    path. Without matplotlib the Plots section carries ``plots_unavailable()``'s note instead."""
    out.mkdir(parents=True, exist_ok=True)
    no_plots = plots_unavailable()
    plots = [] if no_plots else [
        # the p90 objective where ``sim.run.guard_config`` judges it: twice the mean's threshold
        plot_latency(history, out, "ttft", dep.slo_ttft_s, ("client", "prefill", "decode"), 2 * dep.slo_ttft_s),
        plot_latency(history, out, "tpot", dep.slo_tpot_s, ("decode",)),
        plot_acceptance(history, out), plot_rss(store, dep, out), plot_replicas(dep, out, recommended)]
    s = summary
    end_s = dep.now
    lines = [
        "# sla-guard demo report", "",
        f"Simulated {meta.get('topology', '')} deployment of `{dep.model}` (profile `{dep.profile.name}`) replaying "
        f"`{meta.get('trace', '')}` for {dep.now / 60:.1f} simulated minutes at {meta.get('speed', 1):g}x "
        f"in {meta.get('wall_s', 0):.1f} s wall time. Metrics were scraped "
        f"{'over HTTP from each engine' if meta.get('http') else 'in-process'} into the guard's store.", "",
        "## Client-side results", "",
        "| requests | finished | aborted | unfinished | SLO attainment (TTFT and TPOT) | TTFT p50 / p90 "
        "| TPOT mean / p90 | GPU-hours |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s.requests} | {s.finished} | {s.aborted} | {s.unfinished} | {_fmt(s.slo_attainment, '{:.2%}')} | "
        f"{_fmt(s.ttft_p50_s, '{:.2f} s')} / {_fmt(s.ttft_p90_s, '{:.2f} s')} | "
        f"{_fmt(s.tpot_mean_s, '{:.1f} ms', 1000)} / {_fmt(s.tpot_p90_s, '{:.1f} ms', 1000)} | {s.gpu_hours:.1f} |",
    ]
    if s.unfinished:
        lines += ["", f"{s.unfinished} requests were still in flight when the run ended; the attainment counts "
                      f"them as misses."]
    if s.rejected:
        lines += ["", f"{s.rejected} requests over the profile's max_model_len were refused (a 400) and are "
                      f"not in the attainment."]
    lines += ["", "## Injected faults", ""]
    late = " (after the end of the run: never injected)"
    lines += [f"- `{json.dumps(f)}`" + (late if _fault_start(f) > end_s else "") for f in faults] or ["- none"]
    lines += ["", "## Fault story", "",
              "In simulated time: each fault's onset, the detectors' findings (with the delay from the onset of "
              "the fault that explains them) and the scaling policy's actions with the advisor's reasons.", ""]
    story = fault_story(faults, findings, actions, decisions,
                        {r.name: r.stopped_at for r in dep.replicas if r.stopped_at is not None}, end_s)
    lines += [f"- {t / 60:.1f} min: {text}" for t, text in story] or ["- nothing happened: no fault, finding or action"]
    lines += ["", "## Guard verdicts at the end", ""]
    pools = (guard_status or {}).get("pools") or []
    if guard_status is None:
        lines.append("- guard not available")
    elif not pools:
        lines.append(f"- **unknown**: no pool judged yet (the run lasted {end_s:.0f} simulated s; the guard "
                     f"evaluates every {meta.get('eval_interval_s', '?')} s and needs data in its windows)")
    for pool in pools:
        bare = pool.get("reason") and pool.get("status") != "ok" and not pool.get("slos")
        why = f" ({pool['reason']})" if bare else ""
        lines.append(f"- **{pool.get('model')}/{pool.get('pool')}**: {pool.get('status')}{why}")
        for slo in pool.get("slos", []):
            val = slo.get("value")
            shown = f"{val:.4g}" if isinstance(val, int | float) else "n/a"
            budget = slo.get("budget_remaining")
            extra = f", error budget left {100 * budget:.0f}%" if isinstance(budget, int | float) else ""
            why = f": {slo['reason']}" if slo.get("reason") and slo.get("status") != "ok" else ""
            lines.append(f"  - {slo.get('slo')}: {slo.get('status')} (value {shown}{extra}){why}")
    lines += ["", "## Findings (detectors)", ""]
    for f in findings:
        on = f" on {f['engine']}" if f.get("engine") else ""
        if f.get("resolved_min") is not None:
            state = f", resolved at {f['resolved_min']} min" + (f" ({f['resolution']})" if f.get("resolution") else "")
        else:
            state = "" if f.get("open", True) else ", resolved"
        lines.append(f"- {f.get('detector')}{on} ({f.get('severity', '')}, opened at {f.get('opened_min', '?')} min"
                     f"{state}): {f.get('summary', '')}")
    if not findings:
        lines.append("- none")
    lines += ["", "## Scaling actions", ""]
    lines += [f"- t={a['t'] / 60:.1f} min: {json.dumps({k: v for k, v in a.items() if k != 't'})}"
              for a in actions] or ["- none"]
    log = out / "decisions.jsonl"
    if decisions is not None:
        with log.open("w") as fh:
            for d in decisions:
                fh.write(json.dumps(d) + "\n")
        # every action, then the latest changes of reasons, up to DECISION_ROWS rows: a table of the
        # last 80 alone dropped the first decisions (and any early action) without a word
        acted = [i for i, d in enumerate(decisions) if d.get("direction") != "none"]
        rest = [i for i, d in enumerate(decisions) if d.get("direction") == "none"]
        keep = sorted(acted + rest[max(0, len(rest) - max(0, DECISION_ROWS - len(acted))):])
        shown = [decisions[i] for i in keep]
        n = len(decisions)
        cut = (f". {len(shown)} of {n} shown: every action and the latest changes of reasons; all {n} in "
               f"`decisions.jsonl`." if len(shown) < n else "; all of them also in `decisions.jsonl`.")
        lines += ["", "## Advisor decisions", "",
                  "Every scaling action of the advisor and every change of its reasons, per pool (time in "
                  "simulated minutes; numbers are what the decision was based on)" + cut,
                  "", "| t (min) | pool | current -> desired | reasons | confidence | numbers |",
                  "|---|---|---|---|---|---|"]
        for d in shown:
            nums = ", ".join(f"{k}={v:g}" for k, v in d.get("numbers", {}).items() if isinstance(v, int | float))
            change = (f"restart {d['replica']}" if d.get("direction") == "restart"
                      else f"{d['current']} -> {d['desired']}")
            lines.append(f"| {d['t'] / 60:.1f} | {d['pool']} | {change} | "
                         f"{', '.join(d['reasons'])} | {d['confidence']:.2f} | {nums} |")
        if not decisions:
            lines.append("| - | - | - | no decision yet | - | - |")
    else:
        log.unlink(missing_ok=True)  # a previous run's log in the same --out is not this run's
    lines += ["", "## Plots", ""]
    if no_plots:
        lines.append(f"{no_plots[0].upper()}{no_plots[1:]}.".replace(PLOTS_HINT, f"`{PLOTS_HINT}`"))
    else:
        for p, caption in plots:
            lines += [f"![{p.stem}]({p.name})", "", f"*{p.name}* -- {caption}", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({**meta, "summary": {k: v for k, v in vars_of(s).items()}},
                                                 indent=2, default=str) + "\n")
    return path


def vars_of(s: Summary) -> dict:
    from dataclasses import asdict

    return asdict(s)
