"""Actuators: one narrow interface, ``set_replicas(model, pool, replicas, key)``.

The advisor never knows what it talks to (Dynamo's planner keeps the same seam between its core
and its connectors). ``WebhookActuator`` POSTs the decision to any controller that wants it,
retrying transient failures with exponential backoff under one idempotency key, so a retried
POST cannot scale twice. ``KubernetesActuator`` patches the scale subresource of a Deployment or
a LeaderWorkerSet through the official ``kubernetes`` client (what an HPA or KEDA would do).
A failure raises ``ActuationError``; the evaluator counts it and carries on.

``LeaderGatedActuator`` wraps either for high availability: two guards run side by side and only
the elected leader (``sla_guard.leader``) reaches the inner actuator; the standby raises
``StandbyError`` (an ``ActuationError`` saying who holds the leadership) instead. Just before
each request (each webhook attempt, the scale patch) the leadership is confirmed with the
elector (``Elector.confirm``: the Lease renewed then and there), not taken from memory.

The Kubernetes actuator also looks around its targets: every ``hpa_check_s`` it lists the
HorizontalPodAutoscalers of their namespaces and refuses to patch a target one of them scales
(the two would fight), and while ordered replicas are missing it counts the target's pods the
scheduler could not place (``unschedulable``), which the advisor then stops counting as starting.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from exporters.redact import redact_text, redact_url
from sla_guard.defaults import KUBERNETES_CALL_TIMEOUT_S
from sla_guard.outbound import call_within, kube_api_client, post_json
from sla_guard.settings.advisor import KubernetesTarget, Webhook

if TYPE_CHECKING:
    from sla_guard.leader import Elector

log = logging.getLogger(__name__)

IDEMPOTENCY_HEADER = "Idempotency-Key"
LWS_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
# LeaderWorkerSet pod labels: the scale selector (status.hpaPodSelector) names the leaders only
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
KEDA_SCALEDOBJECT_LABEL = "scaledobject.keda.sh/name"  # on the HPA a KEDA ScaledObject creates
HPA_CHECK_S = 300.0  # how often the targets' namespaces are searched for an HPA on them
HPA_RETRY_S = 15.0  # after a list that failed (not a 403): asked again after 15, 30, 60 ... s, at most HPA_CHECK_S


class ActuationError(RuntimeError):
    """The target could not be set; the message says which and why."""


class CappedError(ActuationError):
    """The patch went through but the API server answered another size than asked (an admission
    webhook or policy changed it); ``applied`` is the size the target now holds."""

    def __init__(self, message: str, applied: int) -> None:
        super().__init__(message)
        self.applied = applied


class StandbyError(ActuationError):
    """This guard is not the leader, so it did not actuate (not a failure of the target)."""


class Actuator(Protocol):
    name: str

    def set_replicas(self, model: str, pool: str, replicas: int, key: str) -> None: ...


def idempotency_key(model: str, pool: str, replicas: int, decided_at: float) -> str:
    """Stable for one decision (so every retry of it carries the same key), new for the next."""
    raw = f"{model}|{pool}|{replicas}|{decided_at:.3f}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


class WebhookActuator:
    """POST ``{"model", "pool", "replicas", "idempotency_key", "reasons"}`` to a URL.

    Retries connection errors, timeouts, 429 and 5xx with exponential backoff (``backoff_s`` x 2^n);
    other 4xx are the receiver refusing the request and are not retried."""

    name = "webhook"

    def __init__(self, cfg: Webhook, token: str | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.cfg = cfg
        self._sleep = sleep
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.attempts = 0
        # set by LeaderGatedActuator: called with the attempt's deadline before every attempt, so
        # a leader deposed during the backoff of a retry does not send it
        self.may_send: Callable[[float], bool] | None = None

    def set_replicas(self, model: str, pool: str, replicas: int, key: str,
                     extra: Mapping[str, object] | None = None) -> None:
        body = {"model": model, "pool": pool, "replicas": int(replicas), "idempotency_key": key, **(extra or {})}
        headers = {**self._headers, IDEMPOTENCY_HEADER: key}
        last = "no attempt"
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self._sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            if self.may_send is not None and not self.may_send(self.cfg.timeout_s):
                raise StandbyError(f"standby: lost the leadership before attempt {attempt + 1} of {pool}={replicas}")
            self.attempts += 1
            try:  # the whole request within timeout_s: a trickling receiver cannot hold the tick
                resp = post_json(self.cfg.url, body, timeout_s=self.cfg.timeout_s, headers=headers)
            except TimeoutError:
                last = f"no complete answer within {self.cfg.timeout_s:g}s"
                continue
            except httpx.HTTPError as err:
                last = redact_text(f"{type(err).__name__}: {err}")  # httpx's messages can quote the URL
                continue
            if resp.status_code < 300:
                return
            last = f"HTTP {resp.status_code}"
            if resp.status_code < 500 and resp.status_code != 429:
                break
        raise ActuationError(f"webhook {redact_url(self.cfg.url)} did not accept {pool}={replicas}: {last}")

    def close(self) -> None:
        """Nothing held between calls: each request opens (and closes) its own connection."""


class KubernetesActuator:
    """Patch ``spec.replicas`` through the scale subresource of the pool's Deployment or LeaderWorkerSet."""

    name = "kubernetes"

    def __init__(self, targets: Mapping[str, KubernetesTarget], api_client=None, kubeconfig: str | None = None,
                 timeout_s: float = KUBERNETES_CALL_TIMEOUT_S) -> None:
        from kubernetes import client  # optional extra: sla-guard[kubernetes]

        if api_client is None:
            api_client = kube_api_client(kubeconfig)
        self.targets = dict(targets)
        self.timeout_s = timeout_s  # each API call, whole (a hung API server must not hold the tick)
        # set by LeaderGatedActuator: called with the patch's deadline just before the patch, so a
        # leader deposed while the reads before it were slow does not send it
        self.may_send: Callable[[float], bool] | None = None
        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.autoscaling = client.AutoscalingV2Api(api_client)
        # pool -> why its target is not patched: an HPA (or KEDA's) scales it too (check_autoscalers)
        self.conflicts: dict[str, str] = {}
        self.hpa_check_s = HPA_CHECK_S
        self.clock: Callable[[], float] = time.monotonic
        self._hpa_checked: float | None = None
        self._hpa_failures = 0  # checks in a row with a list that failed (not a 403): the next comes sooner
        self._forbidden: set[str] = set()  # namespaces whose HPAs the guard may not list (warned once)
        self._selectors: dict[str, str] = {}  # pool -> the scale subresource's status.selector
        # pool -> seconds a replica needs to drain (the advisor's drain_grace_s: the longest
        # request observed x 1.5 + the KV pull timeout); a scale-down whose pods would be killed
        # sooner is refused (deploy/k8s/pd-drain.yaml carries the preStop drain itself)
        self.drain_grace_s: dict[str, float] = {}

    def grace_period_s(self, pool: str) -> float | None:
        """``terminationGracePeriodSeconds`` of the target's pod template (LeaderWorkerSet: the
        leader's), Kubernetes' default 30 s when unset; None when it cannot be read."""
        t = self._target(pool)
        try:
            if t.kind == "Deployment":
                spec = self._call(self.apps.read_namespaced_deployment, t.name, t.namespace).spec.template.spec
                g = getattr(spec, "termination_grace_period_seconds", None)
            else:
                obj = self._call(self.custom.get_namespaced_custom_object, LWS_GROUP, LWS_VERSION, t.namespace,
                                 LWS_PLURAL, t.name)
                tpl = obj.get("spec", {}).get("leaderWorkerTemplate", {})
                tpl = tpl.get("leaderTemplate") or tpl.get("workerTemplate") or {}
                g = tpl.get("spec", {}).get("terminationGracePeriodSeconds")
        except Exception:  # reading is best effort: the scale itself reports real failures
            return None
        return 30.0 if g is None else float(g)

    def check_drain(self, pool: str, replicas: int, current: int | None = None) -> None:
        """Refuse a scale-down that could kill in-flight requests: the pods' grace period must
        cover the pool's observed drain time. Fails closed: a current size or a grace period it
        cannot read (the API server failing, RBAC without ``get`` on the object) refuses too."""
        need = self.drain_grace_s.get(pool)
        if not need:
            return
        if current is None:
            current = self.get_replicas(pool)
        if replicas >= current:
            return
        grace = self.grace_period_s(pool)
        t = self._target(pool)
        if grace is None:
            raise ActuationError(f"refusing to scale {t.kind}/{t.namespace}/{t.name} down to {replicas}: cannot "
                                 f"read its terminationGracePeriodSeconds (needs get on the {t.kind} itself, "
                                 "deploy/k8s/rbac.yaml) to check it covers the drain time "
                                 f"{need:.0f} s")
        if grace < need:
            raise ActuationError(f"refusing to scale {t.kind}/{t.namespace}/{t.name} down to {replicas}: "
                                 f"terminationGracePeriodSeconds {grace:.0f} s < drain time {need:.0f} s "
                                 "(longest observed request x 1.5 + 60 s); raise it (deploy/k8s/pd-drain.yaml)")

    def _target(self, pool: str) -> KubernetesTarget:
        t = self.targets.get(pool)
        if t is None:
            raise ActuationError(f"no kubernetes target for pool {pool!r}; set advisor.actuation.kubernetes.{pool}")
        return t

    def get_replicas(self, pool: str) -> int:
        return self._read_scale(pool)[0]

    def _read_scale(self, pool: str) -> tuple[int, str | None]:
        """``spec.replicas`` and the ``resourceVersion`` the patch is conditioned on; keeps the
        pods' ``status.selector`` for ``unschedulable``."""
        t = self._target(pool)
        try:
            if t.kind == "Deployment":
                scale = self._call(self.apps.read_namespaced_deployment_scale, t.name, t.namespace)
                selector = getattr(getattr(scale, "status", None), "selector", None)
                if selector:
                    self._selectors[pool] = selector
                return int(scale.spec.replicas or 0), getattr(scale.metadata, "resource_version", None)
            obj = self._call(self.custom.get_namespaced_custom_object_scale, LWS_GROUP, LWS_VERSION, t.namespace,
                             LWS_PLURAL, t.name)
            if (obj.get("status") or {}).get("selector"):
                self._selectors[pool] = obj["status"]["selector"]
            return int(obj.get("spec", {}).get("replicas", 0)), obj.get("metadata", {}).get("resourceVersion")
        except Exception as err:  # ApiException, connection errors: the caller counts and continues
            raise ActuationError(f"reading scale of {t.kind}/{t.namespace}/{t.name} failed: "
                                 f"{api_reason(err, pool, t, 'get')}") from err

    def _call(self, fn: Callable[..., object], *args: object, **kw: object) -> Any:
        """One API call, whole within ``timeout_s`` (the client's own timeout bounds each read)."""
        return call_within(lambda: fn(*args, **kw, _request_timeout=self.timeout_s), self.timeout_s)

    def unschedulable(self, pool: str) -> tuple[int, str]:
        """Replicas of the pool's target the scheduler could not place (a pod Pending with
        ``PodScheduled=False``, reason ``Unschedulable``: no node with free GPUs), and the
        scheduler's message. They are ordered but not coming, so the advisor must not count them
        as starting. One pod list (Pending pods of the scale's ``status.selector``), whole
        within ``timeout_s``; a LeaderWorkerSet group counts once if any of its pods is stuck."""
        t = self._target(pool)
        if pool not in self._selectors:
            self._read_scale(pool)
        selector = self._selectors.get(pool)
        if not selector:
            raise ActuationError(f"{t.kind}/{t.namespace}/{t.name}: its scale subresource has no status.selector, "
                                 "so its pods cannot be found")
        lws = t.kind == "LeaderWorkerSet"
        if lws:  # hpaPodSelector names the leaders; a group whose workers cannot be placed is not coming either
            selector = ",".join(p for p in selector.split(",") if not p.startswith(LWS_WORKER_INDEX + "="))
        try:
            pods = self._call(self.core.list_namespaced_pod, t.namespace, label_selector=selector,
                              field_selector="status.phase=Pending")
        except Exception as err:
            raise ActuationError(f"listing the pods of {t.kind}/{t.namespace}/{t.name} failed: "
                                 f"{api_reason(err, pool, t, 'list', 'pods')}") from err
        stuck: set[str] = set()
        why = ""
        for pod in pods.items or []:
            meta = pod.metadata
            if meta.deletion_timestamp is not None:
                continue
            for cond in (pod.status.conditions if pod.status else None) or []:
                if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                    stuck.add((meta.labels or {}).get(LWS_GROUP_INDEX, meta.name) if lws else meta.name)
                    why = why or " ".join((cond.message or "").split())[:200]
        return len(stuck), why

    def check_autoscalers(self) -> dict[str, str]:
        """At the first call and then every ``hpa_check_s``: list the HorizontalPodAutoscalers
        (autoscaling/v2) of the targets' namespaces and note each target one of them scales (a
        KEDA ScaledObject scales through one). Patches of such a pool are refused until a check
        finds the HPA gone: the guard and the HPA would set the size in turn. Returns what this
        check found (pool -> one line naming the HPA and the fix); nothing when no check was due.
        A list that fails is no answer: the last one stands, asked again after 15 s (doubling to
        ``hpa_check_s``); a 403 (the Role lacks ``list`` on horizontalpodautoscalers) is warned
        about once, naming the rule to add."""
        now = self.clock()
        if self._hpa_checked is not None and now - self._hpa_checked < self._hpa_due_s():
            return {}
        self._hpa_checked = now
        found: dict[str, str] = {}
        failed = False
        for ns in sorted({t.namespace for t in self.targets.values()}):
            try:
                hpas = self._call(self.autoscaling.list_namespaced_horizontal_pod_autoscaler, ns).items or []
            except Exception as err:
                failed |= self._hpa_list_failed(ns, err)
                continue
            self._forbidden.discard(ns)
            for pool, t in self.targets.items():
                if t.namespace != ns:
                    continue
                self.conflicts.pop(pool, None)
                h = next((h for h in hpas if h.spec.scale_target_ref.kind == t.kind
                          and h.spec.scale_target_ref.name == t.name), None)
                if h is not None:
                    found[pool] = self.conflicts[pool] = hpa_conflict(h, pool, t)
        self._hpa_failures = self._hpa_failures + 1 if failed else 0
        return found

    def _hpa_due_s(self) -> float:
        """Seconds between checks: ``hpa_check_s``, or sooner after a list that failed (an API server
        restarting, a timeout): an HPA created meanwhile went unseen for 5 min, the two scaling in turn."""
        if not self._hpa_failures:
            return self.hpa_check_s
        return min(self.hpa_check_s, HPA_RETRY_S * 2 ** (self._hpa_failures - 1))

    def _hpa_list_failed(self, ns: str, err: Exception) -> bool:
        """Log the failed list (a 403 once, naming the RBAC rule); True when it is worth asking again
        soon (not a 403: that stays until the Role changes)."""
        if getattr(err, "status", None) == 403:
            if ns not in self._forbidden:
                self._forbidden.add(ns)
                log.warning("kubernetes actuator: may not list HorizontalPodAutoscalers in namespace %r (HTTP 403), "
                            "so an HPA or KEDA ScaledObject scaling the same targets goes unseen (not read as none); "
                            "add to the guard's Role: apiGroups [\"autoscaling\"], resources "
                            "[\"horizontalpodautoscalers\"], verbs [\"list\"] (deploy/k8s/rbac.yaml)", ns)
            return False
        log.warning("kubernetes actuator: listing the HorizontalPodAutoscalers of namespace %r failed (%s); "
                    "the last answer stands, asked again in %.0f s", ns, f"{type(err).__name__}: {err}"[:200],
                    min(self.hpa_check_s, HPA_RETRY_S * 2 ** self._hpa_failures))
        return True

    def set_replicas(self, model: str, pool: str, replicas: int, key: str) -> None:
        t = self._target(pool)
        self.check_autoscalers()  # when due (the evaluator asks every tick, logging what is found)
        if pool in self.conflicts:  # two autoscalers on one target fight: this one stands back
            raise ActuationError(f"not scaling {t.kind}/{t.namespace}/{t.name} to {replicas}: {self.conflicts[pool]}")
        current, version = self._read_scale(pool)  # a pool whose size cannot be read is not acted on
        self.check_drain(pool, replicas, current)
        if self.may_send is not None and not self.may_send(self.timeout_s):
            raise StandbyError(f"standby: lost the leadership before patching {pool}={replicas}")
        body: dict[str, Any] = {"spec": {"replicas": int(replicas)}}
        if version:  # a write since the read (another writer, a late patch of a deposed leader) gives 409
            body["metadata"] = {"resourceVersion": version}
        try:
            if t.kind == "Deployment":
                got = self._call(self.apps.patch_namespaced_deployment_scale, t.name, t.namespace, body).spec.replicas
            else:
                got = self._call(self.custom.patch_namespaced_custom_object_scale, LWS_GROUP, LWS_VERSION,
                                 t.namespace, LWS_PLURAL, t.name, body).get("spec", {}).get("replicas")
        except Exception as err:
            raise ActuationError(f"scaling {t.kind}/{t.namespace}/{t.name} to {replicas} failed: "
                                 f"{api_reason(err, pool, t, 'patch')}") from err
        applied = int(got or 0)  # the answer is the stored Scale; replicas 0 is omitted from it
        if applied != int(replicas):  # a mutating webhook or policy changed it: known now, not a tick later
            raise CappedError(f"scaling {t.kind}/{t.namespace}/{t.name} to {replicas}: the API server set "
                              f"spec.replicas to {applied} instead (an admission webhook or policy changed the "
                              f"patch); counting {applied}", applied)


