"""End to end: a real Prometheus and a real Alertmanager (Debian packages) on loopback scrape
engine /metrics endpoints, evaluate the generated rules, and deliver alerts to a webhook receiver
(a real HTTP server in this test).

What runs for real: prometheus, prometheus-alertmanager, the generated rules (through the same
generator as the committed ones, with ``RuleParams(time_scale=1/60)`` so a 1h burn window is 1m, a
5m SLO window 5s and ``for: 2m`` 2s: the alert logic is unchanged, only shorter, which keeps the
test at about a minute), the generated dashboards' PromQL, the example Alertmanager routing
(alerts/alertmanager.yml with its webhook URLs pointed at the test receiver), and the exposition
through ``ContractMetrics``/``EngineRecorder`` -- the code path of the vLLM hooks and the simulator.

The engines are the simulated P/D deployment (sla_guard.sim, 2 prefill + 2 decode replicas, the
default profile with speculative decoding) run in wall-clock time by deploy/compose/twin/live_twin.py
(the compose `twin` profile), each replica on its own loopback /metrics, recording every ENGINE,
KV_TRANSFER and PROCESS family through ``EngineRecorder``. Faults go through the simulator's own
fault hooks (``FaultSchedule.transfer_factor`` / ``transfer_failure_prob``), switched on by the test.

The guard is the real one (`sla-guard serve`, scraping the four engines every second), scraped by
Prometheus as job `sla-guard`. What stands in: the GUARD families the real guard does not publish
yet when the test starts (findings need hours of data, error counters appear on the first error)
are served, with plausible values, by a second loopback target in the same job, so that every
guard panel has data; the test prints which families came from which.

Every panel query of every dashboard, with $model/$pool/$instance resolved through
/api/v1/label/<name>/values and $__rate_interval substituted as Grafana would (4 x scrape
interval), must return data as an instant and as a range query. Then a fault is injected (KV
transfers 400x slower, so decode TTFT rises over the 2.5 s SLA, and half of them failing); the
mean-TTFT SLA alert must reach the pager receiver and the KV-transfer alert the ticket receiver,
and the KV-transfer alert must resolve after the fault ends.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from alerts.generate import render_rules
from alerts.params import RuleParams
from dashboards.common import OPTIONAL_METRICS
from dashboards.generate import render_dashboards
from exporters import contract as c
from exporters.contract import Component
from exporters.prometheus import ContractMetrics
from sla_guard.sim.faults import FaultSchedule

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
SCRAPE_S = 1
RATE_INTERVAL = f"{4 * SCRAPE_S}s"  # Grafana: max($__interval + scrape interval, 4 x scrape interval)
TICK_S = 0.25

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.slow,
    pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER), reason="prometheus/alertmanager missing: "
                       "run scripts/setup.sh --full"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(registry: CollectorRegistry):
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    return httpd, f"127.0.0.1:{httpd.server_port}"


def load_live_twin():
    spec = importlib.util.spec_from_file_location("live_twin", ROOT / "deploy" / "compose" / "twin" / "live_twin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LiveTwin


class SwitchableFaults(FaultSchedule):
    """The simulator's fault schedule with the KV-transfer fault switched by the test, not by time."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def transfer_factor(self, t: float) -> float:
        return 400.0 if self.on else super().transfer_factor(t)

    def transfer_failure_prob(self, t: float, base: float = 0.0) -> float:
        return 0.5 if self.on else super().transfer_failure_prob(t, base)


