"""The guard's HTTP API (FastAPI; OpenAPI docs at /docs, schema at /openapi.json).

- ``/healthz``: the process answers (liveness); ``/readyz``: 200 once a first evaluation ran
  on data (readiness), else 503; ``/metrics``: the guard's own metrics (contract GUARD
  component) in the Prometheus text format. These three are open: probes and Prometheus
  scrape them.
- ``/v1/status``, ``/v1/slo``, ``/v1/targets`` and every router passed in ``extra_routers``
  (the detectors' ``/v1/findings``, the advisor's ``/v1/recommendations``) require
  ``Authorization: Bearer <token>``, compared in constant time. Without a configured token the
  /v1 routes are open; ``sla-guard serve`` only allows that on a loopback address.
- Every answer is bounded: lists and per-process / per-group maps come in pages of at most
  ``PAGE_MAX`` (``limit``; ``next`` -> ``after``), rendered in the route's worker thread.
- Every error is JSON: ``{"error": {"status": 401, "message": "..."}}``; request bodies over
  ``max_body_bytes`` are refused with 413 before they are read into memory.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from exporters.request_deadline import request_timeout_protocol
from sla_guard.model import PAGE_MAX, Status, jsonable, page
from sla_guard.service import Guard
from sla_guard.slo import worst

log = logging.getLogger("sla_guard.api")

STATUS_LIMIT = 100  # /v1/status: entries per evaluator's per-process / per-group map by default

_bearer = HTTPBearer(auto_error=False, description="the guard's API token (api.token_file or $SLA_GUARD_TOKEN)")


def _json(obj) -> JSONResponse:
    """``obj`` rendered to JSON here, in the route's worker thread: returned as a dict, FastAPI
    encoded and rendered it on the event loop, which a 3 MB /v1/status held for half a second
    (scrapes and the tick's schedule run on that loop)."""
    return JSONResponse(jsonable(obj))


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"status": status, "message": message}}, status_code=status, headers=headers)


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``limit`` bytes, by Content-Length or while
    streaming, so an oversized upload is never buffered."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                resp = _error(413, f"request body over {self.limit} bytes")
                return await resp(scope, receive, send)
        seen = 0
        limit = self.limit

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return msg

        try:
            return await self.app(scope, limited, send)
        except _TooLarge:
            resp = _error(413, f"request body over {self.limit} bytes")
            return await resp(scope, receive, send)


class _TooLarge(Exception):
    pass


V1_CONCURRENCY = 2  # /v1 requests answered at once; the others wait their turn on the event loop
# the autoscalers' reads: KEDA's metrics-api scaler polls /v1/scale/keda[/{pool}], a custom
# autoscaler /v1/recommendations; each copies out the advisor's last decision (1-30 ms at fleet scale)
AUTOSCALER_READS = ("/v1/scale/", "/v1/recommendations")
AUTOSCALER_CONCURRENCY = 2  # autoscaler reads answered at once, beside the other /v1 requests


class V1Limit:
    """ASGI middleware: at most ``n`` ``/v1`` requests at once. Each is CPU work in a worker
    thread (40 of them), and every one contends for the GIL with the event loop (scrapes, the
    probes, the tick's schedule) and the tick's thread: 50 clients asking ``/v1/status`` at once
    kept ``/healthz`` waiting seconds. The others wait here, holding no thread.

    The autoscalers' reads (``autoscaler_reads``, path prefixes) wait in a lane of their own, at
    most ``autoscaler_n`` at once: in the one queue KEDA's poll of ``/v1/scale/keda`` waited
    behind every ``/v1/status`` of such a storm, for seconds, and past KEDA's HTTP timeout (3 s by
    default) KEDA holds the pool or takes its fallback. Their work is small and bounded, so their
    lane adds little to the GIL's load; a storm of heavy reads no longer queues them, and what is
    left is the GIL they share (0.1 s in such a storm, about as long as ``/healthz`` waits)."""

    def __init__(self, app, n: int = V1_CONCURRENCY, autoscaler_n: int = AUTOSCALER_CONCURRENCY,
                 autoscaler_reads: tuple[str, ...] = AUTOSCALER_READS) -> None:
        self.app, self.autoscaler_reads = app, autoscaler_reads
        self._n = {False: n, True: autoscaler_n}
        self._sems: dict[bool, asyncio.Semaphore] = {}  # per lane, made on the serving loop

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        lane = path.startswith(self.autoscaler_reads)
        sem = self._sems.get(lane)
        if sem is None:
            sem = self._sems[lane] = asyncio.Semaphore(self._n[lane])
        held = True
        await sem.acquire()

        async def sending(msg):
            nonlocal held
            if held and msg["type"] == "http.response.start":  # the work is done: a slow reader holds no turn
                held = False
                sem.release()
            await send(msg)

        try:
            return await self.app(scope, receive, sending)
        finally:
            if held:
                sem.release()


