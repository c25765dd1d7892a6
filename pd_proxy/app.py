"""The proxy as a FastAPI app: one handler for /v1/completions and /v1/chat/completions, plus
/metrics (the client scope), /health (liveness) and /readyz (readiness).

Why the request path looks the way it does:

- The prefill leg is awaited in the handler, and the decode leg is opened there too (status and
  headers only), so an engine's error status can still become the client's status; only a 200
  decode stream turns into a streamed response.
- Every upstream await runs under the leg's total deadline (``asyncio.timeout_at``, connect to the
  last body byte), never across a ``yield`` to the client, so a slow client is not counted against
  the engine and a slow engine cannot hold a request forever. Each read of a decode stream also has
  a stall bound: an engine silent that long ends the stream and is left out, as a hung one is.
- The streamed body is a ``DecodeStream`` whose ``close()`` runs after the response however it
  ends (last byte sent, client gone, send failed), shielded from cancellation: the decode stream is
  closed (vLLM aborts a request whose connection closes), the engine lease released and the
  request's outcome recorded exactly once.
- TTFT is only observable for streamed requests: a non-streamed answer arrives whole, so for it the
  proxy records e2e and outcome only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from exporters import contract as c
from pd_proxy import legs
from pd_proxy.balance import EnginePool, Lease
from pd_proxy.config import ProxyConfig, display_url
from pd_proxy.metrics import UNKNOWN_MODEL, ClientMetrics, RequestStats, never_raises

log = logging.getLogger("pd_proxy")

PATHS = ("/v1/completions", "/v1/chat/completions")
# A decode engine's 401 / 403 / 404 to a request the prefill engine has just served with the same model
# and Authorization: a model or LoRA adapter only one pool serves, another API key. The deployment is
# broken, not the client's request, so the outcome is error: as client_error every request failed while
# the availability SLO stayed green. (A decode 400 / 422 can be the client's: only decode sees max_tokens.)
POOLS_DISAGREE_4XX = frozenset({401, 403, 404})
Outcome = c.Outcome
T = TypeVar("T")


class LegFailed(Exception):
    """A leg that cannot go on; carries the answer the client gets."""

    def __init__(self, status: int, content: bytes, media_type: str) -> None:
        super().__init__(status)
        self.status, self.content, self.media_type = status, content, media_type
        self.outcome = c.outcome_of_status(status)

    @classmethod
    def proxy_error(cls, status: int, kind: str, message: str, leg: str, engine: str) -> LegFailed:
        body = legs.error_body(message, kind, status, leg, display_url(engine))
        return cls(status, json.dumps(body).encode(), "application/json")

    @classmethod
    def engine_answer(cls, r: httpx.Response, leg: str = "prefill") -> LegFailed:
        """An engine's non-200 answer, passed through: its status and body, as JSON when it is."""
        try:
            json.loads(r.content)
            media = "application/json"
        except ValueError:
            media = r.headers.get("content-type") or "text/plain"
        failed = cls(r.status_code, r.content, media)
        if leg == "decode" and r.status_code in POOLS_DISAGREE_4XX:
            log.warning("decode engine %s answered %d to a request the prefill engine served: the pools disagree "
                        "(model, LoRA adapter or API key)", display_url(str(r.request.url)), r.status_code)
            failed.outcome = Outcome.ERROR
        return failed


class TrackedResponse(Response):
    """A whole-body response that records the request's outcome after its last byte is sent."""

    def __init__(self, content: bytes, status_code: int, media_type: str | None, headers: dict[str, str],
                 stats: RequestStats, outcome: c.Outcome) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type)
        self._stats, self._outcome = stats, outcome

    async def __call__(self, scope, receive, send) -> None:
        outcome = Outcome.ABORTED  # a send that fails: the client did not get the answer
        try:
            await super().__call__(scope, receive, send)
            outcome = self._outcome
        finally:
            self._stats.finish(outcome)


