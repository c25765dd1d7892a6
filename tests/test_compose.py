"""docker-compose.yml, validated without a Docker engine: the compose-spec JSON schema (vendored
offline by check-jsonschema), `docker compose config` when a compose client exists, every file it
references present, and the configs it mounts consistent with each other (promtool, amtool, the
guard's own config loader). The P/D proxy (``sla-guard-proxy``, with the service's own command
line) is exercised over real loopback HTTP against two stand-in engines that check vLLM's NIXL P/D
request protocol (real NixlConnector needs CUDA)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from alerts.generate import RULES_DIR
from alerts.params import RuleParams
from dashboards.generate import JSON_DIR
from pd_proxy import ProxyConfig, ProxyThread, cli
from sla_guard.config import PrometheusSource, load_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOC = yaml.safe_load(COMPOSE.read_text())
SERVICES = DOC["services"]
IN_IMAGE = "/opt/sla-guard/"  # WORKDIR of deploy/compose/sla-guard/Dockerfile (a copy of the repo)


def mounts(service: str) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts."""
    out = {}
    for v in SERVICES[service].get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith("./"):
            out[dst] = ROOT / src[2:]
    return out


def host_path(service: str, container_path: str) -> Path:
    for dst, src in sorted(mounts(service).items(), key=lambda kv: -len(kv[0])):
        if container_path == dst or container_path.startswith(dst.rstrip("/") + "/"):
            return src / container_path[len(dst):].lstrip("/")
    raise AssertionError(f"{service}: {container_path} is not mounted from the repository")


