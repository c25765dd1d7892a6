"""`sla-guard demo` end to end, short: real loopback HTTP endpoints, the guard, the report."""

from __future__ import annotations

import json
import time

import pytest

from sla_guard.cli import main


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
