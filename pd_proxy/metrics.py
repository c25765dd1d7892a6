"""The client scope of the metric contract, as this proxy measures it.

Names, help, labels and buckets come from ``exporters.contract`` through
``exporters.prometheus.ContractMetrics`` (buckets via ``bucket_override``, so the SLA thresholds in
``SLA_GUARD_TTFT_SLO_S`` / ``SLA_GUARD_TPOT_SLO_S`` are boundaries here as on the engines). The
families live on the proxy's own registry: two proxies in one process (tests) do not collide, and
``/metrics`` shows the client scope only.

Every recording call is wrapped so that a metrics error is logged, never raised: observing a
request must not fail it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, generate_latest

from exporters import contract as c
from exporters.otel import OtelMirror
from exporters.prometheus import ContractMetrics

log = logging.getLogger("pd_proxy.metrics")

OTHER_MODEL = "other"  # every model past the first max_models distinct ones
UNKNOWN_MODEL = "unknown"  # no usable "model" field (absent, not a string, or the body did not parse)
MAX_MODEL_LABEL_CHARS = 200

F = TypeVar("F", bound=Callable[..., Any])


def never_raises(fn: F) -> F:
    """Log, do not raise: the request goes on whatever happens to its statistics."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            log.exception("client metrics: %s failed (the request is not affected)", fn.__qualname__)
            return None

    return wrapper  # type: ignore[return-value]


