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


def plot_latency(history: list[HistoryPoint], out: Path, indicator: str, slo_s: float, pools: Iterable[str]) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    unit, scale = ("ms", 1000.0) if indicator == "tpot" else ("s", 1.0)
    for pool in pools:
        for stat, style in (("mean", "-"), ("p90", ":")):
            xs, ys = _series(history, f"{pool}_{indicator}_{stat}")
            if xs:
                ax.plot(xs, [y * scale for y in ys], style, label=f"{pool} {stat}")
    ax.axhline(slo_s * scale, color="red", lw=1.2, ls="--", label=f"SLA {slo_s * scale:g} {unit}")
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel(f"{indicator.upper()} ({unit})")
    ax.set_title(f"{indicator.upper()} per pool (engine-side, 1-min windows) vs SLA")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    path = out / f"{indicator}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_acceptance(history: list[HistoryPoint], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    xs, ys = _series(history, "acceptance")
    ax.plot(xs, ys, label="decode pool")
    ax.set_ylim(0, 1)
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel("accepted / drafted")
    ax.set_title("Speculative-decoding acceptance rate")
    ax.grid(alpha=0.3)
    path = out / "acceptance.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_rss(store, dep: Deployment, out: Path) -> Path:
    """One panel per process role (API server, EngineCore, worker): a leak stands out from its twins."""
    plt = _plt()
    series = store.range(c.PROCESS_RSS.series(), {}, dep.epoch, dep.epoch + dep.now + 1)
    roles = sorted({s.label("role") for s in series}) or ["-"]
    fig, axes = plt.subplots(len(roles), 1, figsize=(8, 2.4 * len(roles)), sharex=True, squeeze=False)
    for ax, role in zip(axes[:, 0], roles, strict=True):
        for s in sorted((s for s in series if s.label("role") == role), key=lambda s: s.label("engine")):
            ax.plot((s.t - dep.epoch) / 60.0, s.v / GIB, lw=0.8, label=f"{s.label('engine')} {s.label('process')}")
        ax.set_ylabel("RSS (GiB)")
        ax.set_title(f"Host RSS: {role}", fontsize=9)
        ax.legend(fontsize=6, ncol=4, loc="upper left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time (min)")
    path = out / "rss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_replicas(dep: Deployment, out: Path, recommended: list | None = None) -> Path:
    """Actual replicas per pool (ready, and including starting ones) and, when an advisor ran, what
    it recommended each tick (after its guardrails) and what its sizing alone asked for."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.4))
    tl = [*dep.timeline, (dep.now, *dep.timeline[-1][1:])]
    xs = [t / 60.0 for t, *_ in tl]
    ax.step(xs, [x[1] for x in tl], where="post", color="C0", label="prefill ready")
    ax.step(xs, [x[2] for x in tl], where="post", color="C1", label="decode ready")
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
    ax.set_title("Replicas per pool: actual and recommended")
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    ax.grid(alpha=0.3)
    path = out / "replicas.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(out: Path, *, dep: Deployment, summary: Summary, history: list[HistoryPoint], store,
                 guard_status: dict | None, findings: list[dict], faults: list[dict], actions: list[dict],
                 meta: dict, decisions: list[dict] | None = None, recommended: list | None = None) -> Path:
    """Write report.md (and the plots when matplotlib is installed) into ``out``; returns the Markdown
    path. Without matplotlib the Plots section carries ``plots_unavailable()``'s note instead."""
    out.mkdir(parents=True, exist_ok=True)
    no_plots = plots_unavailable()
    plots = [] if no_plots else [
        plot_latency(history, out, "ttft", dep.slo_ttft_s, ("prefill", "decode")),
        plot_latency(history, out, "tpot", dep.slo_tpot_s, ("decode",)),
        plot_acceptance(history, out), plot_rss(store, dep, out), plot_replicas(dep, out, recommended)]
    s = summary
    lines = [
        "# sla-guard demo report", "",
        f"Simulated {meta.get('topology', '')} deployment of `{dep.model}` (profile `{dep.profile.name}`) replaying "
        f"`{meta.get('trace', '')}` for {dep.now / 60:.1f} simulated minutes at {meta.get('speed', 1):g}x "
        f"in {meta.get('wall_s', 0):.1f} s wall time. Metrics were scraped "
        f"{'over HTTP from each engine' if meta.get('http') else 'in-process'} into the guard's store.", "",
        "## Client-side results", "",
        "| requests | finished | aborted | SLO attainment (TTFT and TPOT) | TTFT p50 / p90 | TPOT mean / p90 "
        "| GPU-hours |",
        "|---|---|---|---|---|---|---|",
        f"| {s.requests} | {s.finished} | {s.aborted} | {s.slo_attainment:.2%} | {s.ttft_p50_s:.2f} s / "
        f"{s.ttft_p90_s:.2f} s | {s.tpot_mean_s * 1000:.1f} ms / {s.tpot_p90_s * 1000:.1f} ms | {s.gpu_hours:.1f} |",
        "", "## Injected faults", "",
    ]
    lines += [f"- `{json.dumps(f)}`" for f in faults] or ["- none"]
    lines += ["", "## Guard verdicts at the end", ""]
    if guard_status:
        for pool in guard_status.get("pools", []):
            lines.append(f"- **{pool.get('model')}/{pool.get('pool')}**: {pool.get('status')}")
            for slo in pool.get("slos", []):
                val = slo.get("value")
                shown = f"{val:.4g}" if isinstance(val, int | float) else "n/a"
                budget = slo.get("budget_remaining")
                extra = f", error budget left {100 * budget:.0f}%" if isinstance(budget, int | float) else ""
                why = f": {slo['reason']}" if slo.get("reason") and slo.get("status") != "ok" else ""
                lines.append(f"  - {slo.get('slo')}: {slo.get('status')} (value {shown}{extra}){why}")
    else:
        lines.append("- guard not available")
    lines += ["", "## Findings (detectors)", ""]
    lines += [f"- {f.get('detector')} ({f.get('severity', '')}, opened at {f.get('opened_min', '?')} min"
              f"{'' if f.get('open', True) else ', resolved'}): {f.get('summary', '')}" for f in findings] or [
        "- none"]
    lines += ["", "## Scaling actions", ""]
    lines += [f"- t={a['t'] / 60:.1f} min: {json.dumps({k: v for k, v in a.items() if k != 't'})}"
              for a in actions] or ["- none"]
    if decisions is not None:
        lines += ["", "## Advisor decisions", "",
                  "Every scaling action of the advisor and every change of its reasons, per pool (time in "
                  "simulated minutes; numbers are what the decision was based on).", "",
                  "| t (min) | pool | current -> desired | reasons | confidence | numbers |",
                  "|---|---|---|---|---|---|"]
        for d in decisions[-80:]:
            nums = ", ".join(f"{k}={v:g}" for k, v in d.get("numbers", {}).items())
            lines.append(f"| {d['t'] / 60:.1f} | {d['pool']} | {d['current']} -> {d['desired']} | "
                         f"{', '.join(d['reasons'])} | {d['confidence']:.2f} | {nums} |")
        if not decisions:
            lines.append("| - | - | - | no decision yet | - | - |")
    lines += ["", "## Plots", ""]
    if no_plots:
        lines.append(f"{no_plots[0].upper()}{no_plots[1:]}.".replace(PLOTS_HINT, f"`{PLOTS_HINT}`"))
    else:
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({**meta, "summary": {k: v for k, v in vars_of(s).items()}},
                                                 indent=2, default=str) + "\n")
    return path


def vars_of(s: Summary) -> dict:
    from dataclasses import asdict

    return asdict(s)