def test_profiles_and_services():
    by_profile: dict[str, set[str]] = {}
    for name, s in SERVICES.items():
        for p in s.get("profiles", ["(always)"]):
            by_profile.setdefault(p, set()).add(name)
    assert by_profile["(always)"] == {"prometheus", "alertmanager", "grafana", "sla-guard"}
    assert by_profile["twin"] == {"twin"}
    assert by_profile["vllm"] == {"vllm-prefill", "vllm-decode", "pd-proxy", "dcgm-exporter"}
    for name in ("vllm-prefill", "vllm-decode"):
        s = SERVICES[name]
        assert "NixlConnector" in " ".join(s["command"])
        assert s["environment"]["SLA_GUARD_POOL"] == name.split("-")[1]
        assert s["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_compose_spec_schema():
    exe = Path(sys.executable).parent / "check-jsonschema"
    if not exe.exists():
        pytest.skip("check-jsonschema not installed (dev extra)")
    r = subprocess.run([str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_schema_check_can_fail(tmp_path):
    exe = Path(sys.executable).parent / "check-jsonschema"
    if not exe.exists():
        pytest.skip("check-jsonschema not installed (dev extra)")
    bad = tmp_path / "docker-compose.yml"
    broken = COMPOSE.read_text().replace("    restart: unless-stopped\n", "    restart: never\n    replicaz: 2\n", 1)
    bad.write_text(broken)
    r = subprocess.run([str(exe), "--builtin-schema", "vendor.compose-spec", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0


def test_docker_compose_config_when_a_client_exists():
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` client here; the schema test covers the file")
    for profile in ("twin", "vllm"):
        r = subprocess.run([docker, "compose", "--profile", profile, "config", "--quiet"], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "SLA_GUARD_TOKEN": "test"})
        assert r.returncode == 0, r.stderr


def test_every_referenced_file_exists():
    referenced: list[Path] = []
    for name, s in SERVICES.items():
        referenced += mounts(name).values()
        build = s.get("build")
        if build:
            ctx = ROOT / build["context"]
            dockerfile = ctx / build["dockerfile"]
            referenced += [ctx, dockerfile]
            for line in dockerfile.read_text().splitlines():
                m = re.match(r"COPY\s+(.+)\s+\S+$", line)
                if m:
                    referenced += [ctx / src for src in m.group(1).split()]
        for arg in [*s.get("entrypoint", []), *s.get("command", [])]:
            if isinstance(arg, str) and arg.startswith(IN_IMAGE):
                referenced.append(ROOT / arg[len(IN_IMAGE):])
    missing = [str(p.relative_to(ROOT)) for p in referenced if not p.exists()]
    assert referenced and missing == []


def test_prometheus_config_matches_the_stack():
    cfg_path = host_path("prometheus", "/etc/prometheus/prometheus.yml")
    cfg = yaml.safe_load(cfg_path.read_text())
    rules = [host_path("prometheus", g) for g in cfg["rule_files"]]
    found = {p.name for g in rules for p in g.parent.glob(g.name)}
    assert found == {p.name for p in RULES_DIR.glob("*.yaml")} and found
    am = cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["alertmanager:9093"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert RuleParams().guard_job in jobs
    assert jobs[RuleParams().guard_job]["static_configs"][0]["targets"] == ["sla-guard:8080"]
    for job in jobs.values():
        for sd in job.get("dns_sd_configs", []):
            assert set(sd["names"]) <= set(SERVICES), sd
    twin = SERVICES["twin"]["command"]
    replicas = int(twin[twin.index("--prefill") + 1]) + int(twin[twin.index("--decode") + 1])
    assert len(jobs["twin"]["dns_sd_configs"]) == replicas + 1  # and the simulated P/D proxy (client scope)
    if shutil.which("promtool"):
        r = subprocess.run(["promtool", "check", "config", "--syntax-only", str(cfg_path)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_provisioning_points_at_generated_dashboards():
    prov = host_path("grafana", "/etc/grafana/provisioning")
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]
    provider = yaml.safe_load((prov / "dashboards" / "sla-guard.yml").read_text())["providers"][0]
    assert host_path("grafana", provider["options"]["path"]) == JSON_DIR
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path("grafana", home).exists()


def test_guard_and_alertmanager_configs(monkeypatch):
    monkeypatch.setenv("SLA_GUARD_TOKEN", "x")
    cfg = load_config(host_path("sla-guard", "/etc/sla-guard/guard.yaml"))
    assert isinstance(cfg.source, PrometheusSource) and cfg.source.url == "http://prometheus:9090"
    assert cfg.alertmanager.url == "http://alertmanager:9093"
    assert cfg.api.listen.endswith(":8080")
    assert "SLA_GUARD_TOKEN" in SERVICES["sla-guard"]["environment"]
    if shutil.which("amtool"):
        am = host_path("alertmanager", "/etc/alertmanager/alertmanager.yml")
        r = subprocess.run(["amtool", "check-config", str(am)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


# --- the P/D proxy over real loopback HTTP ---------------------------------------------------------

class StandInEngine:
    """Records requests; answers as vLLM would: prefill returns kv_transfer_params, decode text."""

    def __init__(self, role: str) -> None:
        self.requests: list[dict] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append(body)
                if role == "prefill":
                    out = {"choices": [{"text": "x"}], "kv_transfer_params": {
                        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
                        "remote_block_ids": [1, 2], "remote_host": "10.0.0.1", "remote_port": 5600}}
                    data, ctype = json.dumps(out).encode(), "application/json"
                elif body.get("stream"):
                    data = b'data: {"choices":[{"index":0,"text":"hi","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
                    ctype = "text/event-stream"
                else:
                    data, ctype = json.dumps({"choices": [{"text": "hello world"}]}).encode(), "application/json"
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def proxy():
    """The compose service's own command line, parsed by the console script's parser, with the
    engine URLs pointed at the stand-ins."""
    args = cli.parser().parse_args(SERVICES["pd-proxy"]["command"])
    p, d = StandInEngine("prefill"), StandInEngine("decode")
    config = ProxyConfig(prefill=(p.url,), decode=(d.url,), policy=args.policy, router=args.router)
    with ProxyThread(config) as server:
        yield server.url, p, d
    for e in (p, d):
        e.httpd.shutdown()
        e.httpd.server_close()


def test_pd_proxy_service_runs_the_console_script():
    s = SERVICES["pd-proxy"]
    assert s["entrypoint"] == ["sla-guard-proxy"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["sla-guard-proxy"] == "pd_proxy.cli:main"
    dockerfile = ROOT / s["build"]["context"] / s["build"]["dockerfile"]
    assert "COPY pd_proxy pd_proxy" in dockerfile.read_text().splitlines()
    args = cli.parser().parse_args(s["command"])
    assert args.listen == ("0.0.0.0", 8000) and "8000:8000" in s["ports"]
    assert args.prefill == ["http://vllm-prefill:8000"] and args.decode == ["http://vllm-decode:8000"]
    assert set(s["depends_on"]) == {"vllm-prefill", "vllm-decode"}


def test_pd_proxy_follows_the_nixl_protocol(proxy):
    url, p, d = proxy
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 50}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello world"
    assert p.requests[0]["max_tokens"] == 1 and p.requests[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert d.requests[0]["max_tokens"] == 50 and d.requests[0]["kv_transfer_params"]["remote_engine_id"] == "p0"
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=10,
                      json={"model": "m", "messages": [], "max_completion_tokens": 9, "stream": True}) as s:
        text = "".join(s.iter_text())
    assert "[DONE]" in text and '"hi"' in text and "error" not in text
    assert p.requests[1]["stream"] is False and p.requests[1]["max_completion_tokens"] == 1
    assert d.requests[1]["stream"] is True and d.requests[1]["kv_transfer_params"]["remote_block_ids"] == [1, 2]
    # the client scope on the proxy's /metrics, as Prometheus in the stack scrapes it
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert 'slaguard_client_requests_total{model="m",outcome="ok",pool="client",route="pd",router="pd-proxy"} 2.0' \
        in metrics


def test_pd_proxy_healthcheck_is_readiness_and_fails_while_no_decode_engine_is_reachable(proxy):
    """The healthcheck GOT /health, 200 whatever the engines: `docker compose ps` showed the proxy healthy while every
    request failed. It asks /readyz: the service's own check command, run against the real proxy, passes while both
    pools have an engine in service and fails while the decode engine is unreachable; /health stays 200 (liveness)."""
    test = SERVICES["pd-proxy"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and "http://127.0.0.1:8000/readyz" in test[3]

    def check(base: str) -> int:
        return subprocess.run([sys.executable, "-c", test[3].replace("http://127.0.0.1:8000", base)],
                              capture_output=True, timeout=30).returncode

    url, _, _ = proxy
    deadline = time.monotonic() + 30
    while check(url) != 0:  # once the first /health probes are in (unknown before: not ready)
        assert time.monotonic() < deadline, httpx.get(f"{url}/readyz", timeout=5).text
        time.sleep(0.1)
    p = StandInEngine("prefill")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    config = ProxyConfig(prefill=(p.url,), decode=(dead,), router="pd-proxy", health_interval_s=0.1)
    try:
        with ProxyThread(config) as server:
            while "held" not in (why := httpx.get(f"{server.url}/readyz", timeout=5).json()["decode"][dead]["why"]):
                assert time.monotonic() < deadline, why  # its /health refused: held out
                time.sleep(0.1)
            assert check(server.url) != 0
            r = httpx.get(f"{server.url}/readyz", timeout=5)
            assert r.status_code == 503 and r.json()["reason"] == "no decode engine in service"
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        p.httpd.shutdown()
        p.httpd.server_close()
