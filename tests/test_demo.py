"""`sla-guard demo` end to end, short: real loopback HTTP endpoints, the guard, the report."""

from __future__ import annotations

import json

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


def test_demo_rejects_bad_options(capsys, tmp_path):
    assert main(["demo", "--duration", "0", "--out", str(tmp_path)]) == 2
    assert "--duration and --speed must be > 0" in capsys.readouterr().err


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