def hpa_conflict(hpa: Any, pool: str, t: KubernetesTarget) -> str:
    """One line naming the HPA on the target (and the KEDA ScaledObject behind it) and the fix."""
    meta = hpa.metadata
    keda = (meta.labels or {}).get(KEDA_SCALEDOBJECT_LABEL)
    owner = f" (created by KEDA ScaledObject {keda!r})" if keda else ""
    return (f"HorizontalPodAutoscaler {meta.namespace or t.namespace}/{meta.name}{owner} also scales "
            f"{t.kind}/{t.namespace}/{t.name}, so the guard does not patch {pool} (the two would fight): remove "
            f"the {'ScaledObject' if keda else 'HPA'}, or run the guard in advisory mode (advisor.mode: advisory) "
            "and let the HPA follow the guard's desired replicas as its external metric "
            "(deploy/k8s/hpa-external.yaml, deploy/k8s/keda-scaledobject.yaml)")


def api_reason(err: Exception, pool: str, t: KubernetesTarget, verb: str, resource: str | None = None) -> str:
    """One line for the log and the decision record: the status, the API server's own message,
    and what to do about it. ``str(ApiException)`` was four lines with every response header.
    ``resource``: what was asked for when not the target's scale subresource (e.g. ``pods``)."""
    status = getattr(err, "status", None)
    if not isinstance(status, int) or status == 0:  # timeouts, refused connections
        return f"{type(err).__name__}: {err}"[:300]
    message = ""
    with contextlib.suppress(ValueError, AttributeError):  # a body that is no Status: the status alone
        message = str(json.loads(getattr(err, "body", None) or "{}").get("message") or "")
    if resource is None:
        resource = f"{'deployments/scale' if t.kind == 'Deployment' else 'leaderworkersets/scale'} {t.name!r}"
    hint = {401: "the API server rejected the guard's credentials (service-account token or kubeconfig)",
            403: f"RBAC: the guard's service account needs {verb} on {resource} in namespace "
                 f"{t.namespace!r} (deploy/k8s/rbac.yaml)",
            404: f"no such {t.kind} (advisor.actuation.kubernetes.{pool}: kind, name, namespace"
                 + (", and the LeaderWorkerSet CRD installed)" if t.kind == "LeaderWorkerSet" else ")"),
            409: "the object changed while it was written (another writer); decided again next tick",
            429: "the API server is throttling the guard (API Priority and Fairness); decided again next tick",
            }.get(status, "the API server failed; decided again next tick" if status >= 500 else "")
    parts = [f"HTTP {status} {getattr(err, 'reason', '') or ''}".strip(), message[:200], hint]
    return "; ".join(p for p in parts if p)


