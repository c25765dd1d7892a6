"""Generated Grafana dashboards: reproducible, Grafana 11.6 schema, the variables and panels the
issue lists, PromQL built only from contract metrics, every engine-side metric on a dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from alerts.generate import diff
from dashboards.common import OPTIONAL_METRICS
from dashboards.generate import JSON_DIR, render_dashboards
from exporters import contract as c
from sla_guard.config import SLO, GuardConfig, SLOSet

BOARDS = {json.loads(t)["uid"]: json.loads(t) for t in render_dashboards().values()}


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def exprs(board: dict) -> list[str]:
    out = [t["expr"] for p in panels(board) for t in p["targets"]]
    out += [a["expr"] for a in board["annotations"]["list"] if a.get("expr")]
    return out


def test_committed_json_is_regenerated_exactly():
    assert diff(render_dashboards(), JSON_DIR, "*.json") == []


def test_six_dashboards_with_grafana_11_schema_and_variables():
    assert set(BOARDS) == {"sla-guard-pd-overview", "sla-guard-decode", "sla-guard-prefill",
                           "sla-guard-kv-transfer", "sla-guard-host-memory", "sla-guard-guard"}
    for uid, b in BOARDS.items():
        assert b["schemaVersion"] == 41, uid
        names = [v["name"] for v in b["templating"]["list"]]
        assert names == ["datasource", "model", "pool", "instance"], uid
        ids = [p["id"] for p in b["panels"]]
        assert len(ids) == len(set(ids)), f"{uid}: duplicate panel ids"
        for p in panels(b):
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], (uid, p["title"])
            assert p.get("description"), (uid, p["title"])
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}"
                assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
        # grid: panels never overlap
        cells = set()
        for p in b["panels"]:
            g = p["gridPos"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{uid}: {p['title']} overlaps"
            cells |= mine


@pytest.mark.parametrize(("uid", "titles"), [
    ("sla-guard-pd-overview", ["SLO status (guard)", "TTFT per pool", "TPOT per pool", "Input throughput",
                               "Output throughput", "Goodput"]),
    ("sla-guard-decode", ["Inter-token latency", "Running batch", "KV-cache usage and GPU utilization", "Preemptions",
                          "Acceptance rate", "Mean accepted length", "Per-position acceptance"]),
    ("sla-guard-prefill", ["Waiting requests", "TTFT per pool", "Prompt throughput", "Prefix-cache hit rate"]),
    ("sla-guard-kv-transfer", ["Transfer duration", "Bytes per second", "Descriptors per transfer", "Failures",
                               "Requests waiting for remote KV"]),
    ("sla-guard-host-memory", ["RSS per process", "GC frozen objects"]),
    ("sla-guard-guard", ["Open findings", "Desired vs current replicas", "Burn rate", "Error budget left"]),
])
def test_issue_panels_present(uid, titles):
    have = {p["title"] for p in panels(BOARDS[uid])}
    assert set(titles) <= have, set(titles) - have


def test_host_memory_annotates_leak_findings():
    ann = [a for a in BOARDS["sla-guard-host-memory"]["annotations"]["list"] if a.get("expr")]
    assert len(ann) == 1 and c.GUARD_FINDINGS.name in ann[0]["expr"] and "leak" in ann[0]["expr"]


def test_sla_lines_come_from_the_slo_spec():
    def ttft_panel(config):
        board = json.loads(render_dashboards(config)["sla-guard-pd-overview.json"])
        return next(p for p in board["panels"] if p["title"] == "TTFT per pool")

    steps = ttft_panel(GuardConfig())["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, 2.5, 5.0]
    custom = GuardConfig(slos=[SLOSet(objectives=[SLO(name="t", indicator="ttft", objective="mean",
                                                      threshold_s=1.5)])])
    steps = ttft_panel(custom)["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, 1.5]


def test_queries_use_only_contract_metrics():
    names = {m.exposed for m in c.ALL} | {m.series(s) for m in c.ALL if m.kind is c.Kind.HISTOGRAM
                                         for s in ("_bucket", "_sum", "_count")}
    for uid, b in BOARDS.items():
        for e in exprs(b):
            for ident in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*(?=\s*\{|\[)", e):
                assert ident in names or ident in OPTIONAL_METRICS, f"{uid}: {ident} in {e}"


def test_every_engine_side_metric_is_on_a_dashboard():
    used = " ".join(e for b in BOARDS.values() for e in exprs(b))
    # identity/info series and the steps counter are for joins and the guard, not for panels
    not_plotted = {c.ENGINE_INFO, c.PROCESS_INFO, c.ENGINE_STEPS, c.REQUEST_E2E, c.REQUEST_DECODE, c.HOOK_ERRORS}
    wanted = [m for m in c.ALL if m.component is not c.Component.GUARD and m not in not_plotted]
    missing = [m.name for m in wanted if not re.search(rf"\b{m.exposed}(_bucket|_sum|_count)?\b", used)]
    assert missing == []


def test_dashboards_doc_is_regenerated_exactly():
    from dashboards.docs import DOC_PATH, render_doc

    doc = render_doc(render_dashboards())
    assert DOC_PATH.read_text() == doc
    for b in BOARDS.values():
        assert f"## {b['title']}" in doc and all(e in doc for e in exprs(b))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: run scripts/setup.sh --full")
def test_goodput_draws_only_lines_a_bucket_can_answer(tmp_path):
    """A mean SLO's threshold need not be a bucket bound (the guard accepts mean TTFT 1.8 s); the
    Goodput panel still drew "TTFT <= 1.8s" from le="1.8", a series no engine has: a line that was
    never there. Each share line is drawn only for a contract bucket or one in engine_buckets, and
    every line drawn returns data over engines exposing those buckets (promtool's PromQL engine)."""
    def goodput(config: GuardConfig) -> list[dict]:
        board = json.loads(render_dashboards(config)["sla-guard-pd-overview.json"])
        return next(p for p in board["panels"] if p["title"] == "Goodput")["targets"]

    objectives = [SLO(name="ttft_mean", indicator="ttft", objective="mean", threshold_s=1.8),
                  SLO(name="tpot_mean", indicator="tpot", objective="mean", threshold_s=0.018)]
    assert [t["legendFormat"] for t in goodput(GuardConfig(slos=[SLOSet(objectives=objectives)]))] == [
        "{{pool}} goodput (guard)"]
    declared = GuardConfig(slos=[SLOSet(objectives=objectives)], engine_buckets={"ttft": [1.8]})
    shares = [t for t in goodput(declared) if "_bucket" in t["expr"]]
    assert [t["legendFormat"] for t in shares] == ["{{pool}} TTFT <= 1.8s"]
    lab = 'model="m",pool="decode",engine="0",instance="d0",job="vllm"'
    series = [{"series": f'{c.REQUEST_TTFT.series("_bucket")}{{{lab},le="{le}"}}', "values": f"0+{n}x10"}
              for le, n in (("1.8", 50), ("+Inf", 100))]
    series.append({"series": f'{c.REQUEST_TTFT.series("_count")}{{{lab}}}', "values": "0+100x10"})
    tests = [{"expr": re.sub(r"\$__rate_interval", "5m", re.sub(r'=~"\$\w+"', '=~".*"', t["expr"])),
              "eval_time": "10m", "exp_samples": [{"labels": '{pool="decode"}', "value": 0.5}]} for t in shares]
    (tmp_path / "t.yaml").write_text(json.dumps({"evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "promql_expr_test": tests}]}))
    r = subprocess.run(["promtool", "test", "rules", "t.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


AVAILABILITY_YAML = """\
source: {mode: prometheus, url: "http://prometheus:9090"}
slos:
  - pool: client
    objectives:
      - {name: ttft_mean, indicator: ttft, objective: mean, threshold_s: 2.5}
      - {name: availability, indicator: availability, objective: attainment, target: 0.999, period: 30d}
"""


def error_ratio_panel(board: dict) -> dict:
    return next(p for p in board["panels"] if p["title"] == "Client error ratio")


def test_client_error_ratio_is_the_rules_sli_with_the_objectives_line_only_where_one_is_configured():
    """The availability SLI had no panel. *Client error ratio* is drawn always (no objective in the
    default spec: no line) with the rules' one definition (``exporters.promql.outcome_ratio``), and
    with a dashed line at 1 - target for each availability objective of the spec."""
    from dashboards.common import RATE
    from dashboards.pd_overview import CLIENT_SEL
    from exporters import promql as pq

    p = error_ratio_panel(BOARDS["sla-guard-pd-overview"])
    assert [t["expr"] for t in p["targets"]] == [pq.outcome_ratio(
        c.CLIENT_REQUESTS, "outcome", c.AVAILABILITY_FAILED, c.AVAILABILITY_COUNTED, RATE, ["model"], CLIENT_SEL)]
    assert "thresholds" not in p["fieldConfig"]["defaults"]
    two = GuardConfig(slos=[SLOSet(pool="client", objectives=[SLO(
        name="availability", indicator="availability", objective="attainment", target=0.999)]),
        SLOSet(model="big", pool="client", objectives=[SLO(
            name="availability", indicator="availability", objective="attainment", target=0.99)])])
    p = error_ratio_panel(json.loads(render_dashboards(two)["sla-guard-pd-overview.json"]))
    assert [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [None, 0.001, 0.01]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: run scripts/setup.sh --full")
def test_generate_from_a_config_with_an_availability_objective(tmp_path):
    """`sla-guard validate-config` and `sla-guard generate --config` with an availability objective, as an
    operator runs them: the rules pass ``promtool check rules --lint=all --lint-fatal`` and burn its budget,
    and the P/D overview draws its error ratio with the objective's line (1 - 0.999)."""
    from sla_guard.cli import main as cli

    cfg = tmp_path / "guard.yaml"
    cfg.write_text(AVAILABILITY_YAML)
    assert cli(["validate-config", str(cfg)]) == 0
    args = ["generate", "--config", str(cfg), "--rules-dir", str(tmp_path / "r"),
            "--dashboards-dir", str(tmp_path / "d")]
    assert cli(args) == 0 and cli([*args, "--check"]) == 0
    rules = sorted((tmp_path / "r").glob("*.yaml"))
    r = subprocess.run(["promtool", "check", "rules", "--lint=all", "--lint-fatal", *map(str, rules)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "lint error" not in r.stdout + r.stderr, r.stdout + r.stderr
    slo = (tmp_path / "r" / "slo.yaml").read_text()
    assert 'slo: availability' in slo and "requests failed (outcome=error)" in slo
    board = json.loads((tmp_path / "d" / "sla-guard-pd-overview.json").read_text())
    p = error_ratio_panel(board)
    defaults = p["fieldConfig"]["defaults"]
    assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None, 0.001]
    assert defaults["custom"]["thresholdsStyle"] == {"mode": "dashed"} and defaults["unit"] == "percentunit"
    assert c.CLIENT_REQUESTS.series() in p["targets"][0]["expr"]
