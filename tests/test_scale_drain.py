"""Safe scale-down (issue 15): the advisor reports how long a replica needs to drain, and the
Kubernetes actuator refuses a scale-down whose pods would be killed before that; the manifests
carry the preStop drain."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from sla_guard.scale.actuators import ActuationError, KubernetesActuator
from sla_guard.settings.advisor import KubernetesTarget

REPO = Path(__file__).resolve().parent.parent


class _Apps:
    def __init__(self, replicas: int, grace: int | None) -> None:
        self.replicas, self.grace, self.patched = replicas, grace, []

    def read_namespaced_deployment_scale(self, name, ns, **_):
        return SimpleNamespace(metadata=SimpleNamespace(resource_version=None),
                               spec=SimpleNamespace(replicas=self.replicas))

    def read_namespaced_deployment(self, name, ns, **_):
        return SimpleNamespace(spec=SimpleNamespace(template=SimpleNamespace(
            spec=SimpleNamespace(termination_grace_period_seconds=self.grace))))

    def patch_namespaced_deployment_scale(self, name, ns, body, **_):
        self.patched.append(body["spec"]["replicas"])
        self.replicas = body["spec"]["replicas"]
        return self.read_namespaced_deployment_scale(name, ns)  # the API server answers the stored Scale


class _NoHPAs:
    def list_namespaced_horizontal_pod_autoscaler(self, ns, **_):
        return SimpleNamespace(items=[])


def _actuator(apps: _Apps) -> KubernetesActuator:
    from kubernetes import client

    act = KubernetesActuator({"prefill": KubernetesTarget(kind="Deployment", name="glm-prefill", namespace="llm")},
                             api_client=client.ApiClient())
    act.apps, act.autoscaling = apps, _NoHPAs()  # no cluster: the API objects are stubs
    return act


def test_scale_down_refused_when_the_grace_period_cannot_drain_the_longest_request():
    apps = _Apps(replicas=4, grace=30)  # Kubernetes' default grace
    act = _actuator(apps)
    act.drain_grace_s["prefill"] = 240.0  # longest request 120 s x 1.5 + 60 s
    with pytest.raises(ActuationError, match="terminationGracePeriodSeconds 30 s < drain time 240 s"):
        act.set_replicas("m", "prefill", 3, "k")
    assert apps.patched == []
    act.set_replicas("m", "prefill", 6, "k")  # a scale-up is never refused
    apps.grace = 900
    act.set_replicas("m", "prefill", 3, "k")  # enough grace: the drain path can finish
    assert apps.patched == [6, 3]


def test_advisor_reports_the_drain_time_from_the_longest_request():
    from sla_guard.scale.advisor import Advisor

    class View:
        def histogram_quantile(self, q, metric, matchers, window, at, by):
            assert q == 0.999 and metric.endswith("request_e2e_seconds_bucket") and window == 3600.0
            return {(): 100.0 if matchers["pool"] == "decode" else 10.0}

    adv = Advisor(model="*")
    assert adv._drain_grace(View(), "decode", 1000.0) == 210.0  # 100 s x 1.5 + 60 s
    assert adv._drain_grace(View(), "prefill", 1000.0) == 75.0


def test_manifests_carry_the_drain_path():
    docs = [d for d in yaml.safe_load_all((REPO / "deploy/k8s/pd-drain.yaml").read_text()) if d]
    script = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["drain.sh"]
    assert "num_requests_(running|waiting)" in script and "kv_cache_usage_perc" in script
    dep = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    for spec, pool in ((dep, "prefill"), (lws["spec"], "decode")):
        grace = spec["terminationGracePeriodSeconds"]
        cmd = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[1] == pool and int(cmd[2]) < grace  # the hook ends before the kill


def _drain_script(port: int) -> str:
    docs = [d for d in yaml.safe_load_all((REPO / "deploy/k8s/pd-drain.yaml").read_text()) if d]
    script = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["drain.sh"]
    assert "http://127.0.0.1:8000/metrics" in script
    return script.replace("http://127.0.0.1:8000/metrics", f"http://127.0.0.1:{port}/metrics")


class _Engine(ThreadingHTTPServer):
    """A vLLM /metrics stand-in: 3 requests running for ``busy_s``, then idle; its first answer
    is ``first`` ('ok', 'slow': after 3 s, past the script's 2 s curl deadline, or '500')."""

    daemon_threads = True

    def __init__(self, busy_s: float, first: str) -> None:
        self.t0, self.busy_s, self.first, self.calls = time.monotonic(), busy_s, first, 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                srv: _Engine = self.server  # type: ignore[assignment]
                srv.calls += 1
                if srv.calls == 1 and srv.first == "500":
                    self.send_response(500)
                    self.end_headers()
                    return
                if srv.calls == 1 and srv.first == "slow":
                    time.sleep(3)
                n = 3.0 if time.monotonic() - srv.t0 < srv.busy_s else 0.0
                body = (f'vllm:num_requests_running{{model_name="m"}} {n}\n'
                        f'vllm:num_requests_waiting{{model_name="m"}} 0.0\n'
                        f'vllm:kv_cache_usage_perc{{model_name="m"}} {n / 10}\n').encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the script gave up on this answer
                    pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("sh") is None, reason="needs sh and curl")
@pytest.mark.parametrize("first", ["ok", "slow", "500"])
def test_drain_script_waits_for_the_requests_even_when_metrics_stall(tmp_path, first):
    """The preStop drain ended at once (exit 0, the pod then killed with 3 requests running) when
    one /metrics answer took over 2 s or was an HTTP error: only a refused connection means gone."""
    engine = _Engine(busy_s=5.0, first=first)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    script = tmp_path / "drain.sh"
    script.write_text(_drain_script(engine.server_address[1]))
    try:
        t0 = time.monotonic()
        r = subprocess.run(["sh", str(script), "prefill", "30"], capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    finally:
        engine.shutdown()
        engine.server_close()
    assert r.returncode == 0, r.stderr
    assert 4.5 <= took < 15, f"drain ended after {took:.1f} s; the engine was busy for 5 s"


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("sh") is None, reason="needs sh and curl")
def test_drain_script_ends_at_once_when_the_engine_is_gone_and_within_its_budget(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "drain.sh"
    script.write_text(_drain_script(port))
    t0 = time.monotonic()
    assert subprocess.run(["sh", str(script), "decode", "30"], timeout=60).returncode == 0
    assert time.monotonic() - t0 < 3
    engine = _Engine(busy_s=3600.0, first="slow")  # never drains: the budget ends the hook
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    script.write_text(_drain_script(engine.server_address[1]))
    try:
        t0 = time.monotonic()
        assert subprocess.run(["sh", str(script), "decode", "4"], timeout=60).returncode == 0
        assert time.monotonic() - t0 < 8
    finally:
        engine.shutdown()
        engine.server_close()