class GuardStandIn:
    """GUARD families with the values a healthy guard would publish for these engines; only the
    families in ``expose`` are registered (the others come from the real guard)."""

    def __init__(self, model: str, targets: list[str], expose: set[str]) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=False)
        self.m = ContractMetrics(self.registry, (Component.GUARD,))
        for name, family in self.m.families.items():
            if name not in expose:
                self.registry.unregister(family)
        self.targets = targets

    def tick(self) -> None:
        m = self.m
        m[c.GUARD_EVAL_DURATION].observe(0.012)
        m[c.GUARD_SERIES].set(1800)
        m[c.GUARD_STORE_BYTES].set(3.2e6)
        m[c.GUARD_SCRAPE_ERRORS].labels(self.targets[0], "timeout").inc(0)
        m[c.GUARD_EVALUATOR_ERRORS].labels("slo").inc(0)
        m[c.GUARD_ALERT_PUSH_ERRORS].labels("http").inc(0)
        for target, pool in zip(self.targets, ("prefill", "prefill", "decode", "decode"), strict=False):
            m[c.GUARD_TARGET_UP].labels(target, self.model, pool).set(1)
            for slo in ("ttft_mean", "tpot_mean"):
                for status in ("ok", "at_risk", "violated", "unknown"):
                    m[c.GUARD_SLO_STATUS].labels(self.model, pool, slo, status).set(1 if status == "ok" else 0)
                m[c.GUARD_SLO_VALUE].labels(self.model, pool, slo).set(0.5)
                m[c.GUARD_BUDGET_REMAINING].labels(self.model, pool, slo).set(0.97)
                for window in ("1h", "5m"):
                    m[c.GUARD_BURN_RATE].labels(self.model, pool, slo, window).set(0.3)
            m[c.GUARD_GOODPUT].labels(self.model, pool).set(0.995)
            m[c.GUARD_FINDINGS].labels(self.model, pool, "leak", "warning").set(1 if pool == "decode" else 0)
            m[c.GUARD_FINDINGS_TOTAL].labels(self.model, pool, "leak").inc(0)
            m[c.GUARD_LEAK_SLOPE].labels(self.model, pool, "engine-0", "EngineCore_DP0").set(1.3e4)
            m[c.GUARD_DESIRED_REPLICAS].labels(self.model, pool).set(3)
            m[c.GUARD_CURRENT_REPLICAS].labels(self.model, pool).set(2)
            m[c.GUARD_SCALING_DECISIONS].labels(self.model, pool, "up", "ttft").inc(0)
            m[c.GUARD_ACTUATION_ERRORS].labels(self.model, pool, "webhook").inc(0)