class DecodeStream:
    """The decode engine's SSE stream relayed to the client, measured on the way through."""

    def __init__(self, resp: httpx.Response, lease: Lease, stats: RequestStats, deadline: float,
                 want_usage: bool, sent_at: float, prefill_leg_s: float, pool: EnginePool,
                 first_chunk_s: float, stall_s: float) -> None:
        self.resp, self.lease, self.stats = resp, lease, stats
        self.deadline, self.want_usage = deadline, want_usage
        self.sent_at, self.prefill_leg_s = sent_at, prefill_leg_s
        # The engine's verdict waits for its first chunk (see _call): a 200, then silence, is not an engine up
        self.pool, self.first_chunk_s, self.stall_s = pool, first_chunk_s, stall_s
        self.outcome = Outcome.ABORTED  # until the stream is seen to end, or to fail
        self._closed = False
        self._judged = False

    def _answered(self) -> None:
        """The engine sent its first event that is no error (vLLM: once the request's first token is out): up."""
        if not self._judged:
            self._judged = True
            self.pool.answered(self.lease.url)

    def _failure(self, status: int, kind: str, message: str) -> bytes:
        log.warning("decode leg to %s failed mid-stream: %s", display_url(self.lease.url), message)
        self.outcome = Outcome.ERROR
        return legs.sse_error_event(message, kind, status, "decode", display_url(self.lease.url))

    async def events(self):
        splitter = legs.SseSplitter()
        raw_it = self.resp.aiter_raw()
        loop = asyncio.get_running_loop()
        # Time spent handing events to a slow client (the yield waits for uvicorn's flow control) is not the
        # engine's: it moves the deadline on. Counted, it cut a stream the engine had long finished (a client
        # that read late got a 504 "decode leg passed its deadline" mid-answer, an error charged to the service).
        blocked = 0.0
        first_at = last_at = None
        tokens: int | None = None
        done = errored = False
        # Several choices (n > 1, a list of prompts) are decoded side by side, interleaved, and usage counts
        # the tokens of all of them: one choice's time over every choice's tokens observed TPOT / n. The
        # proxy cannot tell one choice's token count, so such a stream's TPOT is unknown, not observed.
        choice: int | None = None
        several = False
        # An engine started with --enable-force-include-usage puts usage into every chunk and sends the usage chunk
        # whatever the request said: to a client talking to it directly too, so the proxy keeps that chunk then.
        # Usage in a decode step the proxy did not ask for (it drops continuous_usage_stats) is how it shows.
        forced_usage = False
        finished = aborted = False
        # vLLM 0.32 sends each choice that generated text a last chunk with its finish_reason (the stream's last
        # text rides on it) before [DONE], or an error event: a choice with text and no finish_reason at [DONE]
        # lost its ending on the way (see _unfinished). Not judged when an event could not be read.
        texted: set[int] = set()
        ended: set[int] = set()
        opaque = False
        # A choice's last chunk (finish_reason), held until the usage chunk the proxy drops for a client that did not
        # ask for it: vLLM put the system_fingerprint there (include_usage on), where it would have put it on these.
        held: list[tuple[bytes, legs.Event, float]] = []
        wait_s = self.first_chunk_s  # queue and KV pull before the first chunk, one decode step after it
        while True:
            failure = None
            # the stall bound runs only while the proxy waits for the engine: never across a yield to the client
            stall_at = loop.time() + wait_s
            stalls = stall_at < self.deadline + blocked
            try:
                async with asyncio.timeout_at(min(stall_at, self.deadline + blocked)):
                    chunk = await anext(raw_it, None)
            except TimeoutError:
                if stalls and not done:  # after [DONE] the answer is whole: a slow close is no stalled engine
                    self.pool.failed(self.lease.url, f"decode stream silent for {wait_s:g} s")
                    failure = (504, "upstream_timeout", f"decode engine sent nothing for {wait_s:g} s (stalled)")
                else:
                    failure = (504, "upstream_timeout", "decode leg passed its deadline")
            except httpx.HTTPError as e:
                if not done:  # a connection reset or cut mid-body: the engine died (or its link); after [DONE], whole
                    self.pool.failed(self.lease.url, f"decode stream broke: {type(e).__name__}")
                failure = (502, "upstream_unreachable", f"decode stream broke: {type(e).__name__}: {e}")
            wait_s = self.stall_s
            received = time.perf_counter()
            ready: list[tuple[bytes, legs.Event, float]] = []
            pieces = [] if failure is not None else splitter.flush() if chunk is None else splitter.feed(chunk)
            for raw in pieces:
                ev = legs.inspect_event(raw)
                errored = errored or ev.error
                if not (errored or ev.done):  # an error event is no sign of an engine up (a dead core's), nor a 5xx
                    self._answered()
                finished, aborted = finished or ev.finished, aborted or ev.aborted
                texted.update(ev.choices)
                ended.update(ev.ended)
                opaque = opaque or ev.opaque
                if ev.completion_tokens is not None:
                    tokens = ev.completion_tokens
                    forced_usage = forced_usage or ev.step
                if ev.usage_only and not (self.want_usage or forced_usage):
                    # asked for by the proxy (TPOT needs completion_tokens), not by the client
                    ready += [(legs.with_fingerprint(r, ev.fingerprint), e, t) for r, e, t in held]
                    held = []
                    continue
                for i in ev.choices:
                    choice = i if choice is None else choice
                    several = several or i != choice
                self.stats.several = several
                if ev.finished and not (self.want_usage or forced_usage):
                    held.append((raw, ev, received))
                elif ev.step and not ev.finished:
                    ready.append((raw, ev, received))  # another choice's step (n > 1) does not wait for the usage chunk
                else:  # the end of the stream ([DONE], an error): what was held goes first, as it came
                    ready += [*held, (raw, ev, received)]
                    held = []
            if failure is not None or chunk is None:
                ready += held
                held = []
            for raw, ev, received in ready:
                if ev.token or (ev.step and first_at is not None):
                    # Stamped when the token is handed to the client connection, before the yield: the
                    # yield resumes only once the server's send() returns, and uvicorn's send() first
                    # waits (flow control) for a slow reader to drain what is already buffered, so a
                    # stamp after it counted the client's reading speed into TTFT (and TPOT).
                    # After the first token, a chunk without text is a decode step too: the last one, EOS
                    # with finish_reason, has none but is in completion_tokens; TPOT ended a step early
                    # ("Yes" + EOS: 0 s, observed) where vLLM's own TPOT ends at the EOS step.
                    last_at = time.perf_counter()
                    if first_at is None:
                        first_at = last_at
                        self.stats.first_token(first_at - self.stats.t0, self.prefill_leg_s,
                                               received - self.sent_at)
                handed = loop.time()
                if ev.done and not done and not errored and not opaque and (lost := sorted(texted - ended)):
                    # told before [DONE], as vLLM reports an error in a stream (clients stop reading at [DONE])
                    yield self._unfinished(lost)
                    errored = True
                yield raw
                blocked += loop.time() - handed
                if ev.done and not done:
                    # Settled once [DONE] is out: a client that hangs up now has its whole answer. vLLM ends every
                    # answer with a finish_reason; "abort" (or none at all, and no text: dropped before the first
                    # token) is the engine dropping the request while the client read: shutdown, fault, /pause.
                    done = True
                    cut = aborted or (first_at is None and not finished)
                    if cut and not errored:
                        why, engine = "abort" if aborted else "missing", display_url(self.lease.url)
                        log.warning("decode engine %s aborted a request (finish_reason %s)", engine, why)
                    errored = errored or cut
                    self.outcome = Outcome.ERROR if errored else Outcome.OK
                    if first_at is not None and not errored and not several:
                        self.stats.tpot(first_at, last_at, tokens)
            if failure is not None:
                if not done:  # after [DONE] the client has its whole answer: nothing to report
                    yield self._failure(*failure)
                return
            if chunk is None:
                break
        if not done:  # the engine ended the stream without [DONE]: the client's answer is cut short
            self.outcome = Outcome.ERROR
            if not errored:  # (after its own error event the client knows, and the engine was up to send it)
                # vLLM ends every stream with [DONE], even after an error: a clean end without it is a process that
                # died behind a hop that closed the body cleanly, or a body delimited by the connection's close.
                # Judged as a broken stream: the engine is left out and the client is told, not left to guess.
                self.pool.failed(self.lease.url, "decode stream ended without [DONE]")
                yield self._failure(502, "upstream_invalid", "decode stream ended without [DONE] (cut short)")

    def _unfinished(self, lost: list[int]) -> bytes:
        """The error event for a stream whose [DONE] came while choices ``lost`` had text and no finish_reason:
        the answer lost its last chunk (and the text on it) between vLLM and the proxy, or the engine is not vLLM's
        server. The engine is not left out: it ran the request to its [DONE] and answers; a hop or server that drops
        endings would drop them whichever engine served."""
        which = ", ".join(map(str, lost[:5])) + (f" (+{len(lost) - 5} more)" if len(lost) > 5 else "")
        log.warning("decode engine %s ended a stream with [DONE] but choice(s) %s had no finish_reason",
                    display_url(self.lease.url), which)
        self.outcome = Outcome.ERROR
        return legs.sse_error_event(f"decode stream ended without a finish_reason for choice(s) {which} (cut short)",
                                    "upstream_invalid", 502, "decode", display_url(self.lease.url))

    async def close(self) -> None:
        """Idempotent; runs once the response is over, whichever way it ended."""
        if self._closed:
            return
        self._closed = True
        self.stats.finish(self.outcome)
        self.lease.release()
        try:
            await self.resp.aclose()  # an unfinished stream: the connection closes, vLLM aborts the request
        except Exception:
            log.debug("closing the decode stream failed", exc_info=True)


