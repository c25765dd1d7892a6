"""The ``advisor:`` section of the guard's config (``GuardConfig.advisor``): the scaling
advisor's settings, here below the config so the config types the section and names the full
field path in errors (``advisor.pools.decode.max_replicas: ...``). Shared defaults come from
``sla_guard.defaults``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from sla_guard import defaults as d
from sla_guard.spec_base import Strict, http_url


class PoolLimits(Strict):
    """Bounds and cost of one pool."""

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=16, ge=1)
    gpus_per_replica: int = Field(default=8, ge=1, description="GPUs one replica holds (for the budget)")
    max_step_up: int = Field(default=4, ge=1, description="most replicas added in one decision (a surge is met "
                                                         "in one step; HPA's default allows +4 or doubling)")
    max_step_down: int = Field(default=1, ge=1, description="most replicas removed in one decision")

    @model_validator(mode="after")
    def _bounds(self) -> PoolLimits:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self


class ProfilePrior(Strict):
    """Optional profile numbers; the advisor starts from them and keeps learning online."""

    prefill_tokens_per_s: float | None = Field(default=None, gt=0,
                                               description="uncached prompt tokens/s per prefill replica")
    decode_step_base_s: float | None = Field(default=None, gt=0, description="decode step time at batch 0")
    decode_step_per_request_s: float | None = Field(default=None, gt=0,
                                                    description="added step time per running request")


class Webhook(Strict):
    url: str
    timeout_s: float = Field(default=5.0, gt=0)
    retries: int = Field(default=4, ge=0)
    backoff_s: float = Field(default=0.5, gt=0)
    bearer_token_env: str | None = None

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        # 'scaler:80' passed validate-config and failed only at the first scaling decision
        return http_url(v, "https://scaler.internal/scale")


class KubernetesTarget(Strict):
    kind: Literal["Deployment", "LeaderWorkerSet"] = "Deployment"
    name: str
    namespace: str = "default"


class LeaderElection(Strict):
    """High availability: which of several guards may actuate (``sla_guard.leader``).

    ``none`` (the default): this guard actuates alone. ``file``: the holder of an flock on
    ``lock_file`` (guards on one host). ``kubernetes``: the holder of the Lease
    ``namespace/lease_name`` (client-go's algorithm). The others keep serving verdicts."""

    mode: Literal["none", "file", "kubernetes"] = "none"
    lock_file: str | None = Field(default=None, description="mode file: path of the lock file (local filesystem)")
    lease_name: str = Field(default="sla-guard-actuation", min_length=1, description="mode kubernetes: Lease name")
    namespace: str | None = Field(default=None, description="mode kubernetes: the pod's namespace when unset")
    identity: str | None = Field(default=None, min_length=1, description="this guard's name; hostname-pid when unset")
    lease_duration_s: int = Field(default=15, ge=1, description="a Lease unrenewed this long may be taken")
    renew_deadline_s: float = Field(default=10.0, gt=0,
                                    description="the leader stops actuating when it has not renewed for this long")
    renew_s: float = Field(default=5.0, gt=0, description="the leader renews this often")
    retry_s: float = Field(default=2.0, gt=0, description="a standby (or a failed renewal) retries this often")

    @model_validator(mode="after")
    def _consistent(self) -> LeaderElection:
        if self.mode == "file" and not self.lock_file:
            raise ValueError("lock_file is required with mode 'file'")
        if self.mode == "kubernetes":
            if not self.renew_s < self.renew_deadline_s:
                raise ValueError(f"renew_s ({self.renew_s}) must be below renew_deadline_s ({self.renew_deadline_s})")
            if not self.renew_deadline_s < self.lease_duration_s:
                raise ValueError(f"renew_deadline_s ({self.renew_deadline_s}) must be below lease_duration_s "
                                 f"({self.lease_duration_s}): a leader must stop actuating before another "
                                 "guard can take the lease")
        return self


class Actuation(Strict):
    """Where an active-mode decision goes. Advisory mode ignores this."""

    webhook: Webhook | None = None
    # keyed by the advisor's pools: a mistyped key ('prefil') passed validate-config, and that pool's
    # first decision failed with "no kubernetes target"
    kubernetes: dict[Literal["prefill", "decode"], KubernetesTarget] = Field(
        default_factory=dict, description="pool name -> scale target")
    kubeconfig: str | None = Field(default=None, description="path; in-cluster config when unset")
    leader_election: LeaderElection = Field(default_factory=LeaderElection)

    @model_validator(mode="after")
    def _request_fits_the_leadership(self) -> Actuation:
        # the leader renews its Lease just before each request and sends it only if the
        # request's whole deadline ends before the renew deadline: a shorter one never actuates
        le = self.leader_election
        if le.mode != "kubernetes":
            return self
        what, need = (("kubernetes", d.KUBERNETES_CALL_TIMEOUT_S) if self.kubernetes else
                      ("webhook.timeout_s", self.webhook.timeout_s) if self.webhook else ("", 0.0))
        if need and not need < le.renew_deadline_s:
            raise ValueError(f"leader_election.renew_deadline_s ({le.renew_deadline_s}) must be above the "
                             f"{what} request deadline ({need:g} s): a leader sends a request only when it "
                             "ends before the renew deadline; raise it (and lease_duration_s)")
        return self


class AdvisorConfig(Strict):
    mode: Literal["advisory", "active"] = Field(default="advisory",
                                                description="advisory only reports; active also actuates")
    model: str = "*"
    interval_s: float = Field(default=15.0, gt=0)
    window_s: float = Field(default=120.0, gt=0, description="rate / quantile window for observations")
    stale_after_s: float = Field(default=60.0, gt=0, description="hold when the newest sample is older")
    warmup_s: float = Field(default=120.0, ge=0, description="samples of younger replicas are not learned from")
    stabilization_down_s: float = Field(default=300.0, ge=0,
                                        description="scale down to the max desired over this window")
    stabilization_up_s: float = Field(default=0.0, ge=0)
    min_evidence_s: float = Field(default=60.0, ge=0,
                                  description="data needed before the first scale-down (overwhelming fit only)")
    cooldown_s: float = Field(default=60.0, ge=0, description="min time between two actions on one pool")
    cold_start_s: float | None = Field(default=None, ge=0,
                                       description="expected time from ordering a replica to its serving, until "
                                                   "one has been observed (the observed one replaces it when "
                                                   "longer); with the cooldown it sets the scale-down break-even")
    failed_size_memory_s: float = Field(default=21600.0, ge=0,
                                        description="how long a size that had to be grown back from stays "
                                                    "off-limits at a similar load")
    failed_size_load_ratio: float = Field(default=0.8, gt=0, le=1,
                                          description="a failed size is retried only once the peak load falls "
                                                      "below this fraction of the load it failed at")
    recurrence_horizon_s: float = Field(default=7200.0, ge=0,
                                        description="lulls that ended with the load back are remembered this long")
    no_reversal_s: float = Field(default=600.0, ge=0,
                                 description="a scale-down waits for a lull longer than the longest recent one "
                                             "plus this, so it is not undone within this span")
    gpu_budget: int | None = Field(default=None, ge=1, description="GPUs shared by both pools")
    prefill_target_utilization: float = Field(default=d.PREFILL_TARGET_UTILIZATION, gt=0, le=1,
                                              description="busy share a prefill replica is sized for; queueing "
                                                          "delay, not compute, is what breaks TTFT")
    adapt_utilization: bool = Field(default=True, description="learn the prefill utilisation that meets the TTFT SLA")
    tail_quantile: float = Field(default=0.9, gt=0.5, lt=1,
                                 description="TTFT/TPOT quantile whose breach of the SLA adds a replica now; "
                                             "kept above the share of requests no replica count can save "
                                             "(very long prompts, 2-token outputs)")
    learn_quantile: float = Field(default=d.LEARN_QUANTILE, gt=0.5, lt=1,
                                  description="TTFT quantile the prefill utilisation target is learned from "
                                              "(a 5% miss budget): slower, sizing-level feedback")
    decode_tpot_headroom: float = Field(default=d.DECODE_TPOT_HEADROOM, gt=0, le=1,
                                        description="size decode so predicted TPOT <= headroom x SLA")
    learn_tpot_spread: bool = Field(default=True, description=(
        "learn decode's TPOT headroom from how far single requests' TPOT scatter around the mean (the TPOT "
        "histogram), so that the learn_quantile of requests meets the SLA; false: decode_tpot_headroom throughout"))
    kv_target_usage: float = Field(default=d.KV_TARGET_USAGE, gt=0, le=1)
    scale_down_margin: float = Field(default=d.SCALE_DOWN_MARGIN, ge=0, lt=1,
                                     description="N-1 must fit with this extra headroom")
    forecast_horizon_s: float = Field(default=d.FORECAST_HORIZON_S, ge=0,
                                      description="trend look-ahead (~ replica start time)")
    drain_horizon_s: float = Field(default=d.DRAIN_HORIZON_S, gt=0, description="time to drain a prefill backlog")
    queue_moves: bool = Field(default=False, description=(
        "true when the router queues requests itself and hands one to a replica only when it has room "
        "(a central queue), so new replicas take over a backlog; false (vLLM engines behind a P/D proxy, "
        "Dynamo or llm-d routing at arrival): a queued request stays on its engine"))
    decision_log: str | None = Field(default=None, description="JSONL path; every decision appended")
    pools: dict[Literal["prefill", "decode"], PoolLimits] = Field(
        default_factory=lambda: {"prefill": PoolLimits(), "decode": PoolLimits()})
    profile: ProfilePrior = Field(default_factory=ProfilePrior)
    actuation: Actuation = Field(default_factory=Actuation)

    def limits(self, pool: str) -> PoolLimits:
        return self.pools.get(pool, PoolLimits())  # type: ignore[call-overload]

    @model_validator(mode="after")
    def _active_needs_target(self) -> AdvisorConfig:
        a = self.actuation
        if self.mode == "active" and a.webhook is None and not a.kubernetes:
            raise ValueError("mode 'active' needs actuation.webhook or actuation.kubernetes "
                             "(or set mode: advisory)")
        if self.mode == "active" and a.kubernetes and self.model == "*":
            # each model the engines report got its own advisor, and all of them patched the one
            # object per pool: two models' sizes took turns on the same Deployment
            raise ValueError("model '*' sizes every model the engines report, but actuation.kubernetes names "
                             "one object per pool: set advisor.model to the model those objects serve (one "
                             "guard per model), or use actuation.webhook, which receives the model")
        return self