class Webhook:
    """Alertmanager webhook receiver: records (path, payload) of every notification."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def alerts(self, receiver: str, name: str, status: str = "firing") -> list[dict]:
        return [a for path, p in list(self.received) if path == f"/{receiver}"
                for a in p["alerts"] if a["labels"]["alertname"] == name and a["status"] == status]


def wait_for(what: str, fn, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def real_guard_families(url: str) -> set[str]:
    """Contract GUARD family names the running guard exposes (with at least one sample)."""
    text = httpx.get(url, timeout=5).text
    return {f.name for f in text_string_to_metric_families(text) if f.samples}


def stop_process(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("promstack")
    procs: list[subprocess.Popen] = []
    logs = []
    closers = []

    def start(name: str, cmd: list[str]) -> None:
        log = (tmp / f"{name}.log").open("w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp))

    faults = SwitchableFaults()
    twin = load_live_twin()(faults=faults, prefill=2, decode=2).start()
    closers.append(twin.stop)
    stop = threading.Event()
    try:
        # the real guard (`sla-guard serve`), scraping the twin's engines every second
        guard_port = free_port()
        pools = twin.pools  # the replicas' pools, then "client" for the simulated P/D proxy
        guard_cfg = {"source": {"mode": "scrape", "interval_s": 1, "targets": [
            {"url": f"http://{t}/metrics", "model": twin.dep.model, "pool": pool}
            for t, pool in zip(twin.targets, pools, strict=True)]},
            "evaluation_interval_s": 1, "api": {"listen": f"127.0.0.1:{guard_port}"},
            "advisor": {"model": twin.dep.model}}
        (tmp / "guard.yaml").write_text(yaml.safe_dump(guard_cfg))
        start("guard", [sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(tmp / "guard.yaml"),
                        "--log-level", "warning"])
        guard_url = f"http://127.0.0.1:{guard_port}"

        def guard_ready():
            assert procs[-1].poll() is None, (tmp / "guard.log").read_text()[-2000:]
            try:
                return httpx.get(f"{guard_url}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for("the guard's first evaluation", guard_ready, 60)
        real = real_guard_families(f"{guard_url}/metrics")
        # families the real guard publishes only after events (findings after hours of data,
        # replica advice, errors): a stand-in serves just those, under the same job
        missing = {m.name for m in c.by_component(Component.GUARD)} - real
        standin = GuardStandIn(twin.dep.model, [f"http://{t}/metrics" for t in twin.targets], missing)
        gserver = serve(standin.registry)
        closers.append(gserver[0].server_close)
        closers.append(gserver[0].shutdown)

        def drive():
            while not stop.is_set():
                standin.tick()
                stop.wait(TICK_S)

        threading.Thread(target=drive, daemon=True).start()
        hook = Webhook()
        closers.append(hook.httpd.server_close)
        closers.append(hook.httpd.shutdown)

        rules = tmp / "rules"
        rules.mkdir()
        for name, text in render_rules(params=RuleParams(time_scale=1 / 60)).items():
            (rules / name).write_text(text)
        am_cfg = yaml.safe_load((ROOT / "alerts" / "alertmanager.yml").read_text())
        for r in am_cfg["receivers"]:
            for w in r.get("webhook_configs", []):
                w["url"] = f"{hook.url}/{r['name']}"
                w["send_resolved"] = True
        am_cfg["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
        for route in am_cfg["route"].get("routes", []):
            route.update(group_wait="1s", group_interval="1s")
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am_cfg))
        am_port, prom_port = free_port(), free_port()
        prom_cfg = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules / "*.yaml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [
                {"job_name": "vllm", "static_configs": [{"targets": twin.targets}]},
                {"job_name": RuleParams().guard_job,
                 "static_configs": [{"targets": [f"127.0.0.1:{guard_port}", gserver[1]]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
        start("alertmanager", [ALERTMANAGER, f"--config.file={tmp / 'alertmanager.yml'}",
                               f"--storage.path={tmp / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                               "--cluster.listen-address=", "--log.level=warn"])
        start("prometheus", [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'prom-data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"])
        prom = httpx.Client(base_url=f"http://127.0.0.1:{prom_port}", timeout=10)
        am = httpx.Client(base_url=f"http://127.0.0.1:{am_port}", timeout=10)

        def ready(client):
            try:
                return client.get("/-/ready").status_code == 200
            except httpx.TransportError:
                return False

        wait_for("alertmanager ready", lambda: ready(am), 30)
        wait_for("prometheus ready", lambda: ready(prom), 30)
        n_targets = len(twin.targets) + 2
        wait_for(f"all {n_targets} targets up", lambda: len(instant(prom, "up == 1")) == n_targets, 40)
        # enough samples for rate() over $__rate_interval on every engine
        wait_for("rates", lambda: len(instant(prom, f"rate({c.REQUEST_TTFT.series('_count')}[{RATE_INTERVAL}]) > 0"))
                 == len(twin.dep.replicas), 30)
        print(f"\nguard families from the real guard: {sorted(real)}\nfrom the stand-in: {sorted(missing)}")
        yield {"prom": prom, "am": am, "faults": faults, "model": twin.dep.model, "hook": hook, "tmp": tmp,
               "guard_instance": f"127.0.0.1:{guard_port}", "real_guard_families": real}
    finally:
        stop.set()
        for p in procs:
            stop_process(p)
        for log in logs:
            log.close()
        for close in reversed(closers):
            close()


def _check(resp: httpx.Response, expr: str) -> dict:
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", f"{expr}: {body.get('error', body)}"
    return body["data"]


def instant(prom: httpx.Client, expr: str) -> list[dict]:
    return _check(prom.get("/api/v1/query", params={"query": expr}), expr)["result"]


def range_query(prom: httpx.Client, expr: str, seconds: int = 20) -> list[dict]:
    end = time.time()
    return _check(prom.get("/api/v1/query_range", params={"query": expr, "start": end - seconds, "end": end,
                                                         "step": SCRAPE_S}), expr)["result"]


def resolve_variables(prom: httpx.Client, board: dict) -> dict[str, str]:
    """Each query variable's values from /api/v1/label/<name>/values, matched by its own selector
    (earlier variables substituted), as Grafana's 'All' would: a regex alternation."""
    values: dict[str, str] = {}
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, var["query"]
        selector = substitute(m.group(1), values)
        got = _check(prom.get(f"/api/v1/label/{m.group(2)}/values", params={"match[]": selector}), selector)
        assert got, f"variable {var['name']}: no values for {selector}"
        # Grafana escapes regex metacharacters and then the backslash for the PromQL string literal
        values[var["name"]] = "|".join(re.escape(v).replace("\\", "\\\\") for v in got)
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    fixed = {"__rate_interval": RATE_INTERVAL, "__interval": f"{SCRAPE_S}s", "__range": "20s"}

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return {**fixed, **values}[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def has_finite(result: list[dict]) -> bool:
    points = [s["value"] for s in result if "value" in s] + [v for s in result for v in s.get("values", [])]
    return any(math.isfinite(float(v)) for _, v in points)


CENSUS_GROWERS = tuple(m.name for m in (c.CENSUS_CONTAINER_LENGTH, c.CENSUS_CONTAINER_GROWTH,
                                        c.CENSUS_CONTAINER_BYTES, c.CENSUS_RSS_EXPLAINED))


def test_every_dashboard_query_returns_data(stack):
    prom = stack["prom"]
    executed, skipped = [], []
    for text in render_dashboards().values():
        board = json.loads(text)
        values = resolve_variables(prom, board)
        targets = [(p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row" for t in p["targets"]]
        targets += [(f"annotation: {a['name']}", a["expr"]) for a in board["annotations"]["list"] if a.get("expr")]
        for title, raw in targets:
            expr = substitute(raw, values)
            assert "$" not in expr, expr
            if any(o in expr for o in (*OPTIONAL_METRICS, *CENSUS_GROWERS)):
                # exporter outside this stack (DCGM), or census growers, which exist only while a
                # container grows (tests/test_census.py): the query must still be valid PromQL
                instant(prom, expr)
                skipped.append((board["uid"], title, expr))
                continue
            got_i, got_r = instant(prom, expr), range_query(prom, expr)
            assert got_i and has_finite(got_i), f"{board['uid']} / {title}: instant query empty: {expr}"
            assert got_r and has_finite(got_r), f"{board['uid']} / {title}: range query empty: {expr}"
            executed.append((board["uid"], title, expr))
    (stack["tmp"] / "executed_queries.json").write_text(json.dumps({"executed": executed, "optional": skipped},
                                                                   indent=1))
    print(f"\n{len(executed)} dashboard queries returned data (instant and range); "
          f"{len(skipped)} optional (DCGM, census growers) queries valid but without data")
    assert len(executed) >= 60


def test_rules_load_and_nothing_fires_while_healthy(stack):
    prom = stack["prom"]
    groups = _check(prom.get("/api/v1/rules"), "rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == sum(t.count("- alert:") + t.count("- record:") for t in render_rules().values())
    assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"][:3]
    # recording rules produce series from the live data
    means = instant(prom, 'model_pool_slo:sli_latency_seconds:mean5m{slo="ttft_mean"}')
    assert {m["metric"]["pool"] for m in means} == {"prefill", "decode", "client"}  # client: the P/D proxy
    assert all(0 < float(m["value"][1]) < 2.5 for m in means), means

    # the real guard is scraped and publishes SLO status for both pools and the client scope
    status = instant(prom, f'{c.GUARD_SLO_STATUS.name}{{instance="{stack["guard_instance"]}"}} == 1')
    assert {s["metric"]["pool"] for s in status} == {"prefill", "decode", "client"}, status
    assert c.GUARD_SLO_STATUS.name in stack["real_guard_families"]

    def quiet():
        alerts = _check(prom.get("/api/v1/alerts"), "alerts")["alerts"]
        return not alerts or None

    # SlaGuardDown may be pending for the seconds before the guard's first scrape; healthy data clears it
    wait_for("no alert pending or firing on healthy data", quiet, 20)


def test_injected_faults_reach_the_webhook_by_severity(stack):
    faults, hook = stack["faults"], stack["hook"]
    assert not hook.alerts("pager", "SlaGuardTTFTMeanHigh") and not hook.alerts("ticket", "SlaGuardKVTransferFailures")
    faults.on = True
    try:
        # the decode pool's alert; the client scope (the simulated proxy) breaches too, as it should
        ttft = wait_for("SlaGuardTTFTMeanHigh (decode) at the pager receiver",
                        lambda: [al for al in hook.alerts("pager", "SlaGuardTTFTMeanHigh")
                                 if al["labels"]["pool"] == "decode"], 60)
        xfer = wait_for("SlaGuardKVTransferFailures at the ticket receiver",
                        lambda: hook.alerts("ticket", "SlaGuardKVTransferFailures"), 60)
        # the TTFT attainment SLO's fast-burn page: 1h and 5m windows (1m and 5s here) both over 14.4x
        burn = wait_for("SlaGuardErrorBudgetBurn (1h/5m) at the pager receiver",
                        lambda: [b for b in hook.alerts("pager", "SlaGuardErrorBudgetBurn")
                                 if b["labels"]["long_window"] == "1h" and b["labels"]["pool"] == "decode"], 60)
        burn = [b for b in hook.alerts("pager", "SlaGuardErrorBudgetBurn") if b["labels"]["long_window"] == "1h"]
    finally:
        faults.on = False
    a = ttft[0]
    want = {"model": stack["model"], "pool": "decode", "slo": "ttft_mean", "severity": "critical"}
    assert a["labels"] | want == a["labels"]
    assert a["annotations"]["runbook_url"].endswith("docs/runbooks.md#slaguardttftmeanhigh")
    assert "breaches the SLA of 2.5s" in a["annotations"]["summary"]
    x = xfer[0]
    assert (x["labels"]["pool"], x["labels"]["kind"], x["labels"]["severity"]) == ("decode", "transfer", "warning")
    assert x["annotations"]["runbook_url"].endswith("#slaguardkvtransferfailures")
    # the prefill pool stayed healthy: nothing about it was delivered
    assert not [al for _, p in hook.received for al in p["alerts"] if al["labels"].get("pool") == "prefill"]
    pages = {(b["labels"]["pool"], b["labels"]["slo"], b["labels"]["severity"]) for b in burn}
    assert ("decode", "ttft_attainment", "critical") in pages
    assert pages <= {("decode", "ttft_attainment", "critical"), ("client", "ttft_attainment", "critical")}, pages
    wait_for("SlaGuardKVTransferFailures resolved", lambda: hook.alerts("ticket", "SlaGuardKVTransferFailures",
                                                                        "resolved"), 60)