def server_config(app, host: str, port: int, *, request_timeout_s: float = 10.0, idle_timeout_s: float = 5.0,
                  max_connections: int = 1024, shutdown_timeout_s: float = 5.0):
    """The uvicorn settings ``sla-guard serve`` uses: a request (header + body) deadline (uvicorn
    alone waits forever for headers, so half-open connections pile up), an idle keep-alive
    timeout, a connection cap (503 beyond) and a bounded graceful shutdown."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", access_log=False,
                          http=request_timeout_protocol(request_timeout_s), timeout_keep_alive=idle_timeout_s,
                          limit_concurrency=max_connections, timeout_graceful_shutdown=shutdown_timeout_s)


def create_app(guard: Guard, *, token: str | Callable[[], str] | None = None,
               extra_routers: Sequence[APIRouter] = (), max_body_bytes: int = 1024 * 1024) -> FastAPI:
    """The API app for ``guard``. ``extra_routers`` are mounted behind the same bearer auth.
    ``token``: the token, or a callable giving the current one (``config.TokenFile``)."""

    def auth(creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if token is None:
            return
        want = token() if callable(token) else token
        # the header's own bytes (Starlette decodes headers as latin-1) against the token's UTF-8
        # (api.token_file is read as UTF-8): a non-ASCII token sent as UTF-8 matches
        if creds is None or creds.scheme.lower() != "bearer" or not hmac.compare_digest(
                creds.credentials.encode("latin-1"), want.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title="sla-guard", version="0.1.0",
                  description="SLA guard for prefill/decode-disaggregated vLLM deployments.")
    app.add_middleware(V1Limit)
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return _error(422, "; ".join(parts))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("API error on %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}")

    # the probes on the event loop (nothing in them blocks): as sync routes they queued behind the
    # worker threads, all 40 busy with 50 clients asking /v1/status, and a kubelet's probe timed out
    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"])
    async def readyz():
        if guard.ready():
            return {"status": "ready", "ticks": guard.ticks}
        return _error(503, "not ready: no evaluation on data yet")

    @app.get("/metrics", tags=["probes"], response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(guard.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)], tags=["guard"])

    @v1.get("/status", response_model=dict)
    def status(limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description="entries per process or group map "
                                           f"of each evaluator (1-{PAGE_MAX})")] = STATUS_LIMIT,
               evaluator: Annotated[str | None, Query(description="only this evaluator's snapshot")] = None,
               after: Annotated[str | None, Query(description="the previous page's `next` (with evaluator=)")] = None
               ) -> JSONResponse:
        """Everything at a glance: source, last tick, every evaluator's snapshot, its per-process
        and per-group maps ``limit`` entries each (``<what>_total`` and ``next`` say when more)."""
        if after is not None and evaluator is None:
            raise HTTPException(400, "after= pages one evaluator's map: pass evaluator= too")
        if evaluator is not None and guard.evaluator(evaluator) is None:
            raise HTTPException(404, f"unknown evaluator {evaluator!r}; known: {[e.name for e in guard.evaluators]}")
        out = guard.status(limit, evaluator, after)
        snap = out["evaluators"].get(evaluator) if evaluator is not None else None
        if isinstance(snap, dict) and "next" in snap:
            out["next"] = snap["next"]  # one evaluator's pages: the cursor where every paged answer has it
        return _json(out)

    @v1.get("/slo", response_model=dict)
    def slo(model: str | None = None, pool: str | None = None,
            limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description=f"pools per page (1-{PAGE_MAX})")] = PAGE_MAX,
            after: Annotated[str | None, Query(description="the previous page's `next`")] = None) -> JSONResponse:
        """SLO status per (model, pool), filtered by ``model`` / ``pool``; by ``model/pool``,
        ``limit`` a page (``pools_total`` all that match, ``next`` the cursor when more).
        ``status`` is the verdict of every pool selected, not of the page."""
        ev = guard.evaluator("slo")
        if ev is None:
            raise HTTPException(404, "no SLO evaluator configured")
        snap = ev.snapshot()
        if model is not None or pool is not None:
            snap["pools"] = [p for p in snap["pools"] if (model is None or p["model"] == model)
                             and (pool is None or p["pool"] == pool)]
            # the status of what was asked for: a misspelt model matches nothing, which is
            # "unknown", not the other pools' "ok"
            snap["status"] = worst(Status(p["status"]) for p in snap["pools"]).value if snap["pools"] \
                else Status.UNKNOWN.value
            # pools beyond the evaluator's max_pools went unjudged and may match the filter too;
            # only one pool named exactly and judged is known
            exact = model is not None and pool is not None and snap["pools"]
            if snap.get("pools_over_limit") and not exact and snap["status"] != Status.VIOLATED.value:
                snap["status"] = Status.UNKNOWN.value
        got, nxt = page(snap["pools"], limit, after, key=lambda p: f"{p['model']}/{p['pool']}")
        if nxt is not None or after is not None:  # an answer that fits one page is as before
            snap.update(pools=got, pools_total=len(snap["pools"]))
        if nxt is not None:
            snap["next"] = nxt
        return _json(snap)

    @v1.get("/targets", response_model=dict)
    def targets(limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description=f"targets per page (1-{PAGE_MAX})")]
                = PAGE_MAX,
                after: Annotated[str | None, Query(description="the previous page's `next`")] = None
                ) -> JSONResponse:
        """Every scrape target (or the Prometheus server) with its health and error counts, by
        name, ``limit`` a page (``count`` all of them, ``next`` the cursor when more)."""
        every = guard.source.targets()
        got, nxt = page(every, limit, after, key=lambda t: t.name)
        out = {"source": guard.source.mode, "targets": got}
        if nxt is not None:
            out.update(count=len(every), next=nxt)
        return _json(out)

    app.include_router(v1)
    for r in extra_routers:
        app.include_router(r, dependencies=[Depends(auth)])
    return app