class RelayResponse(StreamingResponse):
    def __init__(self, stream: DecodeStream, headers: dict[str, str], media_type: str) -> None:
        super().__init__(stream.events(), status_code=200, headers=headers, media_type=media_type)
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.stream.close()


class _Stalled(Exception):
    """A whole answer's body went silent for the stall bound."""


class _StallBound(httpx.AsyncByteStream):
    """An upstream body whose every read must come within ``stall_s``. The leg's total deadline stays outside: it
    cancels the read and is told from a stall by the exception (``_Stalled`` is this bound's alone)."""

    def __init__(self, inner: httpx.AsyncByteStream, stall_s: float) -> None:
        self._inner, self._stall_s = inner, stall_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        it = aiter(self._inner)
        while True:
            try:
                async with asyncio.timeout(self._stall_s):
                    chunk = await anext(it, None)
            except TimeoutError:
                raise _Stalled from None
            if chunk is None:
                return
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class Proxy:
    """The engines, the upstream client and the metrics of one proxy instance."""

    def __init__(self, config: ProxyConfig, metrics: ClientMetrics | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.metrics = metrics or ClientMetrics(config.router, config.max_models)
        self.prefill = EnginePool(config.prefill, config.policy)
        self.decode = EnginePool(config.decode, config.policy)
        # Deadlines are enforced per leg with asyncio.timeout_at (total, not per read); the client's
        # own timeouts are off so that they cannot cut a long decode stream short. No pool limit
        # below what the engines queue themselves.
        # TCP_NODELAY: httpx writes a request's headers and body separately, and Nagle's algorithm
        # would hold the body back until the engine's delayed ACK (up to 40 ms per leg).
        if transport is None:
            transport = httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.client = httpx.AsyncClient(timeout=None, transport=transport,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self._probes: list[asyncio.Task[None]] = []

    # -- request ---------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        t0 = getattr(request.state, "arrival", None) or time.perf_counter()
        rid = legs.request_id(request.headers)
        headers = {"X-Request-Id": rid}
        body = await self._read_body(request, headers)
        if isinstance(body, Response):
            return body
        stats = self.metrics.request(self._model(body), t0, rid)
        try:
            return await self._serve(request, path, body, rid, headers, stats)
        except LegFailed as e:
            # an engine's 4xx (bad request, prompt over max_model_len, unknown model) is the client's
            # mistake, not the service failing; 408/429/5xx and the proxy's 502/504 are errors
            return TrackedResponse(e.content, e.status, e.media_type, headers, stats, e.outcome)
        except BaseException:
            stats.finish(Outcome.ERROR)
            raise

    @never_raises
    def _model(self, body: dict[str, Any]) -> str:
        return self.metrics.model_label(body.get("model"))

    async def _read_body(self, request: Request, headers: dict[str, str]) -> dict[str, Any] | Response:
        limit = self.config.max_body_bytes
        too_large = JSONResponse(legs.error_body(f"request body over {limit} bytes", "request_too_large", 413),
                                 status_code=413, headers=headers)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            self.metrics.rejected()
            return too_large
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    self.metrics.rejected()
                    return too_large
                parts.append(part)
        except ClientDisconnect:  # gone mid-body, or closed at --request-timeout: no request, and no traceback
            return Response(status_code=499, headers=headers)
        try:
            body = json.loads(b"".join(parts))
            # what the legs cannot send on is the client's mistake, not a 500 counted as the service's error:
            # NaN / Infinity (not JSON, refused by the encoder), a lone surrogate (not UTF-8), nesting past the
            # recursion limit (RecursionError, raised by loads or dumps)
            json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
        except (ValueError, RecursionError) as e:
            body, problem = None, f"request body is not JSON: {type(e).__name__}: {e}"
        else:
            problem = None if isinstance(body, dict) else "request body must be a JSON object"
        if not problem and "stream" in body:
            try:  # one reading of stream for the proxy and the decode engine
                body["stream"] = legs.vllm_bool(body["stream"])
            except ValueError as e:
                problem = str(e)
        if problem:
            self.metrics.rejected(UNKNOWN_MODEL)
            return JSONResponse(legs.error_body(problem, "invalid_request_error", 400), status_code=400,
                                headers=headers)
        return body

    async def _serve(self, request: Request, path: str, body: dict[str, Any], rid: str, headers: dict[str, str],
                     stats: RequestStats) -> Response:
        up = legs.upstream_headers(request.headers, rid)
        streaming = stats.streamed = bool(body.get("stream"))
        leg = await _unless_client_leaves(request, self._prefill_leg(path, body, up))
        if leg is None or await request.is_disconnected():  # the client left during prefill: do not start decode
            stats.finish(Outcome.ABORTED)
            return Response(status_code=499, headers=headers)
        answer, prefill_leg_s = leg
        self.metrics.model_label.admit(body.get("model"))  # an engine served it: a real model
        dec = legs.decode_body(body, answer, streaming)
        if not streaming:
            r = await _unless_client_leaves(
                request, self._whole(self.decode, "decode", path, dec, up, self.config.decode_timeout_s))
            if r is None:
                stats.finish(Outcome.ABORTED)
                return Response(status_code=499, headers=headers)
            if r.status_code != 200:
                raise LegFailed.engine_answer(r, "decode")
            if await request.is_disconnected():
                # the client left during decode: the server's send would vanish without an error,
                # and the answer nobody read was counted ok with an e2e time
                stats.finish(Outcome.ABORTED)
                return Response(status_code=499, headers=headers)
            # an answer the decode engine aborted (shutdown, fault, /pause) is a 200 cut short, the service's failure
            outcome = Outcome.ERROR if legs.aborted_answer(r.content) else Outcome.OK
            return TrackedResponse(r.content, 200, r.headers.get("content-type"), headers, stats, outcome)
        return await self._open_stream(path, dec, up, headers, stats, legs.wants_usage(body), prefill_leg_s)

    async def _prefill_leg(self, path: str, body: dict[str, Any], up: dict[str, bytes]) -> tuple[dict, float]:
        sent = time.perf_counter()
        r = await self._whole(self.prefill, "prefill", path, legs.prefill_body(body), up,
                              self.config.prefill_timeout_s)
        leg_s = time.perf_counter() - sent
        if r.status_code != 200:
            raise LegFailed.engine_answer(r)
        return r.json(), leg_s  # a JSON object: _whole checked it

    async def _whole(self, pool: EnginePool, leg: str, path: str, body: dict[str, Any], up: dict[str, bytes],
                     timeout_s: float) -> httpx.Response:
        """One upstream call read to its end, under the leg's total deadline. vLLM sends a whole answer's headers
        with its body, so a body silent for the stall bound after them is an engine that stalled (it waited out
        the whole deadline, and was taken as up on its headers); the engine is judged once the body is in."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        resp, lease = await self._call(pool, leg, path, body, up, deadline, timeout_s, judge_on_body=True)
        stall_s = self.config.decode_stall_timeout_s
        resp.stream = _StallBound(resp.stream, stall_s)
        try:
            async with asyncio.timeout_at(deadline):
                await resp.aread()
            if resp.status_code == 200:
                if not legs.is_json_object(resp.content):
                    # vLLM's whole answers are JSON objects: one cut short behind a hop, or delimited by the
                    # connection's close (no Content-Length), is a process that died mid-body. Relayed as a 200 it
                    # was counted ok; it is judged as a broken connection is.
                    pool.failed(lease.url, "a 200 whose body is not a JSON object (cut short)")
                    raise self._leg_error(502, "upstream_invalid", f"{leg} answer is not a JSON object (cut short)",
                                          leg, lease.url)
                pool.answered(lease.url)
            return resp
        except TimeoutError:
            raise self._leg_error(504, "upstream_timeout", f"{leg} leg passed its {timeout_s:g} s deadline",
                                  leg, lease.url) from None
        except _Stalled:
            pool.failed(lease.url, f"{leg} answer silent for {stall_s:g} s after its headers")
            raise self._leg_error(504, "upstream_timeout", f"{leg} engine sent nothing for {stall_s:g} s (stalled)",
                                  leg, lease.url) from None
        except httpx.HTTPError as e:
            pool.failed(lease.url, f"{type(e).__name__} in its answer")
            raise self._leg_error(502, "upstream_unreachable", f"{leg} engine unreachable: {type(e).__name__}: {e}",
                                  leg, lease.url) from None
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            lease.release()

    async def _call(self, pool: EnginePool, leg: str, path: str, body: dict[str, Any], up: dict[str, bytes],
                    deadline: float, timeout_s: float, judge_on_body: bool = False) -> tuple[httpx.Response, Lease]:
        """An upstream call opened (status and headers; a non-200 answer read whole) under ``deadline``, and the
        lease of the engine that answered. An engine that refused the connection or answered 503 (vLLM's admission
        control) never started the request, so the call moves to another engine of the pool, within the same
        deadline: the client has seen nothing yet, and the time lost stays in its TTFT. A call that broke or
        timed out is not repeated (the engine may have started it); the engine is left out for the next ones.
        A 200 is no verdict yet (``judge_on_body``): vLLM sends a stream's before the first token, so an engine that
        stalls after it came back from its time out with every probe; its body judges it (``DecodeStream``,
        ``_whole``)."""
        loop = asyncio.get_running_loop()
        tried: list[str] = []
        while True:
            lease = pool.acquire(tried)
            tried.append(lease.url)
            resp = None
            try:
                req = self.client.build_request("POST", lease.url + path, json=body, headers=up)
                async with asyncio.timeout_at(deadline):
                    resp = await self.client.send(req, stream=True)
                    if resp.status_code != 200:
                        await resp.aread()
            except BaseException as e:
                with anyio.CancelScope(shield=True):
                    if resp is not None:
                        await resp.aclose()
                lease.release()
                if isinstance(e, TimeoutError):
                    if resp is None:  # not even a status line: the engine is stuck (sleeping, paused, hung)
                        pool.failed(lease.url, f"no answer within the {leg} leg's {timeout_s:g} s deadline")
                    raise self._leg_error(504, "upstream_timeout", f"{leg} leg passed its {timeout_s:g} s deadline",
                                          leg, lease.url) from None
                if isinstance(e, httpx.HTTPError):
                    pool.failed(lease.url, f"{type(e).__name__}: {e}")
                    if isinstance(e, httpx.ConnectError) and pool.another(tried) and loop.time() < deadline:
                        continue
                    raise self._leg_error(502, "upstream_unreachable",
                                          f"{leg} engine unreachable: {type(e).__name__}: {e}", leg,
                                          lease.url) from None
                raise
            if resp.status_code != 503:
                # a 5xx is no sign of an engine up: vLLM answers 500 once its engine core is dead (EngineDeadError,
                # while /health says 503), and that 500 used to lift the hold a failed probe put on, sending the next
                # requests there until the next probe. Not a failure either: a 500 may be one request's own
                # (EngineGenerateError), and one client's bad request must not take engines out in turn.
                if resp.status_code < 500 and not (judge_on_body and resp.status_code == 200):
                    pool.answered(lease.url)
                return resp, lease
            pool.failed(lease.url, "answered 503")
            if not (pool.another(tried) and loop.time() < deadline):
                return resp, lease  # the client gets the engine's 503
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            lease.release()

    @staticmethod
    def _leg_error(status: int, kind: str, message: str, leg: str, engine: str) -> LegFailed:
        log.warning("%s (engine %s)", message, display_url(engine))
        return LegFailed.proxy_error(status, kind, message, leg, engine)

    async def _open_stream(self, path: str, dec: dict[str, Any], up: dict[str, bytes], headers: dict[str, str],
                           stats: RequestStats, want_usage: bool, prefill_leg_s: float) -> Response:
        timeout_s = self.config.decode_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        sent = time.perf_counter()  # decode_first_leg spans every engine tried
        resp, lease = await self._call(self.decode, "decode", path, dec, up, deadline, timeout_s, judge_on_body=True)
        if resp.status_code != 200:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            lease.release()
            raise LegFailed.engine_answer(resp, "decode")
        stall_s = self.config.decode_stall_timeout_s
        first_s = max(self.config.prefill_timeout_s, stall_s)  # queue and KV pull: as long as a prefill may take
        ds = DecodeStream(resp, lease, stats, deadline, want_usage, sent, prefill_leg_s, self.decode, first_s, stall_s)
        media = resp.headers.get("content-type") or "text/event-stream"
        return RelayResponse(ds, headers, media)

    # -- active health -----------------------------------------------------------------------------
    def start_probes(self) -> None:
        """On the running loop, one task per engine of each pool, so that no probe waits on another engine's
        (a hung engine's takes its whole --health-timeout). Off with --health-interval 0."""
        if self.config.health_interval_s > 0 and not self._probes:
            self._probes = [asyncio.create_task(self._probe_forever(pool, url), name=f"health {display_url(url)}")
                            for pool in (self.prefill, self.decode) for url in pool.urls]

    async def _probe_forever(self, pool: EnginePool, url: str) -> None:
        while True:
            try:
                await self.probe(pool, url)
            except Exception:  # a bug here must not end the engine's probing for good
                log.exception("/health probe of %s failed", display_url(url))
            await asyncio.sleep(self.config.health_interval_s)

    async def probe(self, pool: EnginePool, url: str) -> None:
        """GET ``url``/health under --health-timeout. vLLM answers 200 unless its engine core is dead (503); a
        refusal, a broken call, no answer or another 5xx is down too. 501 (not implemented), 404, 401 say nothing
        of the engine: no verdict (unknown is never up)."""
        timeout_s = self.config.health_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                r = await self.client.get(url + "/health")
        except TimeoutError:
            pool.probe_failed(url, f"no answer within {timeout_s:g} s")
        except httpx.HTTPError as e:
            pool.probe_failed(url, f"{type(e).__name__}: {e}")
        else:
            if r.status_code == 200:
                pool.probe_ok(url)
            elif r.status_code >= 500 and r.status_code != 501:
                pool.probe_failed(url, f"answered {r.status_code}")
            else:
                pool.probe_unknown(url, f"answered {r.status_code}")

    async def stop_probes(self) -> None:
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        self._probes = []

    # -- the rest ----------------------------------------------------------------------------------
    def readiness(self) -> dict[str, Any]:
        """Can this proxy serve a request now: is an engine of each pool in service (``EnginePool.service``)? A proxy
        whose pool has none (its engines dead, or out of its reach: a partition of its node) fails every request; a
        readiness probe on /readyz takes it out of the load balancer while replicas that reach their engines serve."""
        probed = self.config.health_interval_s > 0
        pools = {name: pool.service(probed) for name, pool in (("prefill", self.prefill), ("decode", self.decode))}
        empty = [name for name, engines in pools.items() if not any(ok for ok, _ in engines.values())]
        out: dict[str, Any] = {"status": "not_ready" if empty else "ready", "router": self.config.router}
        if empty:
            out["reason"] = f"no {' or '.join(empty)} engine in service"
        for name, engines in pools.items():
            out[name] = _shown({u: {"in_service": ok, "why": why} for u, (ok, why) in engines.items()})
        return out

    def health(self) -> dict[str, Any]:
        """Liveness: answered (200) while the process serves; ``status`` says whether it is ready (see readiness)."""
        ready = self.readiness()
        return {"status": "ok" if ready["status"] == "ready" else "not_ready", "ready": ready["status"] == "ready",
                **({"reason": ready["reason"]} if "reason" in ready else {}),
                "router": self.config.router, "policy": self.config.policy,
                "in_flight": {"prefill": _shown(self.prefill.in_flight()), "decode": _shown(self.decode.in_flight())},
                "left_out": {"prefill": _shown(self.prefill.ejected()), "decode": _shown(self.decode.ejected())},
                "probes": {"interval_s": self.config.health_interval_s,
                           "prefill": _shown(self.prefill.probes()), "decode": _shown(self.decode.probes())}}

    async def aclose(self) -> None:
        await self.stop_probes()
        await self.client.aclose()
        if self.metrics.otel is not None:  # send the last spans
            self.metrics.otel.shutdown()


async def _unless_client_leaves(request: Request, call: Awaitable[T]) -> T | None:
    """``call``'s result, or None when the client hangs up first. ``call`` is then cancelled, which closes its
    upstream connection, and vLLM aborts a request whose connection closes: without this a client gone
    during a non-streamed decode left the engine generating the whole answer, up to the decode deadline."""
    task = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not task.done()
        if left:
            task.cancel()
    if not left:
        return task.result()
    await asyncio.wait((task,))  # its clean-up (lease released, connection closed) is done
    return None


async def _client_gone(request: Request) -> None:
    """Returns once the client has hung up: its body is read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _shown(per_engine: dict[str, T]) -> dict[str, T]:
    return {display_url(u): n for u, n in per_engine.items()}


class ArrivalStamp:
    """ASGI middleware, outermost: stamps each request's arrival before any routing, so the
    client's TTFT starts when its request reaches the proxy, not when a handler first runs."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = time.perf_counter()
        await self.app(scope, receive, send)


def build_app(config: ProxyConfig, metrics: ClientMetrics | None = None,
              transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    proxy = Proxy(config, metrics, transport)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        proxy.start_probes()
        yield
        await proxy.aclose()

    app = FastAPI(title="sla-guard-proxy", summary="P/D proxy for vLLM measuring the client scope",
                  lifespan=lifespan)
    app.state.proxy = proxy
    app.add_middleware(ArrivalStamp)

    def route(path: str):
        async def completions(request: Request) -> Response:
            return await proxy.handle(request, path)

        return completions

    for path in PATHS:
        app.add_api_route(path, route(path), methods=["POST"], response_model=None)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(proxy.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return proxy.health()

    @app.get("/readyz")
    async def ready() -> JSONResponse:
        body = proxy.readiness()
        return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)

    return app
