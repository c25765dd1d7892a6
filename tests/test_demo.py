"""`sla-guard demo` end to end, short: real loopback HTTP endpoints, the guard, the report."""

from __future__ import annotations

import json
import time

import pytest

from sla_guard.cli import main
from sla_guard.sim.deployment import Deployment
from sla_guard.sim.harness import ClosedLoop, make_store
from sla_guard.sim.profile import load_profile
from sla_guard.sim.report import fault_story, rss_figure


def _section(report: str, title: str) -> str:
    return report.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_demo_writes_the_report(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["demo", "--duration", "6", "--speed", "300", "--out", str(out), "--scrape-interval", "15"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "engines on http://127.0.0.1 ports" in text  # scraped over real HTTP
    assert "report:" in text
    report = (out / "report.md").read_text()
    assert "## Injected faults" in report and '"kind": "leak"' in report and "acceptance_drift" in report
    assert "## Guard verdicts at the end" in report and "glm-5.2/decode" in report
    for name in ("ttft", "tpot", "acceptance", "rss", "replicas"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"({name}.png)" in report
    # the advisor at work: its decisions with reasons and confidence, recommended replicas plotted
    assert "## Advisor decisions" in report and "| prefill |" in report and "| decode |" in report
    assert '"kind": "load_spike"' in report
    # each plot's caption names what it draws: TTFT where the guard judges it (the client; the plot
    # showed the engine-side pools only) against the SLA and the p90 objective, replicas recommended
    # next to the actual ones
    ttft = next(line for line in report.splitlines() if line.startswith("*ttft.png*"))
    assert "client mean" in ttft and "SLA 2.5 s" in ttft and "p90 objective 5 s" in ttft, ttft
    replicas = next(line for line in report.splitlines() if line.startswith("*replicas.png*"))
    assert "decode recommended" in replicas and "decode ready" in replicas, replicas
    summary = json.loads((out / "summary.json").read_text())
    assert summary["http"] is True and summary["summary"]["requests"] > 100
    assert summary["summary"]["finished"] > 0 and summary["summary"]["aborted"] == 0
    assert summary["policy"] == "guard"


@pytest.mark.parametrize(("flag", "value", "rule"), [
    ("--duration", "0", "> 0"), ("--duration", "nan", "> 0"), ("--speed", "inf", "> 0"),
    ("--scrape-interval", "0", "> 0"), ("--scrape-interval", "-5", "> 0"), ("--drift-to", "-1", ">= 0"),
    ("--leak-mib-per-hour", "-100", ">= 0"), ("--surge", "0.5", ">= 1"),
])
def test_demo_rejects_bad_options(capsys, tmp_path, flag, value, rule):
    """Each was a traceback (inf, nan, a zero scrape interval) or a run of a story no engine tells
    (negative acceptance, a shrinking leak, a 'surge' below 1 silently dropped)."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--duration", "1", "--no-http", "--quiet", "--out", str(tmp_path / "demo"), flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and rule in err and "Traceback" not in err, err
    assert not (tmp_path / "demo").exists()


def test_demo_refuses_a_span_it_cannot_hold(capsys, tmp_path):
    """--speed 1e9 submitted 9e10 simulated seconds of arrivals up front: a hang while memory grew."""
    assert main(["demo", "--speed", "1e9", "--no-http", "--quiet", "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert "simulated hours" in err and "--speed" in err and not (tmp_path / "demo").exists()


def test_demo_refuses_a_surge_it_cannot_keep_up_with(capsys, tmp_path):
    """The surge's copies of every request are submitted up front: --surge 1e300 grew by 1.4 GB in
    20 s and never ended, 100 ran a 2 s demo for 33 s. Over 10 it is refused, replay named."""
    assert main(["demo", "--surge", "11", "--duration", "1", "--no-http", "--quiet",
                 "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert "--surge 11 is over 10" in err and "replay" in err and not (tmp_path / "demo").exists()


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_demo_refuses_an_unusable_out_before_running(capsys, tmp_path, kind):
    """An --out that is a file (or lies under one) was a traceback at the very end, after the whole
    run (90 s by default), with the report lost; it is refused at once, as replay does."""
    blocker = tmp_path / "report"
    blocker.write_text("not a directory")
    out = blocker if kind == "a file" else blocker / "demo"
    t0 = time.monotonic()
    rc = main(["demo", "--duration", "30", "--speed", "60", "--no-http", "--quiet", "--out", str(out)])
    assert rc == 2 and time.monotonic() - t0 < 10  # refused before the 30 s run
    err = capsys.readouterr().err
    assert f"--out {out}" in err and "writable directory" in err and "Traceback" not in err, err
    assert blocker.read_text() == "not a directory"


def test_demo_fault_story_ends_in_every_finding(tmp_path, capsys):
    """The default 3-hour story, as fast as the CPU runs it (in-process scraping): the injected
    acceptance drop, the TPOT it costs at the same batch and the decode engines' 200 MiB/h leak each end in a
    finding, after their onsets (60, 60 and 9 min). Session 16 found the default demo raising
    neither the TPOT finding (a thin warm-up's noise estimate) nor the leak one (the leak
    detector's 90-min start-up exclusion, not shortened to the run like the drift warm-ups)."""
    out = tmp_path / "demo"
    assert main(["demo", "--duration", "1.08", "--speed", "10000", "--no-http", "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    report = (out / "report.md").read_text()
    found = report.split("## Findings (detectors)", 1)[1].split("\n## ", 1)[0]
    opened = {}
    for line in found.splitlines():
        if line.startswith("- ") and "opened at " in line:
            kind = line[2:].split(" ", 1)[0]
            opened.setdefault(kind, float(line.split("opened at ", 1)[1].split(" min", 1)[0]))
    assert set(opened) >= {"acceptance_drift", "tpot_drift", "leak"}, found
    assert 60 < opened["acceptance_drift"] < 80 and 60 < opened["tpot_drift"] < 120 and 9 < opened["leak"] < 180
    # the story reads in time order: each fault, its findings with the detection delay, the actions
    # with the advisor's reasons; the leak ends in a rolling restart that says why (it had none)
    story = [line for line in _section(report, "Fault story").splitlines() if line.startswith("- ")]
    times = [float(line[2:].split(" min: ", 1)[0]) for line in story]
    assert times == sorted(times), story
    text = "\n".join(story)
    delay = f"{opened['acceptance_drift'] - 60:.1f} min after the onset of the acceptance_drift fault"
    assert f"{opened['acceptance_drift']:.1f} min: finding: acceptance_drift (warning), {delay}" in text, text
    assert f"{opened['leak'] - 9:.1f} min after the onset of the leak fault" in text, text
    assert "fault: load surge: 2x the arrivals until 60.0 min" in text and "(prefill_demand_over_capacity)" in text
    assert "(leak_rolling_restart)" in text and "| restart d" in report
    # every decision is in decisions.jsonl, and the table, cut to 80 rows, says so and keeps every
    # action (it showed the last 80 of 86 under "every ... change of its reasons", the first ones lost)
    logged = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    table = _section(report, "Advisor decisions")
    assert f"80 of {len(logged)} shown" in table if len(logged) > 80 else "all of them" in table
    for d in logged:
        if d["direction"] not in ("none", "restart"):
            assert f"| {d['t'] / 60:.1f} | {d['pool']} | {d['current']} -> {d['desired']} |" in table, d


def test_a_demo_shorter_than_one_evaluation_says_unknown(tmp_path, capsys):
    """10 simulated s, under the 30 s evaluation interval: the guard never judged. The report's
    verdict section was empty (stdout said unknown), and the client table hid the 37 of 54
    requests still in flight that its 24% attainment counts as misses."""
    out = tmp_path / "demo"
    assert main(["demo", "--duration", "0.1", "--speed", "100", "--no-http", "--quiet", "--out", str(out)]) == 0
    assert "guard verdict: unknown" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    verdicts = _section(report, "Guard verdicts at the end")
    assert "**unknown**: no pool judged yet" in verdicts and " ok" not in verdicts, verdicts
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["unfinished"] > 0
    assert f"| {summary['unfinished']} |" in _section(report, "Client-side results")
    assert f"{summary['unfinished']} requests were still in flight" in report


def test_a_demo_without_faults_lists_none(tmp_path, capsys):
    """--leak-mib-per-hour 0 --surge 1 --drift-to 1 asks for no fault; the report still listed a
    0 MiB/h leak in d0 and d1 and an acceptance drift to 1x as injected."""
    out = tmp_path / "demo"
    assert main(["demo", "--duration", "0.1", "--speed", "100", "--no-http", "--out", str(out),
                 "--leak-mib-per-hour", "0", "--surge", "1", "--drift-to", "1"]) == 0
    assert "faults: []" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert _section(report, "Injected faults").strip() == "- none"
    assert "fault:" not in _section(report, "Fault story")


def test_fault_story_pairs_each_finding_with_the_fault_that_explains_it():
    """Faults, findings and actions used to sit in three lists in three units (seconds, minutes,
    JSON): no order, no detection delay, and a fault in a replica scaled away before its onset read
    as injected."""
    faults = [{"kind": "leak", "replica": "d0", "role": "engine_core", "mib_per_hour": 200.0, "start_s": 540.0},
              {"kind": "leak", "replica": "d1", "role": "engine_core", "mib_per_hour": 200.0, "start_s": 540.0},
              {"kind": "acceptance_drift", "start_s": 3600.0, "end_s": 7200.0, "to_factor": 0.4},
              {"kind": "leak", "replica": "d2", "mib_per_hour": 50.0, "start_s": 9000.0},
              {"kind": "load_spike", "start_s": 20000.0, "end_s": 21000.0, "factor": 2.0}]
    findings = [{"detector": "tpot_drift", "severity": "warning", "summary": "TPOT up", "opened_min": 80.5},
                {"detector": "leak", "severity": "warning", "summary": "grows", "opened_min": 119.5, "engine": "d1",
                 "resolved_min": 160.0, "resolution": "series_gone"},
                {"detector": "prefix_hit_drift", "severity": "warning", "summary": "hits down", "opened_min": 30.0}]
    actions = [{"t": 72.0, "pool": "decode", "from": 2, "to": 1}, {"t": 7170.0, "restart": "d1"}]
    decisions = [{"t": 72.0, "pool": "decode", "direction": "down", "reasons": ["decode_over_provisioned"]},
                 {"t": 7170.0, "pool": "decode", "direction": "restart", "replica": "d1",
                  "reasons": ["leak_rolling_restart"]}]
    story = fault_story(faults, findings, actions, decisions, {"d0": 84.0}, end_s=10800.0)
    assert [t for t, _ in story] == sorted(t for t, _ in story)
    text = [f"{t / 60:.1f} {line}" for t, line in story]
    assert text == [
        "1.2 policy: decode 2 -> 1 (decode_over_provisioned)",
        "9.0 fault: leak of 200 MiB/h in d0's engine_core (d0 had stopped at 1.4 min: never ran)",
        "9.0 fault: leak of 200 MiB/h in d1's engine_core",
        "30.0 finding: prefix_hit_drift (warning), no injected fault explains it: hits down",
        "60.0 fault: spec-decode acceptance falling to 0.4x of the profile's by 120.0 min, then held, "
        "on every decode replica",
        "80.5 finding: tpot_drift (warning), 20.5 min after the onset of the acceptance_drift fault: TPOT up",
        "119.5 finding: leak on d1 (warning), 110.5 min after the onset of the leak fault: grows",
        "119.5 policy: rolling restart of d1 (leak_rolling_restart)",
        "150.0 fault: leak of 50 MiB/h in d2's engine_core",
        "160.0 resolved (series_gone): leak on d1",
        "180.0 not detected by the end of the run: leak of 50 MiB/h in d2's engine_core",
    ], text  # the surge at 333 min is after the end: never injected, not in the story


def test_rss_plot_gives_every_engine_its_own_line_style():
    """Twelve engines on matplotlib's ten-color cycle: p7 was drawn in d1's color, so the rising
    line of the leaking d1 could be read as p7's."""
    mcolors = pytest.importorskip("matplotlib.colors")
    dep = Deployment(load_profile("default"), 8, 4, seed=0)
    store = make_store(retention_s=3600, interval_s=15)
    ClosedLoop(dep, store=store, scrape_interval_s=15, eval_interval_s=60)
    dep.run_until(120)
    fig = rss_figure(store, dep)
    for ax in fig.axes:
        styles = {}
        for line in ax.lines:
            engine = line.get_label().split(" ", 1)[0]
            styles.setdefault((mcolors.to_hex(line.get_color()), line.get_linestyle()), set()).add(engine)
        assert len(ax.lines) == 12 and all(len(v) == 1 for v in styles.values()), styles
    pytest.importorskip("matplotlib.pyplot").close(fig)