class LeaderGatedActuator:
    """Calls the inner actuator only while ``elector`` says this guard leads.

    Keeps the inner actuator's ``name`` so the actuation metrics keep their label. On a standby
    ``set_replicas`` raises ``StandbyError('standby: not the leader (holder X)')``: the evaluator
    then neither counts the replicas as ordered nor pretends it actuated. When the election itself
    fails (the Lease unreadable: RBAC, a down API server) it raises a plain ``ActuationError``,
    counted: then no guard may be actuating, which must not read as a quiet standby."""

    def __init__(self, inner: Actuator, elector: Elector) -> None:
        self.inner = inner
        self.elector = elector
        self.name = inner.name
        self.standby_skips = 0
        if hasattr(inner, "may_send"):
            inner.may_send = elector.confirm

    @property
    def drain_grace_s(self) -> dict[str, float]:
        """The inner actuator's drain times, which the evaluator sets before a scale-down (an
        ``AttributeError`` for a webhook, so ``hasattr`` says no). Without it the Kubernetes
        actuator's drain check never ran behind the gate."""
        return self.inner.drain_grace_s  # type: ignore[attr-defined]

    @property
    def get_replicas(self) -> Callable[[str], int]:
        """The inner actuator's read of a pool's ordered size (Kubernetes: ``spec.replicas``);
        an ``AttributeError`` for a webhook, which cannot read one."""
        return self.inner.get_replicas  # type: ignore[attr-defined]

    @property
    def unschedulable(self) -> Callable[[str], tuple[int, str]]:
        """The inner actuator's count of ordered replicas that cannot be scheduled (Kubernetes);
        an ``AttributeError`` for a webhook."""
        return self.inner.unschedulable  # type: ignore[attr-defined]

    @property
    def check_autoscalers(self) -> Callable[[], dict[str, str]]:
        """The inner actuator's search for an HPA on its targets (Kubernetes), on the leader only:
        a standby patches nothing, so it fights nothing (its first check comes when it leads); an
        ``AttributeError`` for a webhook."""
        check = self.inner.check_autoscalers  # type: ignore[attr-defined]
        return lambda: check() if self.elector.is_leader() else {}

    def set_replicas(self, model: str, pool: str, replicas: int, key: str) -> None:
        if not self.elector.is_leader():
            self.standby_skips += 1
            raise self._not_leader("standby: not the leader")
        try:
            self.inner.set_replicas(model, pool, replicas, key)
        except StandbyError as err:  # the leadership was not confirmed just before the request
            raise self._not_leader(str(err)) from None

    def _not_leader(self, what: str) -> ActuationError:
        failing = getattr(self.elector, "last_error", None)
        if failing:
            return ActuationError(f"not applied: the leader election fails ({failing}), so no guard may be "
                                  f"actuating; {what}")
        return StandbyError(f"{what} (holder {self.elector.holder() or 'unknown'})")

    def close(self) -> None:
        self.elector.stop()
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
