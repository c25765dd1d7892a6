"""Safe scale-down (issue 15): the advisor reports how long a replica needs to drain, and the
Kubernetes actuator refuses a scale-down whose pods would be killed before that; the manifests
carry the preStop drain."""

from __future__ import annotations

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
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas))

    def read_namespaced_deployment(self, name, ns, **_):
        return SimpleNamespace(spec=SimpleNamespace(template=SimpleNamespace(
            spec=SimpleNamespace(termination_grace_period_seconds=self.grace))))

    def patch_namespaced_deployment_scale(self, name, ns, body, **_):
        self.patched.append(body["spec"]["replicas"])
        self.replicas = body["spec"]["replicas"]


def _actuator(apps: _Apps) -> KubernetesActuator:
    act = KubernetesActuator.__new__(KubernetesActuator)  # no cluster: the API objects are stubs
    act.targets = {"prefill": KubernetesTarget(kind="Deployment", name="glm-prefill", namespace="llm")}
    act.apps, act.custom, act.drain_grace_s = apps, None, {}
    act.timeout_s, act.may_send = 5.0, None
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
