"""HTTP interfaces of the advisor: what autoscalers already speak.

- ``GET /v1/recommendations``: per pool current, desired, action, reasons, confidence and the
  numbers behind them, plus rolling-restart advice from leak findings (paged: ``limit``/``after``).
- ``GET /v1/scale/keda``: a KEDA ``metrics-api`` scaler target. The body is
  ``{"model": ..., "pools": {"prefill": {"desired": 3, "current": 2, ...}, "decode": {...}}}``;
  point one ScaledObject per pool at it with ``valueLocation: pools.prefill.desired`` (a GJSON
  path) and ``targetValue: "1"`` (metricType AverageValue), so KEDA's replica count follows the
  advisor's number exactly. ``/v1/scale/keda/{pool}`` returns one pool flat
  (``valueLocation: desired``). Until the first decision the endpoints answer 503, so KEDA keeps
  the current size (or its configured fallback) instead of scaling on a made-up number; so does a
  pool the advisor has no data for (its targets down or stale, or no capacity known yet), or only
  part of (some targets down, and a number below ready + down): the combined answer leaves it out
  and the per-pool one is a 503 naming the pool's reasons. Its decision is a hold whose numbers
  (0 replicas seen once the targets are down) would otherwise scale the pool to its minimum. A guard whose ticks stopped
  completing (``staleness_s``) answers 503 for every pool (``AdvisorEvaluator.expire``). With
  ``advisor.model: '*'`` a ``?model=`` it has not seen (a typo) is a 404 naming the known models.

Both sit under ``/v1``, behind the API's bearer auth (``sla_guard.api.create_app`` mounts them).
The recommendations and the KEDA endpoints are ``sla_guard.api.AUTOSCALER_READS``: a lane of their
own in the API's ``/v1`` limit, so a storm of heavy ``/v1/status`` reads does not hold KEDA's poll
past its HTTP timeout. Keep them small: they are copies of the advisor's last decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import JSONResponse

from sla_guard.model import PAGE_MAX, jsonable
from sla_guard.scale.evaluator import AdvisorEvaluator
from sla_guard.scale.guardrails import without_data

# what each pool's own "no data" reason means, said so an operator knows what to fix (the 503
# said "its targets down or stale" for a pool whose capacity was simply not learned yet)
_MISSING = {
    "prefill_no_token_or_queue_data": "its engines report no prompt tokens or queue",
    "prefill_capacity_not_learned": "no capacity per replica is known yet (learned from windows in which a warm "
                                    "replica is at least half busy; advisor.profile.prefill_tokens_per_s gives a "
                                    "starting value)",
    "decode_no_running_data": "its engines report no running requests",
    "decode_step_time_not_learned": "no decode step time is known yet (advisor.profile.decode_step_base_s gives a "
                                    "starting value)",
}


def _why(reasons: Sequence[str]) -> str:
    """The reasons a pool holds without a number, said so an operator knows what to fix."""
    return "; ".join(f"{r}: {_MISSING[r]}" if r in _MISSING else r for r in reasons) or "no data for it"


def advisor_router(evaluators: Sequence[AdvisorEvaluator] | AdvisorEvaluator) -> APIRouter:
    """The routes below; ``create_app`` mounts them behind the API's bearer auth."""
    evs = [evaluators] if isinstance(evaluators, AdvisorEvaluator) else list(evaluators)
    router = APIRouter(prefix="/v1", tags=["scaling"])

    def pick(model: str | None) -> AdvisorEvaluator:
        if model is None:
            if len(evs) == 1:
                return evs[0]
            raise HTTPException(400, detail=f"several models; pass ?model= one of {[e.model for e in evs]}")
        for e in evs:
            if e.model == model and not e.wildcard:
                return e
        for e in evs:  # an advisor for every model ('*') advises this one too, if it has seen it
            if e.wildcard:
                known = e.known_models()
                # a typo answered 503 "no recommendation yet", which KEDA and people read as an outage
                if known and e.recommendations()[2] is not None and model not in known:
                    raise HTTPException(404, detail=f"unknown model {model!r}; known: {known}")
                return e
        raise HTTPException(404, detail=f"unknown model {model!r}; known: {[e.model for e in evs]}")

    @router.get("/recommendations")
    def recommendations(model: str | None = None,
                        limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description="rolling restarts per page "
                                                    f"(1-{PAGE_MAX})")] = PAGE_MAX,
                        after: Annotated[str | None, Query(description="the previous page's `next`")] = None
                        ) -> JSONResponse:
        """Each model's pool decisions, and its rolling restarts (one per open leak finding) by
        ``model/finding``, ``limit`` a page (``restarts_total`` and ``next`` when more): unpaged, a
        fleet's were 0.75 MB, in the autoscalers' lane that is meant to stay small. A page (0.3 MB)
        is rendered here, in the worker thread: returned as a dict, FastAPI encoded it on the event
        loop that scrapes and every other request share."""
        chosen = evs if model is None else [pick(model)]
        # a wildcard advisor's answer for one model is that model's advice, not every model's
        out = [{"model": model or e.model, **e.snapshot(limit, after, model if e.wildcard else None)}
               for e in chosen]
        body: dict = {"models": out}
        if len(out) == 1 and "next" in out[0]:
            body["next"] = out[0]["next"]  # the cursor where every paged answer has it
        return JSONResponse(jsonable(body))

    def _pools(e: AdvisorEvaluator, model: str | None) -> dict:
        """One model's pools: a wildcard advisor holds several models, whose pools must never be
        merged into one answer (KEDA would size one model's pool on another's number)."""
        recs, _restarts, at = e.recommendations()
        if at is None:
            raise HTTPException(503, detail="no recommendation yet (first evaluation pending or no data)")
        if model is not None:
            recs = [r for r in recs if r.model == model]
            if not recs:
                raise HTTPException(503, detail=f"no recommendation for model {model!r} now (its targets down "
                                               f"or stale)")
        models = sorted({r.model for r in recs})
        if len(models) > 1:
            raise HTTPException(400, detail=f"several models; pass ?model= one of {models}")
        known = [r for r in recs if not without_data(r.reasons)]
        if not known:
            raise HTTPException(503, detail="no data to size any pool on: "
                                + "; ".join(f"{r.pool}: {_why(r.reasons)}" for r in recs))
        return {r.pool: {"desired": r.desired, "current": r.current, "action": r.action,
                         "confidence": r.confidence, "reason": r.reasons[0] if r.reasons else ""} for r in known}

    @router.get("/scale/keda")
    def keda(model: str | None = None) -> dict:
        e = pick(model)
        return {"model": model or e.model, "mode": e.cfg.mode, "pools": _pools(e, model)}

    @router.get("/scale/keda/{pool}")
    def keda_pool(pool: str, model: str | None = None) -> dict:
        e = pick(model)
        if pool not in ("prefill", "decode"):
            raise HTTPException(404, detail=f"unknown pool {pool!r}; known: ['decode', 'prefill']")
        pools = _pools(e, model)
        if pool not in pools:
            recs = [r for r in e.recommendations()[0] if r.pool == pool and (model is None or r.model == model)]
            why = "; ".join(_why(r.reasons) for r in recs) or "no recommendation for it"
            raise HTTPException(503, detail=f"no data to size pool {pool!r} on: {why}")
        return {"model": model or e.model, "pool": pool, **pools[pool]}

    @router.get("/decisions")
    def decisions(model: str | None = None,
                  limit: Annotated[int, Query(ge=1, le=256, description="newest decisions to return (1-256)")] = 50
                  ) -> dict:
        # out of range is a 422 naming query.limit: clamped, limit=-5 answered one decision and
        # limit=1000 256, both without a word
        e = pick(model)
        history = list(e.history)
        if model is not None and e.wildcard:
            history = [d for d in history if d.get("model") == model]
        return {"model": model or e.model, "decisions": history[-limit:]}

    return router