class ModelLabels:
    """The model label: the request's own ``model``, for at most ``limit`` models an engine has
    served (``admit``, first come, first kept), and while slots are left, up to as many names not
    served yet (tentative); the rest are ``other``. A bound on the series a client can create,
    2 x ``limit`` names.

    A slot is kept only for a model an engine served: 16 requests naming models that do not exist
    (each refused upstream with a 404) used to take every slot, and the real model was ``other``
    for the proxy's life, its client-scope SLO without data."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._tentative: set[str] = set()
        self._warned = False

    def __call__(self, model: object) -> str:
        if not isinstance(model, str) or not model or len(model) > MAX_MODEL_LABEL_CHARS:
            return UNKNOWN_MODEL if not isinstance(model, str) or not model else OTHER_MODEL
        if model in self._seen or model in self._tentative:
            return model
        if len(self._seen) < self.limit and len(self._tentative) < self.limit:
            self._tentative.add(model)
            return model
        if not self._warned:  # once: the guard shows a pool "other", this says why
            self._warned = True
            log.warning("model %r and later new models are counted as model=%r: --max-models %d distinct "
                        "models reached (LoRA adapters count each); raise --max-models to give each its own "
                        "client-scope series", model, OTHER_MODEL, self.limit)
        return OTHER_MODEL

    def admit(self, model: object) -> None:
        """An engine served ``model``: it keeps its own label (while slots last)."""
        if isinstance(model, str) and model and len(model) <= MAX_MODEL_LABEL_CHARS and model not in self._seen \
                and len(self._seen) < self.limit:
            self._seen.add(model)
            self._tentative.discard(model)


class ClientMetrics:
    """The client-scope families of one proxy, labelled pool="client", route="pd", router=NAME."""

    def __init__(self, router: str, max_models: int = 16, registry: CollectorRegistry | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.router = router
        self.registry = registry if registry is not None else CollectorRegistry()
        self.families = ContractMetrics(self.registry, components=(c.Component.ROUTER,), env=env)
        self.model_label = ModelLabels(max_models)
        self._primed: set[str] = set()  # models whose counters exist at 0 (bounded by the model labels)
        # per-request spans over OTLP when SLA_GUARD_OTLP_ENDPOINT is set (joinable with the engines')
        self.otel = OtelMirror.from_env(env)

    def labels(self, model: str) -> tuple[str, str, str, str]:
        return model, str(c.Pool.CLIENT), str(c.Route.PD), self.router

    @never_raises
    def rejected(self, model: str = UNKNOWN_MODEL) -> None:
        """A request the proxy refused before it was served (400 not JSON, 413 too large): the
        client's mistake, one client_error and nothing else."""
        self.families[c.CLIENT_REQUESTS].labels(*self.labels(model), str(c.Outcome.CLIENT_ERROR)).inc()

    def request(self, model: str, t0: float, request_id: str = "") -> RequestStats:
        return RequestStats(self, model, t0, request_id)

    @never_raises
    def prime(self, model: str) -> None:
        """Make ``model``'s counters that the SLIs read exist at 0 before their first count: Prometheus's
        ``increase()`` over a series that appears at 1 counts nothing, so the first failed request of a
        model was lost to the availability SLI and the TTFT/TPOT misses in Prometheus mode and the rules."""
        if model in self._primed:
            return
        self._primed.add(model)
        f = self.families
        for outcome in c.AVAILABILITY_COUNTED:
            f[c.CLIENT_REQUESTS].labels(*self.labels(model), str(outcome))
        for m in (c.UNOBSERVED_MISSES[c.CLIENT_TTFT], c.UNOBSERVED_MISSES[c.CLIENT_TPOT]):
            f[m].labels(*self.labels(model))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestStats:
    """One client request's measurements. ``finish()`` records once, whoever calls it first (the
    response after its last byte, or the clean-up of an aborted stream)."""

    def __init__(self, metrics: ClientMetrics, model: str, t0: float, request_id: str = "") -> None:
        self.metrics = metrics
        self.model = model
        self.t0 = t0  # time.perf_counter() at arrival
        self.request_id = request_id
        self.wall0 = time.time() - (time.perf_counter() - t0)  # arrival on the wall clock, for spans
        self.ttft: tuple[float, float, float] | None = None  # ttft, prefill leg, decode first leg
        # a streamed request (TTFT observed) and one streaming several choices (no TPOT observed): an error
        # is charged to the indicator it left without an observation, once (finish)
        self.streamed = False
        self.several = False
        self.finished = False
        self._labels = metrics.labels(model)
        self._in_flight = None
        self._start()

    @never_raises
    def _start(self) -> None:
        self.metrics.prime(self.model)
        self._in_flight = self.metrics.families[c.CLIENT_IN_FLIGHT].labels(*self._labels)
        self._in_flight.inc()

    @never_raises
    def first_token(self, ttft_s: float, prefill_leg_s: float, decode_first_leg_s: float) -> None:
        """TTFT and its parts; the proxy's own share is what the two legs do not explain."""
        self.ttft = (ttft_s, prefill_leg_s, decode_first_leg_s)
        f = self.metrics.families
        f[c.CLIENT_TTFT].labels(*self._labels).observe(ttft_s)
        stage = f[c.CLIENT_STAGE]
        stage.labels(*self._labels, str(c.Stage.PREFILL_LEG)).observe(prefill_leg_s)
        stage.labels(*self._labels, str(c.Stage.DECODE_FIRST_LEG)).observe(decode_first_leg_s)
        stage.labels(*self._labels, str(c.Stage.PROXY)).observe(max(0.0, ttft_s - prefill_leg_s - decode_first_leg_s))

    @never_raises
    def tpot(self, first_token_at: float, last_token_at: float, completion_tokens: int | None) -> None:
        if completion_tokens is not None and completion_tokens > 1:
            self.metrics.families[c.CLIENT_TPOT].labels(*self._labels).observe(
                (last_token_at - first_token_at) / (completion_tokens - 1))

    @never_raises
    def finish(self, outcome: c.Outcome, now: float | None = None) -> None:
        """Outcome and in-flight always; e2e when the client got a whole answer (ok, error or
        client_error), not when it left before the last byte."""
        if self.finished:
            return
        self.finished = True
        f = self.metrics.families
        e2e = (time.perf_counter() if now is None else now) - self.t0
        try:
            f[c.CLIENT_REQUESTS].labels(*self._labels, str(outcome)).inc()
            if outcome is not c.Outcome.ABORTED:
                f[c.CLIENT_E2E].labels(*self._labels).observe(e2e)
            if outcome is c.Outcome.ERROR and self.streamed:
                # the service failed a streamed request: a TTFT miss if it never got a first token, else
                # (its TTFT observed, its TPOT not) a TPOT miss; the guard adds these to the attainment SLIs
                # (the histogram's child is made, at zero, if none exists: with every request failing there
                # is no histogram to add the misses to, and the scope read "no data", not 0 %)
                if self.ttft is None:
                    f[c.CLIENT_FAILED_BEFORE_FIRST_TOKEN].labels(*self._labels).inc()
                    f[c.CLIENT_TTFT].labels(*self._labels)
                elif not self.several:
                    f[c.CLIENT_FAILED_AFTER_FIRST_TOKEN].labels(*self._labels).inc()
                    f[c.CLIENT_TPOT].labels(*self._labels)
        finally:  # whatever failed above, the request is no longer in flight
            if self._in_flight is not None:
                self._in_flight.dec()
        if self.metrics.otel is not None:
            self._span(outcome, e2e)

    @never_raises
    def _span(self, outcome: c.Outcome, e2e_s: float) -> None:
        m = self.metrics
        attrs = {"gen_ai.request.model": self.model, "sla_guard.pool": str(c.Pool.CLIENT),
                 "sla_guard.route": str(c.Route.PD), "sla_guard.router": m.router}
        ttft, p_leg, d_leg = self.ttft if self.ttft is not None else (None, None, None)
        m.otel.client_span(attrs, self.request_id, self.wall0, e2e_s, str(outcome), ttft, p_leg, d_leg)
