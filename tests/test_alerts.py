"""Generated Prometheus rules: reproducible, valid for promtool, unit-tested (fire and no-fire per
alert), documented (runbook anchors exist), routed by the example Alertmanager config."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from alerts.generate import RULES_DIR, diff, render_rules
from alerts.params import RuleParams, fmt_duration
from alerts.slo_rules import GenerationError, set_matchers
from exporters import contract as c
from exporters import promql as pq
from sla_guard.cli import main as cli
from sla_guard.config import SLO, GuardConfig, SLOSet, parse_config

ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = ROOT / "alerts" / "tests"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
AM_CONFIG = ROOT / "alerts" / "alertmanager.yml"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool missing: run scripts/setup.sh --full")
needs_amtool = pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool missing: run scripts/setup.sh --full")


def alert_rules(files: dict[str, str] | None = None) -> list[dict]:
    files = files or {p.name: p.read_text() for p in RULES_DIR.glob("*.yaml")}
    return [r for text in files.values() for g in yaml.safe_load(text)["groups"] for r in g["rules"] if "alert" in r]


def github_anchors(markdown: str) -> set[str]:
    """Heading slugs as GitHub renders them."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_committed_rules_are_regenerated_exactly():
    assert diff(render_rules(), RULES_DIR, "*.yaml") == []


def test_generate_check_detects_drift_and_write_fixes_it(tmp_path):
    args = ["generate", "--rules-dir", str(tmp_path / "r"), "--dashboards-dir", str(tmp_path / "d")]
    assert cli([*args, "--check"]) == 1  # nothing there yet
    assert cli(args) == 0
    assert cli([*args, "--check"]) == 0
    (tmp_path / "r" / "slo.yaml").write_text("groups: []\n")
    (tmp_path / "d" / "stray.json").write_text("{}")
    assert cli([*args, "--check"]) == 1


def test_generate_writes_under_the_working_directory_not_into_the_package(tmp_path, monkeypatch):
    """The defaults were the package's own folders: from a pip install, `sla-guard generate
    --config mine.yaml` wrote the user's rules into site-packages (and the docs page beside it).
    They are ./alerts/rules and ./dashboards/json; the doc is written only where a checkout has it."""
    committed = {p.name: p.read_bytes() for p in RULES_DIR.glob("*.yaml")}
    monkeypatch.chdir(tmp_path)
    assert cli(["generate"]) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "alerts" / "rules").glob("*.yaml")} == committed
    assert list((tmp_path / "dashboards" / "json").glob("*.json")) and not (tmp_path / "docs").exists()
    assert cli(["generate", "--check"]) == 0
    assert {p.name: p.read_bytes() for p in RULES_DIR.glob("*.yaml")} == committed


def test_generate_without_the_dashboards_extra_names_it(tmp_path, monkeypatch, capsys):
    """A pip install without the [dashboards] extra (the Grafana SDK) ended in a traceback."""
    import sys

    for mod in [m for m in sys.modules if m == "dashboards" or m.startswith(("dashboards.", "grafana_foundation_sdk"))]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "grafana_foundation_sdk", None)  # as if not installed
    monkeypatch.chdir(tmp_path)
    assert cli(["generate"]) == 2
    assert "pip install 'sla-guard[dashboards]'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rules-dir", "--dashboards-dir"])
