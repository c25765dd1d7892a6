"""Generated Grafana dashboards: reproducible, Grafana 11.6 schema, the variables and panels the
issue lists, PromQL built only from contract metrics, every engine-side metric on a dashboard."""

from __future__ import annotations

import json
import re

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