def test_generate_into_a_file_is_an_error_naming_the_flag(tmp_path, capsys, flag):
    """An output directory that is a regular file was a FileExistsError traceback."""
    blocker = tmp_path / "plain"
    blocker.write_text("a file")
    dirs = {"--rules-dir": str(tmp_path / "r"), "--dashboards-dir": str(tmp_path / "d"), flag: str(blocker)}
    assert cli(["generate", *(x for kv in dirs.items() for x in kv)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {blocker}: cannot write there" in err and "writable directory" in err, err
    assert blocker.read_text() == "a file"


def test_generate_rejects_a_bad_config_with_the_field(tmp_path, capsys):
    bad = tmp_path / "guard.yaml"
    bad.write_text("slos:\n- objectives:\n  - {name: x, indicator: ttft, objective: attainment, threshold_s: 2.2,"
                   " target: 0.99}\n")
    assert cli(["generate", "--config", str(bad), "--check"]) == 2
    err = capsys.readouterr().err
    assert "threshold_s 2.2" in err and "SLA_GUARD_TTFT_SLO_S" in err


@needs_promtool
def test_promtool_check_rules_accepts_committed_and_scaled_rules(tmp_path):
    files = sorted(RULES_DIR.glob("*.yaml"))
    assert len(files) == 5  # slo, engine, host, guard, routers
    r = subprocess.run(["promtool", "check", "rules", *map(str, files)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for name, text in render_rules(params=RuleParams(time_scale=1 / 60)).items():
        (tmp_path / name).write_text(text)
    r = subprocess.run(["promtool", "check", "rules", *map(str, sorted(tmp_path.glob("*.yaml")))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_lint_is_clean_for_committed_and_multi_set_rules(tmp_path):
    """Operators run ``promtool check rules --lint=all --lint-fatal`` in CI. Disjoint SLO sets
    recorded the same ``record``/``alert`` with the same static labels (27 duplicate-rule findings
    in slo.yaml); each set's rules now carry its ``slo_set``. Lints the committed files and a
    config with overlapping model- and pool-specific sets."""
    config = GuardConfig(slos=[SLOSet(), SLOSet(pool="decode"), SLOSet(model="big"),
                               SLOSet(model="big", pool="prefill")])
    for name, text in render_rules(config).items():
        (tmp_path / name).write_text(text)
    for files in (sorted(RULES_DIR.glob("*.yaml")), sorted(tmp_path.glob("*.yaml"))):
        r = subprocess.run(["promtool", "check", "rules", "--lint=all", "--lint-fatal", *map(str, files)],
                           capture_output=True, text=True)
        assert r.returncode == 0 and "lint error" not in r.stdout + r.stderr, r.stdout + r.stderr


@needs_promtool
def test_promtool_unit_tests_pass():
    tests = sorted(TESTS_DIR.glob("*_test.yaml"))
    r = subprocess.run(["promtool", "test", "rules", *map(str, tests)], capture_output=True, text=True, cwd=TESTS_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(tests)


@needs_promtool
def test_promtool_unit_tests_fail_when_a_rule_is_broken(tmp_path):
    """The unit tests can fail: a mean-TTFT SLA of 3.5 s instead of 2.5 s must break them."""
    work = tmp_path / "alerts"
    shutil.copytree(ROOT / "alerts" / "tests", work / "tests")
    (work / "rules").mkdir()
    config = parse_config({"slos": [{"objectives": [
        {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 3.5},
        *[o.model_dump(mode="json") for o in GuardConfig().slos[0].objectives[1:]]]}]})
    for name, text in render_rules(config).items():
        (work / "rules" / name).write_text(text)
    r = subprocess.run(["promtool", "test", "rules", "slo_test.yaml"], capture_output=True, text=True,
                       cwd=work / "tests")
    assert r.returncode != 0 and "SlaGuardTTFTMeanHigh" in r.stdout + r.stderr


# A 7-day 99% TTFT attainment SLO: the shared table's rows for it (sla_guard/burn_windows.py).
SEVEN_DAYS = GuardConfig(slos=[SLOSet(objectives=[SLO(name="ttft_attainment", indicator="ttft", objective="attainment",
                                                      threshold_s=2.5, target=0.99, period="7d")])])
SEVEN_DAY_ROWS = (("1h", "5m", "critical", "3.36", "2%"), ("6h", "30m", "critical", "1.4", "5%"),
                  ("1d", "2h", "warning", "0.7", "10%"), ("3d", "6h", "warning", "0.233333", "10%"))


def _seven_day_burn_test(rules: str) -> str:
    """promtool unit test: pool 'hot' misses the TTFT threshold on 3.4% of its requests (burn 3.4),
    'warm' on 3.3% (burn 3.3), constant for 90 min. The 1h&5m page (3.36x) fires for hot only;
    the slower rows (1.4x, 0.7x, 0.233333x) fire for both."""
    series = []
    for pool, bad in (("hot", 34), ("warm", 33)):
        lab = f'model="m",pool="{pool}",engine="0",instance="{pool}0",job="vllm"'
        series += [{"series": f"{c.REQUEST_TTFT.series('_count')}{{{lab}}}", "values": "0+1000x90"},
                   {"series": f'{c.REQUEST_TTFT.series("_bucket")}{{{lab},le="2.5"}}', "values": f"0+{1000 - bad}x90"}]
    alerts = []
    for pool, pct in (("hot", "3.4%"), ("warm", "3.3%")):
        for long_w, short_w, sev, factor, share in SEVEN_DAY_ROWS:
            if pool == "warm" and long_w == "1h":
                continue  # burn 3.3 < 3.36: no page
            alerts.append({
                "exp_labels": {"severity": sev, "model": "m", "pool": pool, "slo": "ttft_attainment",
                               "slo_set": "*/*", "long_window": long_w, "short_window": short_w},
                "exp_annotations": {
                    "summary": f"m/{pool}: TTFT error budget of SLO ttft_attainment burning {factor}x too fast",
                    "description": f"{pct} of TTFT requests exceeded 2.5s over the last {long_w} (and the last "
                                   f"{short_w}); target 0.99 over 7d. At this rate {share} of the 7d error budget "
                                   f"is gone in {long_w}.",
                    "runbook_url": f"{GuardConfig().alertmanager.runbook_base_url}#slaguarderrorbudgetburn"}})
    return yaml.safe_dump({"rule_files": [rules], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [{"eval_time": "80m", "alertname": "SlaGuardErrorBudgetBurn", "exp_alerts": alerts}]}]},
        sort_keys=False)


@needs_promtool
def test_promtool_7d_slo_pages_over_1h_and_5m_above_3_36_and_not_below(tmp_path):
    """Generated rules for a 7-day SLO, through promtool: the factors the guard uses too (issue 12)."""
    rules = render_rules(SEVEN_DAYS)["slo.yaml"]
    assert rules.count("> 0.0336\n") == 2  # 3.36 x the 1% budget, on the 1h and the 5m ratio
    (tmp_path / "slo.yaml").write_text(rules)
    (tmp_path / "burn_test.yaml").write_text(_seven_day_burn_test("slo.yaml"))
    r = subprocess.run(["promtool", "test", "rules", "burn_test.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    # the test discriminates: the guard's old 7-day page factor (14.4) keeps 'hot' quiet
    (tmp_path / "slo.yaml").write_text(rules.replace("> 0.0336", "> 0.144"))
    r = subprocess.run(["promtool", "test", "rules", "burn_test.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "long_window=\"1h\"" in r.stdout + r.stderr


def test_every_alert_has_a_fire_and_a_no_fire_case():
    names = {r["alert"] for r in alert_rules()}
    fire: set[str] = set()
    quiet: set[str] = set()
    for f in TESTS_DIR.glob("*_test.yaml"):
        for t in yaml.safe_load(f.read_text())["tests"]:
            for a in t.get("alert_rule_test", []):
                (fire if a.get("exp_alerts") else quiet).add(a["alertname"])
    assert names, "no alerts generated"
    assert names - fire == set(), "alerts without a firing test case"
    assert names - quiet == set(), "alerts without a no-fire test case"


def test_every_alert_is_documented_and_routed():
    anchors = github_anchors(RUNBOOKS.read_text())
    base = GuardConfig().alertmanager.runbook_base_url
    for r in alert_rules():
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], r["alert"]
        assert ann["runbook_url"].startswith(base + "#"), r["alert"]
        assert ann["runbook_url"].split("#", 1)[1] in anchors, f"{r['alert']}: no section in docs/runbooks.md"
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]


def test_detector_runbook_sections_exist():
    anchors = github_anchors(RUNBOOKS.read_text())
    assert {"leak", "acceptance-drift", "prefix-hit-drift", "tpot-drift"} <= anchors


@needs_amtool
def test_amtool_checks_example_config_and_routes_by_severity():
    r = subprocess.run(["amtool", "check-config", str(AM_CONFIG)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for severity, receiver in (("critical", "pager"), ("warning", "ticket"), ("info", "chat")):
        r = subprocess.run(["amtool", "config", "routes", "test", f"--config.file={AM_CONFIG}",
                            "alertname=SlaGuardTTFTMeanHigh", f"severity={severity}"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == receiver, (severity, r.stdout)


def test_no_metric_name_is_spelled_outside_the_contract():
    sources = [*ROOT.joinpath("alerts").glob("*.py"), *ROOT.joinpath("dashboards").glob("*.py")]
    for src in sources:
        text = src.read_text()
        assert c.PREFIX not in text, f"{src.name} spells a contract metric name; import it from exporters.contract"


def test_rules_reference_only_contract_metrics_and_own_records():
    records = set()
    exprs = []
    for text in render_rules().values():
        for g in yaml.safe_load(text)["groups"]:
            for r in g["rules"]:
                records.add(r.get("record"))
                exprs.append(r["expr"])
    known = {m.exposed for m in c.ALL} | {m.series(s) for m in c.ALL if m.kind is c.Kind.HISTOGRAM
                                          for s in pq.HISTOGRAM_SUFFIXES} | records | {"up"}
    for e in exprs:
        for name in re.findall(r"\b(slaguard_\w+|\w+:\w+:\w+)", e):
            assert name in known, f"{name} in {e!r} is neither a contract series nor a recording rule"


def test_time_scale_shrinks_windows_but_keeps_record_names():
    fast = render_rules(params=RuleParams(time_scale=1 / 60))["slo.yaml"]
    assert "model_pool_slo:sli_error:ratio_rate1h" in fast
    assert "[1m]" in fast and "[1h]" not in fast
    assert fmt_duration(72 * 60) == "72m" and fmt_duration(5) == "5s" and fmt_duration(86400) == "1d"


def test_slo_sets_are_disjoint_most_specific_wins():
    sets = [SLOSet(), SLOSet(pool="decode"), SLOSet(model="big"), SLOSet(model="big", pool="prefill")]
    assert set_matchers(sets, 0) == ['model!~"big"', 'pool!~"decode"']
    assert set_matchers(sets, 1) == ['pool="decode"', 'model!~"big"']
    assert set_matchers(sets, 2) == ['model="big"', 'pool!~"prefill"']
    assert set_matchers(sets, 3) == ['model="big"', 'pool="prefill"']
    with pytest.raises(GenerationError, match="slos\\[1\\]"):
        set_matchers([SLOSet(), SLOSet(model="big", pool="prefill")], 0)


def test_custom_slo_spec_drives_the_rules():
    slo = SLO(name="tpot_fast", indicator="tpot", objective="attainment", threshold_s=0.015, target=0.999,
              period="7d")
    config = GuardConfig(slos=[SLOSet(pool="decode", objectives=[slo])])
    rules = alert_rules(render_rules(config))
    burns = [r for r in rules if r["alert"] == "SlaGuardErrorBudgetBurn"]
    assert len(burns) == 4
    # 2% of a 7-day budget in 1h: factor 0.02 * 168 = 3.36, times the 0.1% budget
    assert "> 0.00336\n" in burns[0]["expr"] and 'pool="decode"' in burns[0]["expr"]
    recs = render_rules(config)["slo.yaml"]
    assert f'le="{pq.le(0.015)}"' in recs and c.REQUEST_TPOT.series("_bucket") in recs


@needs_promtool
def test_model_names_are_quoted_and_regex_escaped_in_the_rules(tmp_path):
    """A model named ``we"ird\\m`` ended the PromQL string (promtool: parse error), and the
    catch-all set's ``model!~"qwen2.5"`` also excluded ``qwen2x5`` (the dot matches anything):
    that model's SLO was never recorded, so never alerted on. Names are now string literals and
    the exclusion an escaped alternation: the rules pass promtool, and qwen2x5 is recorded."""
    ttft = SLO(name="ttft_mean", indicator="ttft", objective="mean", threshold_s=2.5)
    config = GuardConfig(slos=[SLOSet(objectives=[ttft]), SLOSet(model="qwen2.5", objectives=[ttft]),
                               SLOSet(model='we"ird\\m', objectives=[ttft])])
    assert set_matchers(config.slos, 0) == ['model!~"qwen2\\\\.5|we\\"ird\\\\\\\\m"']
    assert set_matchers(config.slos, 2) == ['model="we\\"ird\\\\m"']
    (tmp_path / "slo.yaml").write_text(render_rules(config)["slo.yaml"])
    r = subprocess.run(["promtool", "check", "rules", "slo.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lab = 'model="{}",pool="decode",engine="0",instance="d0",job="vllm"'
    series = [{"series": f"{c.REQUEST_TTFT.series(part)}{{{lab.format(m)}}}", "values": values}
              for m in ("qwen2x5", "qwen2.5") for part, values in (("_sum", "0+600x10"), ("_count", "0+60x10"))]
    mean = "model_pool_slo:sli_latency_seconds:mean5m"
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"rule_files": ["slo.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
            {"expr": f'{mean}{{model="qwen2x5"}}', "eval_time": "6m", "exp_samples": [
                {"labels": f'{mean}{{model="qwen2x5",pool="decode",slo="ttft_mean",slo_set="*/*"}}', "value": 10}]}]}]},
        sort_keys=False))
    r = subprocess.run(["promtool", "test", "rules", "t.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def _promtool_test(tmp_path: Path, rule_files: dict[str, str], series: list[dict],
                   tests: dict) -> subprocess.CompletedProcess:
    """``promtool test rules`` of ``rule_files`` (name -> text) over ``series``, one test group."""
    for name, text in rule_files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"rule_files": list(rule_files), "evaluation_interval": "1m",
                                                     "tests": [{"interval": "1m", "input_series": series, **tests}]},
                                                    sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", "t.yaml"], capture_output=True, text=True, cwd=tmp_path)


@needs_promtool
def test_an_engine_without_the_threshold_bucket_is_left_out_of_the_error_ratio(tmp_path):
    """Mid rolling restart to new SLA buckets: d1 has no le="2.5" bucket. Its requests were in the
    total and in none of the good ones (every one an error): 50 % errors and all four burn alerts
    on a pool whose measured requests all met the SLA. The guard leaves such an engine out; so do
    the rules now (ratio 0, nothing fires)."""
    lab = 'model="m",pool="decode",engine="0",job="vllm",instance="{}"'
    name = c.REQUEST_TTFT.series
    series = [{"series": f"{name(part)}{{{lab.format(inst)}{le}}}", "values": "0+100x200"}
              for inst, les in (("d0", ("2.5", "+Inf")), ("d1", ("3.0", "+Inf")))
              for part, le in [("_count", ""), *(("_bucket", f',le="{x}"') for x in les)]]
    ratio = "model_pool_slo:sli_error:ratio_rate1h"
    r = _promtool_test(tmp_path, {"slo.yaml": render_rules()["slo.yaml"]}, series, {
        "promql_expr_test": [{"expr": ratio, "eval_time": "150m", "exp_samples": [
            {"labels": f'{ratio}{{model="m",pool="decode",slo="ttft_attainment",slo_set="*/*"}}', "value": 0}]}],
        "alert_rule_test": [{"eval_time": "150m", "alertname": "SlaGuardErrorBudgetBurn", "exp_alerts": []}]})
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
@pytest.mark.parametrize(("refused", "ratio_value", "fires"), [("0+100x200", 0.5, True), ("0+0x200", 0, False)])
def test_admission_rejections_are_ttft_attainment_misses_in_the_rules(tmp_path, refused, ratio_value, fires):
    """A decode pool serves 100 requests a minute, all under 2.5 s, and its API server refuses 100
    more at a queue limit (vLLM admission control, 503). The rules read 0 % errors and stayed silent
    while half the clients were refused; they now count refusals as misses, as the guard does
    (error ratio 0.5, the 1h&5m page fires). No refusal (the zero series): ratio 0, nothing fires."""
    lab = 'model="m",pool="decode",job="vllm",instance="d0"'
    name = c.REQUEST_TTFT.series
    series = [{"series": f"{name(part)}{{{lab},engine=\"0\"{le}}}", "values": "0+100x200"}
              for part, le in (("_count", ""), ("_bucket", ',le="2.5"'), ("_bucket", ',le="+Inf"'))]
    series.append({"series": f'{c.ADMISSION_REJECTIONS.series()}{{{lab},reason="max_num_queued_reqs"}}',
                   "values": refused})
    ratio = "model_pool_slo:sli_error:ratio_rate1h"
    page = 'ALERTS{alertname="SlaGuardErrorBudgetBurn",alertstate="firing",long_window="1h",model="m"}'
    r = _promtool_test(tmp_path, {"slo.yaml": render_rules()["slo.yaml"]}, series, {
        "promql_expr_test": [
            {"expr": f'{ratio}{{slo="ttft_attainment"}}', "eval_time": "150m", "exp_samples": [
                {"labels": f'{ratio}{{model="m",pool="decode",slo="ttft_attainment",slo_set="*/*"}}',
                 "value": ratio_value}]},
            {"expr": f"count({page})", "eval_time": "150m", "exp_samples": [{"value": 1}] if fires else []}]})
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
@pytest.mark.parametrize("failing", [True, False])
def test_streamed_client_errors_are_attainment_misses_in_the_rules(tmp_path, failing):
    """The proxy serves 100 streamed requests a minute, all in time, and fails 100 more before their first
    token (every engine 503) and 100 after it (streams cut). The client scope's rules read 0 % errors and stayed
    silent while clients got errors; they now count those as misses, as the guard does: TTFT for the first, TPOT
    for the second (error ratio 0.5 each, both 1h&5m pages fire). None failed (the proxy has not exposed the
    counters yet): ratio 0, no page."""
    lab = 'model="m",pool="client",route="pd",router="px",job="proxy",instance="px0"'
    cases = (("ttft_attainment", c.CLIENT_TTFT, "2.5", c.CLIENT_FAILED_BEFORE_FIRST_TOKEN),
             ("tpot_attainment", c.CLIENT_TPOT, "0.02", c.CLIENT_FAILED_AFTER_FIRST_TOKEN))
    series, tests = [], []
    ratio = "model_pool_slo:sli_error:ratio_rate1h"
    for slo, metric, le, failed in cases:
        series += [{"series": f"{metric.series(part)}{{{lab}{x}}}", "values": "0+100x200"}
                   for part, x in (("_count", ""), ("_bucket", f',le="{le}"'), ("_bucket", ',le="+Inf"'))]
        if failing:
            series.append({"series": f"{failed.series()}{{{lab}}}", "values": "0+100x200"})
        page = (f'ALERTS{{alertname="SlaGuardErrorBudgetBurn",alertstate="firing",long_window="1h",model="m",'
                f'slo="{slo}"}}')
        tests += [{"expr": f'{ratio}{{slo="{slo}"}}', "eval_time": "150m", "exp_samples": [
                      {"labels": f'{ratio}{{model="m",pool="client",slo="{slo}",slo_set="*/*"}}',
                       "value": 0.5 if failing else 0}]},
                  {"expr": f"count({page})", "eval_time": "150m", "exp_samples": [{"value": 1}] if failing else []}]
    r = _promtool_test(tmp_path, {"slo.yaml": render_rules()["slo.yaml"]}, series, {"promql_expr_test": tests})
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_an_upgrade_adding_the_threshold_bucket_fires_no_burn_alert_and_a_real_violation_still_pages(tmp_path):
    """Both engines are upgraded in place at 100m (a restart: counters from 0) to a bucket set
    with le="2.5". d0 serves every request in time; d1's upgrade makes half of them slow. The
    new bucket's ``rate`` counts since it appeared, ``_count``'s the whole window: 5 min after the
    upgrade d0 read 94 % errors over 6h, 1d and 3d (76 % over 1d 30 min later) and paged (6h&30m)
    with every request in time. An engine now counts in a window once its threshold bucket covered it: no
    alert for d0, the short windows exact at once, and d1's page (1h&5m) once the hour has passed. The
    1d window sums 5-min slices, each counted once covered: at 130m it reads d0's 25 covered minutes
    (0) and d1's (0.5) at once, where a raw 1d window left both out for a day; the tickets still wait
    for their 2h and 6h windows."""
    lab = 'model="{}",pool="decode",engine="0",job="vllm",instance="{}"'
    name = c.REQUEST_TTFT.series
    old, new = 100, 80  # one-minute samples before and after the upgrade
    series = []
    for model, inst, good in (("m", "d0", 60), ("v", "d1", 30)):
        every = f"1000+60x{old - 1} 60+60x{new - 1}"
        series += [{"series": f"{name('_count')}{{{lab.format(model, inst)}}}", "values": every},
                   {"series": f'{name("_bucket")}{{{lab.format(model, inst)},le="+Inf"}}', "values": every},
                   {"series": f'{name("_bucket")}{{{lab.format(model, inst)},le="2.5"}}',
                    "values": f"_x{old} {good}+{good}x{new - 1}"}]
    rec = 'model_pool_slo:sli_error:ratio_rate{}{{model="{}",pool="decode",slo="ttft_attainment",slo_set="*/*"}}'
    page = {"exp_labels": {"severity": "critical", "model": "v", "pool": "decode", "slo": "ttft_attainment",
                           "slo_set": "*/*", "long_window": "1h", "short_window": "5m"},
            "exp_annotations": {
                "summary": "v/decode: TTFT error budget of SLO ttft_attainment burning 14.4x too fast",
                "description": "50% of TTFT requests exceeded 2.5s over the last 1h (and the last 5m); target 0.99 "
                               "over 30d. At this rate 2% of the 30d error budget is gone in 1h.",
                "runbook_url": f"{GuardConfig().alertmanager.runbook_base_url}#slaguarderrorbudgetburn"}}
    r = _promtool_test(tmp_path, {"slo.yaml": render_rules()["slo.yaml"]}, series, {
        "promql_expr_test": [
            {"expr": rec.format("5m", "m"), "eval_time": "130m", "exp_samples": [
                {"labels": rec.format("5m", "m"), "value": 0}]},
            {"expr": rec.format("1h", "m"), "eval_time": "130m", "exp_samples": []},
            {"expr": rec.format("1d", "m"), "eval_time": "130m", "exp_samples": [
                {"labels": rec.format("1d", "m"), "value": 0}]},
            {"expr": rec.format("1d", "v"), "eval_time": "130m", "exp_samples": [
                {"labels": rec.format("1d", "v"), "value": 0.5}]}],
        "alert_rule_test": [
            *({"eval_time": f"{t}m", "alertname": "SlaGuardErrorBudgetBurn", "exp_alerts": []}
              for t in (105, 130, 155)),
            {"eval_time": "170m", "alertname": "SlaGuardErrorBudgetBurn", "exp_alerts": [page]}]})
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_the_long_burn_windows_summed_from_slices_match_the_raw_windows(tmp_path):
    """The 1d and 3d error ratios are sums of the 5-min slices' records (errors and judged requests
    per second), not every raw sample of every engine at each evaluation. Over 8 h with the miss
    share changing (5 %, 20 %, 2 %), the traffic doubling and d1 restarted (counters from 0) at
    300m, they stay within 0.2 point of the raw windows (``share_at_or_below`` over 1d and 3d, as
    the rules computed them before), each time they are read."""
    lab = 'model="m",pool="decode",engine="0",job="vllm",instance="{}"'
    name = c.REQUEST_TTFT.series
    minutes = 480

    def counts(per_min, miss, restart=None):
        total, good, out_t, out_g = 0.0, 0.0, [], []
        for t in range(minutes + 1):
            if t == restart:
                total = good = 0.0
            out_t.append(f"{total:g}")
            out_g.append(f"{good:g}")
            total += per_min(t)
            good += per_min(t) * (1 - miss(t))
        return " ".join(out_t), " ".join(out_g)

    d0 = counts(lambda t: 60 if t < 240 else 120, lambda t: 0.05 if t < 180 else 0.2 if t < 300 else 0.02)
    d1 = counts(lambda t: 30, lambda t: 0.1, restart=300)
    series = []
    for inst, (total, good) in (("d0", d0), ("d1", d1)):
        series += [{"series": f"{name('_count')}{{{lab.format(inst)}}}", "values": total},
                   {"series": f'{name("_bucket")}{{{lab.format(inst)},le="+Inf"}}', "values": total},
                   {"series": f'{name("_bucket")}{{{lab.format(inst)},le="2.5"}}', "values": good}]
    rec = 'model_pool_slo:sli_error:ratio_rate{}{{model="m",pool="decode",slo="ttft_attainment",slo_set="*/*"}}'
    tests = []
    for w in ("1d", "3d"):
        raw = pq.share_at_or_below(c.REQUEST_TTFT, 2.5, w, ("model", "pool"), ['pool="decode"'])
        expr = f"abs({rec.format(w)} - on (model, pool) (1 - ({raw}))) < bool 0.002"
        tests += [{"expr": expr, "eval_time": f"{t}m", "exp_samples": [{"labels": '{model="m",pool="decode"}',
                                                                         "value": 1}]}
                  for t in (120, 240, 360, 480)]
    r = _promtool_test(tmp_path, {"slo.yaml": render_rules()["slo.yaml"]}, series, {"promql_expr_test": tests})
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_data_stale_is_quiet_while_the_guard_judges_the_client_scope(tmp_path):
    """SlaGuardDataStale for the default '*' pool joins engine and client request counts with
    ``or``; unparenthesised, ``>= 20`` bound only the client half and ``and`` bound tighter than
    ``or``, so the client half fired on its own: every deployment with a router warned after 15 min
    that the guard read the client scope as unknown while it read it ok (its summary had no
    ``slo``). The guard's unknown status is now required for every pool, and 20 requests too."""
    g = 'job="sla-guard",instance="g:8080",model="m"'
    status = c.GUARD_SLO_STATUS.series()
    series = [
        {"series": f'{c.CLIENT_TTFT.series("_count")}{{model="m",pool="client",instance="px",job="proxy"}}',
         "values": "0+60x40"},
        {"series": f'{status}{{{g},pool="client",slo="ttft_mean",status="unknown"}}', "values": "0x40"},
        {"series": f'{c.REQUEST_TTFT.series("_count")}{{model="m",pool="decode",engine="0",instance="d0",job="v"}}',
         "values": "0+1x40"},
        {"series": f'{status}{{{g},pool="decode",slo="ttft_mean",status="unknown"}}', "values": "1x40"}]
    r = _promtool_test(tmp_path, {"slo.yaml": render_rules()["slo.yaml"]}, series, {
        "alert_rule_test": [{"eval_time": "30m", "alertname": "SlaGuardDataStale", "exp_alerts": []}]})
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_client_slo_reads_a_router_bucket_spelled_the_go_way(tmp_path):
    """llm-d's endpoint picker (a Go client) writes le="2", prometheus_client le="2.0"; Prometheus
    2.x keeps ``le`` as scraped. A client-scope TTFT attainment SLO at 2 s matched only "2.0": it
    recorded nothing and never alerted while 10 % of requests missed it (burn 10x, page at 3.36x).
    The rules now match every spelling, through the router recording rules as deployed."""
    config = parse_config({"slos": [{"pool": "client", "objectives": [
        {"name": "ttft_att", "indicator": "ttft", "objective": "attainment", "threshold_s": 2, "target": 0.99,
         "period": "7d"}]}]})
    files = render_rules(config)
    lab = ('model_name="llama",target_model_name="llama",fairness_id="f",priority="0",streaming="true",'
           'instance="epp0",job="epp"')
    series = [{"series": f'llm_d_epp_request_ttft_seconds_bucket{{{lab},le="{le}"}}', "values": f"0+{n}x120"}
              for le, n in (("1", 50), ("2", 90), ("3", 100), ("+Inf", 100))]
    series += [{"series": f"llm_d_epp_request_ttft_seconds_{part}{{{lab}}}", "values": v}
               for part, v in (("count", "0+100x120"), ("sum", "0+150x120"))]
    ratio = "model_pool_slo:sli_error:ratio_rate1h"
    r = _promtool_test(tmp_path, {"routers.yaml": files["routers.yaml"], "slo.yaml": files["slo.yaml"]}, series, {
        "promql_expr_test": [
            {"expr": f"round({ratio}, 0.001)", "eval_time": "90m", "exp_samples": [
                {"labels": '{model="llama",pool="client",slo="ttft_att",slo_set="*/client"}', "value": 0.1}]},
            {"expr": 'count by (severity) (ALERTS{alertname="SlaGuardErrorBudgetBurn",alertstate="firing"})',
             "eval_time": "90m", "exp_samples": [{"labels": '{severity="critical"}', "value": 2},
                                                 {"labels": '{severity="warning"}', "value": 2}]}]})
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_generate_accepts_a_threshold_declared_in_engine_buckets(tmp_path, capsys):
    """The guard accepts an attainment threshold the config declares in engine_buckets (its own
    error says to declare it there); `generate --config` refused the same file ("add it to the
    contract buckets", i.e. edit the source) and no rules could be made for it."""
    cfg = tmp_path / "guard.yaml"
    cfg.write_text("source: {targets: [{url: 'http://127.0.0.1:9/metrics', model: m, pool: decode, name: d0}]}\n"
                   "engine_buckets: {ttft: [1.2]}\n"
                   "slos:\n- pool: decode\n  objectives:\n"
                   "  - {name: ttft_fast, indicator: ttft, objective: attainment, threshold_s: 1.2, target: 0.99}\n")
    out = tmp_path / "r"
    assert cli(["generate", "--config", str(cfg), "--rules-dir", str(out),
                "--dashboards-dir", str(tmp_path / "d")]) == 0, capsys.readouterr().err
    assert 'le="1.2"' in (out / "slo.yaml").read_text()
    r = subprocess.run(["promtool", "check", "rules", "--lint=all", "--lint-fatal",
                        *map(str, sorted(out.glob("*.yaml")))], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    cfg.write_text(cfg.read_text().replace("engine_buckets: {ttft: [1.2]}\n", ""))
    assert cli(["generate", "--config", str(cfg), "--check"]) == 2
    assert "engine_buckets: {ttft: [1.2]}" in capsys.readouterr().err


@needs_promtool
def test_fractional_slo_windows_generate_rules_prometheus_loads(tmp_path):
    """The guard accepts window '1.5h'; the rules recorded ``...:mean1.5h`` (no metric name) and
    ranged over ``[1.5h]`` (no PromQL duration), so Prometheus refused the whole slo.yaml and no
    SLO alert was loaded; the P/D overview's mean stat was a parse error too. Windows are now
    spelled '90m': promtool lints the files, the alert fires, and the stat's query evaluates."""
    cfg = tmp_path / "guard.yaml"
    cfg.write_text("source: {targets: [{url: 'http://127.0.0.1:9/metrics', model: m, pool: decode, name: d0}]}\n"
                   "slos:\n- objectives:\n"
                   "  - {name: ttft_mean, indicator: ttft, objective: mean, threshold_s: 2.5, window: 1.5h}\n"
                   "  - {name: ttft_p90, indicator: ttft, objective: percentile, percentile: 0.9, threshold_s: 5,"
                   " window: 2.5m}\n")
    rules, boards = tmp_path / "r", tmp_path / "d"
    assert cli(["generate", "--config", str(cfg), "--rules-dir", str(rules), "--dashboards-dir", str(boards)]) == 0
    r = subprocess.run(["promtool", "check", "rules", "--lint=all", "--lint-fatal",
                        *map(str, sorted(rules.glob("*.yaml")))], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    board = yaml.safe_load((boards / "sla-guard-pd-overview.json").read_text())
    stat = next(p for p in board["panels"] if p["title"].startswith("Mean TTFT"))["targets"][0]["expr"]
    lab = 'model="m",pool="decode",engine="0",instance="d0",job="vllm"'
    series = [{"series": f"{c.REQUEST_TTFT.series(part)}{{{lab}}}", "values": v}
              for part, v in (("_count", "0+60x120"), ("_sum", "0+180x120"))]
    r = _promtool_test(tmp_path, {"slo.yaml": (rules / "slo.yaml").read_text()}, series, {
        "promql_expr_test": [{"expr": re.sub(r'=~"\$\w+"', '=~".*"', stat), "eval_time": "100m",
                              "exp_samples": [{"labels": '{pool="decode"}', "value": 3}]},
                             {"expr": 'count(ALERTS{alertname="SlaGuardTTFTMeanHigh",alertstate="firing"})',
                              "eval_time": "100m", "exp_samples": [{"labels": "{}", "value": 1}]}]})
    assert r.returncode == 0, r.stdout + r.stderr


AVAILABILITY = GuardConfig(slos=[SLOSet(), SLOSet(pool="client", objectives=[SLO(
    name="availability", indicator="availability", objective="attainment", target=0.999)])])


@needs_promtool
@pytest.mark.parametrize(("errors", "ratio_value", "pages"), [("0+10000x200", 0.5, 4), ("0+10x200", 0.0005, 0)])
def test_availability_burns_its_budget_on_failed_requests_and_not_on_the_clients_own(tmp_path, errors, ratio_value,
                                                                                     pages):
    """A 99.9 % availability objective of the client scope, through promtool: the proxy fails half its
    requests (outcome=error, streamed or not): error ratio 0.5, all four burn rows fire. It fails 0.05 %
    (burn 0.5): nothing fires, though as many requests again were the clients' own 4xx and aborted ones, which
    count in neither part of the ratio."""
    lab = 'model="m",pool="client",route="pd",router="px",job="proxy",instance="px0"'
    ok = "0+10000x200" if ratio_value == 0.5 else "0+19990x200"
    series = [{"series": f'{c.CLIENT_REQUESTS.series()}{{{lab},outcome="{o}"}}', "values": v}
              for o, v in (("ok", ok), ("error", errors), ("client_error", "0+10000x200"),
                           ("aborted", "0+10000x200"))]
    ratio = "model_pool_slo:sli_error:ratio_rate1h"
    page = 'ALERTS{alertname="SlaGuardErrorBudgetBurn",alertstate="firing",slo="availability"}'
    r = _promtool_test(tmp_path, {"slo.yaml": render_rules(AVAILABILITY)["slo.yaml"]}, series, {
        "promql_expr_test": [
            {"expr": f'round({ratio}{{slo="availability"}} * 1e4, 0.01)', "eval_time": "150m", "exp_samples": [
                {"labels": '{model="m",pool="client",slo="availability",slo_set="*/client"}',
                 "value": ratio_value * 1e4}]},
            {"expr": f"count({page})", "eval_time": "150m", "exp_samples": [{"value": pages}] if pages else []}]})
    assert r.returncode == 0, r.stdout + r.stderr


def test_availability_rules_read_the_outcome_counter_and_say_what_failed():
    rules = render_rules(AVAILABILITY)["slo.yaml"]
    burn = next(r for r in alert_rules({"slo.yaml": rules}) if r["labels"].get("slo") == "availability"
                and r["alert"] == "SlaGuardErrorBudgetBurn")
    assert "> 0.0144\n" in burn["expr"]  # 14.4 x the 0.1 % budget (30 days, 1h & 5m)
    assert "requests failed (outcome=error)" in burn["annotations"]["description"]
    assert 'outcome=~"error|ok"' in rules and "client_error" not in rules
