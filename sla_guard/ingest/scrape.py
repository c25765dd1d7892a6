"""Embedded mode: scrape every engine's /metrics into the guard's ``SeriesStore``.

asyncio + httpx with a concurrency limit and a response-size limit enforced while streaming (a
page over the limit is abandoned, not buffered). ``timeout_s`` is a *total* deadline per target
and round -- waiting for a concurrency slot, connect, headers and body together -- so a target
that trickles its page a byte a second fails as ``timeout`` and a round never outlasts
``timeout_s``, whatever its slowest member does. Each scrape is
stamped with its start time, as Prometheus does. A failed scrape (refused, timeout, non-200,
too large, unparsable) writes ``up=0`` and a staleness marker for the target, counts
``guard_scrape_errors{target,kind}``, and the next round simply tries again: recovery needs
nothing. Per-sample problems (NaN, duplicates, series or label limits) are counted with their
kind while the rest of the page is stored, unless a limit refused a series of the SLOs' latency
histograms: that scrape failed (``series_limit`` / ``label_limit``). A target removed from
discovery goes stale and its series are freed once no window reads them. A target with
``adapter:`` (a P/D router's own page: Dynamo, llm-d, production-stack) is translated onto the
contract's client scope (``exporters.routers``) before it is stored; other targets keep the fast
text path. A page that carries vLLM's own series beside the contract's is checked for a hook
that stopped recording (``_hook_stalled``): vLLM counting generated tokens while the hook's
counters stand still is a failed scrape of kind ``hook_stalled``, since that target's contract
data is frozen, not idle.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import httpx

from exporters import contract as c
from exporters.page_read import ACCEPT_ENCODING, PageNotText, PageTooLarge, read_page
from exporters.prometheus import ContractMetrics
from exporters.redact import redact_text, redact_url
from exporters.routers import translate
from sla_guard.config import ScrapeSource as ScrapeConfig
from sla_guard.config import Target
from sla_guard.exposition import ExpositionError, parse_exposition
from sla_guard.ingest.discovery import TargetDiscovery
from sla_guard.ingest.source import UP, TargetState
from sla_guard.store import IngestResult, SeriesStore

log = logging.getLogger("sla_guard.ingest.scrape")

ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"


class ScrapeFailed(Exception):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


_INDICATOR_COUNTS = frozenset({c.CLIENT_TTFT.series("_count"), c.CLIENT_TPOT.series("_count")})
# the series whose (model, pool) make a pool the SLOs judge, engine and client scope
_POOL_COUNTS = tuple(sorted({c.latency_metric(ind, scope).series("_count") for ind in ("ttft", "tpot")
                             for scope in (None, c.Pool.CLIENT)}))
# the series the SLOs are computed from: a page whose limits refused one of these is a failed
# scrape (as Prometheus fails one over its sample_limit), not a pool judged without them
_JUDGED = frozenset(c.latency_metric(ind, scope).series(part) for ind in ("ttft", "tpot")
                    for scope in (None, c.Pool.CLIENT) for part in ("_bucket", "_count", "_sum"))


# why a page that lost (or broke) series of the SLOs' histograms is a failed scrape, and the fix;
# the limits' messages are completed by ``Scraper._limit_fix`` with the limit that was hit
_REFUSED = {
    "series_limit": ("series limit reached: series of {} not stored", ""),
    "label_limit": ("label limit reached: series of {} not stored", ""),
    "non_finite": ("a NaN or +-Inf value in {} (a histogram's counts and sum are finite numbers)",
                   "fix the exporter's /metrics; the page is refused until then"),
    "out_of_order": ("a sample of {} stamped older than the last one of its series (a cache serving an older page?)",
                     "serve the current page; Prometheus drops such samples as out of order"),
}


def _router_models(mapped: list[tuple[str, dict[str, str], float]], fallback: str) -> frozenset[str]:
    """The models a router's translated page speaks for, for its ``up``: those with TTFT or TPOT
    data (the SLOs' pools), else any it labels, else the target's own. Not every model label:
    the EPP's comes from the request body, so a client's misspelt model (a 404 with an e2e time
    and no first token) would become a pool without data, unknown, holding the verdict."""
    judged = frozenset(lab["model"] for n, lab, _ in mapped if n in _INDICATOR_COUNTS)
    return judged or frozenset(lab["model"] for _, lab, _ in mapped) or frozenset({fallback})


class Scraper:
    """``Source`` for the embedded mode. ``collect(now)`` scrapes all targets once."""

    mode = "scrape"

    def __init__(self, cfg: ScrapeConfig, store: SeriesStore, *, clock: Callable[[], float] = time.time,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.view = store
        self.clock = clock
        self.discovery = TargetDiscovery(cfg.targets, cfg.targets_file)
        self._state: dict[str, TargetState] = {}
        self._sem = asyncio.Semaphore(cfg.concurrency)
        self._client = httpx.AsyncClient(
            transport=transport, headers={"Accept": ACCEPT, "Accept-Encoding": ACCEPT_ENCODING}, follow_redirects=False,
            limits=httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency),
        )
        self._metrics: ContractMetrics | None = None
        # adapter targets: the models the router's page carried at its last good scrape
        self._router_models: dict[str, frozenset[str]] = {}
        # honor_labels targets: the (instance, model, pool) of the SLOs' series their page carried at
        # its last good scrape
        self._page_pools: dict[str, frozenset[tuple[str, ...]]] = {}
        self._gauged: dict[str, set[tuple[str, str]]] = {}  # target -> its guard_target_up (model, pool)s
        # per target: recent good scrapes' (time, vLLM's token counter, the hook's counters)
        self._liveness: dict[str, collections.deque] = {}
        self._stalled: dict[str, tuple[list, str]] = {}  # target -> (the hook's counters then, why)
        self.rounds = 0
        self._discovery_counted = 0  # discovery.errors already added to guard_scrape_errors

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        self._metrics = metrics

    # -- Source --------------------------------------------------------------------------------
    async def collect(self, now: float | None = None) -> None:
        targets = self.discovery.targets()
        if self._metrics is not None and (n := self.discovery.errors - self._discovery_counted):
            # a broken targets file keeps the old list: without this only the log said so
            self._metrics[c.GUARD_SCRAPE_ERRORS].labels("targets_file", "discovery").inc(n)
            self._discovery_counted += n
        names = {self._name(t) for t in targets}
        # a removed target's series go stale now and are freed once no window reads them
        keep = min(self.store.retention_s, self.store.slots * self.cfg.interval_s)
        for gone in set(self._state) - names:  # removed from discovery: forget it
            st = self._state.pop(gone)
            self._router_models.pop(gone, None)
            self._page_pools.pop(gone, None)
            self._liveness.pop(gone, None)
            self._stalled.pop(gone, None)
            t_gone = self.clock() if now is None else now
            self.store.retire(gone, t_gone, keep)
            self.store.retire(gone + "#up", t_gone, keep)
            if self._metrics is not None:
                for model, pool in self._gauged.pop(gone, {(st.model, st.pool)}):
                    with contextlib.suppress(KeyError):
                        self._metrics[c.GUARD_TARGET_UP].remove(st.name, model, pool)
        # one deadline for the whole round: a target still queued or still reading then is failed
        deadline = asyncio.get_running_loop().time() + self.cfg.timeout_s
        await asyncio.gather(*(self._scrape_guarded(t, deadline) for t in targets))
        self.rounds += 1

    def targets(self) -> list[TargetState]:
        return [self._state[k] for k in sorted(self._state)]

    def ready(self) -> bool:
        return self.rounds > 0

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- one target ----------------------------------------------------------------------------
    @staticmethod
    def _name(t: Target) -> str:
        """The target's name, else its URL redacted: the name is a label on the unauthenticated
        /metrics and in /v1/targets, so a password or ?token= in the URL must not reach it."""
        return t.name or redact_url(t.url)

    async def _scrape_guarded(self, target: Target, deadline: float) -> None:
        try:
            await self.scrape_target(target, deadline=deadline)
        except Exception:  # never let one target's surprise kill the round
            log.exception("scraping target %s", self._name(target))

    async def scrape_target(self, target: Target, t: float | None = None, *,
                            deadline: float | None = None) -> TargetState:
        """Scrape one target now (or stamp it ``t``) and store what it served; ``deadline``
        (event-loop time) defaults to now + ``timeout_s``."""
        name = self._name(target)
        st = self._state.get(name)
        if st is None:
            st = self._state[name] = TargetState(name, redact_url(target.url), target.model, target.pool)
        # the configured model/pool win over the page's unless the target honors page labels
        labels = {"instance": name, "model": target.model, "pool": target.pool}
        honor = getattr(target, "honor_labels", False)  # Target.honor_labels (config.py); False: ours win
        t0 = time.perf_counter()
        # to the millisecond, as the store keeps it: unrounded, a stamp rounded up by the store lay
        # after ``ts``, and ``_hook_stalled``'s read at ``ts`` got the previous scrape's values
        ts = round(self.clock() if t is None else t, 3)
        try:
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.cfg.timeout_s
            text = await self._fetch(target.url, deadline)
            if target.adapter is None:
                res = self.store.ingest_text(text, ts, labels, group=name, honor_labels=honor)
            else:  # a router's own page: only its client-scope translation is stored
                res = self._ingest_router(text, ts, name, target)
            if res.errors.get("parse"):  # the line that broke it: the pool's reason shows it
                why = res.parse_error.removeprefix("malformed exposition: ")
                raise ScrapeFailed("parse", f"malformed exposition{': ' + why if why else ''} "
                                            f"(fix the exporter's /metrics)")
            if judged := sorted(n for n in res.limited if n in _JUDGED):
                kind = res.limited[judged[0]]
                what, fix = _REFUSED.get(kind, _REFUSED["label_limit"])
                raise ScrapeFailed(kind, f"{what.format(', '.join(judged[:3]))}, so its pool cannot be judged; "
                                         f"{fix or self._limit_fix(kind)}")
            if honor and target.adapter is None:
                found = self.store.scraped_label_values(name, _POOL_COUNTS, ("instance", "model", "pool"))
                self._page_pools[name] = frozenset(k for k in found if all(k))
            if target.adapter is None and (why := self._hook_stalled(name, ts, honor)):
                raise ScrapeFailed("hook_stalled", why)
        except Exception as raised:
            # anything else the page made the parser or store raise is a failed scrape too, not a
            # target left up with its last data and no error (a bare ValueError once did that)
            err = raised if isinstance(raised, ScrapeFailed) else ScrapeFailed(
                "internal", f"{type(raised).__name__}: {raised}")
            if not isinstance(raised, ScrapeFailed):
                log.exception("scraping target %s", name)
            if err.kind != "hook_stalled":  # a stall is judged across good scrapes only
                self._liveness.pop(name, None)
                self._stalled.pop(name, None)
            st.up = False
            st.last_error = redact_text(f"{err.kind}: {err}")  # httpx errors can quote the URL
            st.errors[err.kind] = st.errors.get(err.kind, 0) + 1
            self._count(name, err.kind)
            self.store.mark_stale(name, ts)
            self._up(name, target, ts, 0.0)
        else:
            st.up = True
            st.last_error = None
            st.samples = res.samples
            for kind, n in res.errors.items():  # page stored, some samples dropped
                st.errors[kind] = st.errors.get(kind, 0) + n
                self._count(name, kind, n)
            self._up(name, target, ts, 1.0)
        st.last_scrape = ts
        st.last_duration_s = time.perf_counter() - t0
        return st

    def _by_engine(self, metric: str, name: str, ts: float, instances: Iterable[str]) -> dict[str, float]:
        """``metric`` summed per engine of the target's page (``<instance>/<engine>`` where an
        ``honor_labels`` page names its engines' own instance)."""
        out: dict[str, float] = {}
        for inst in instances:
            for lab, v in self.store.instant(metric, {"instance": inst}, ts).items():
                e = dict(lab).get("engine", "")
                e = e if inst == name else f"{inst}/{e}"
                out[e] = out.get(e, 0.0) + v
        return out

    def _hook_stalled(self, name: str, ts: float, honor: bool = False) -> str | None:
        """Why the target's hook stopped recording, or None. vLLM's token counter (on the same page)
        rising between two scrapes while a counter of the hook's stays the same (or absent for that
        engine) from the first of them through this one means the hook missed steps vLLM recorded:
        its logger was dropped (vLLM's elastic-EP rebuild builds its loggers again without plugins)
        or its record() fails. The hook's counters may lag vLLM's by one flush interval, so vLLM's
        rise must end at least ``HOOK_LAG_S`` before this scrape. Once stalled, the target stays so
        until a hook counter moves (an engine that goes idle after the stall still has frozen
        series). An idle engine moves neither; a page without vLLM's series (the sidecar, the
        simulator) is not checked."""
        # an honor_labels page (an aggregator) may carry its engines' own instance: read under those
        # (under the target's name alone, the check found no vLLM series and never judged such a page)
        instances = sorted({i for (i,) in self.store.scraped_label_values(name, (c.VLLM_GENERATION_TOKENS,),
                                                                           ("instance",)) if i} or {name}) \
            if honor else [name]
        witness = self._by_engine(c.VLLM_GENERATION_TOKENS, name, ts, instances)
        if not witness:
            self._liveness.pop(name, None)
            self._stalled.pop(name, None)
            return None
        hist = self._liveness.setdefault(name, collections.deque())
        hist.append((ts, witness, [self._by_engine(m.series(), name, ts, instances) for m in c.HOOK_RECORDED]))
        held = self._stalled.get(name)
        if held is not None:
            if held[0] == hist[-1][2]:
                while len(hist) > 1:  # nothing is judged while held: kept, they grew for as long as the stall
                    hist.popleft()
                return held[1]
            del self._stalled[name]  # the hook records again (a restart): judged afresh
        while len(hist) > 2 and ts - hist[2][0] >= c.HOOK_LAG_S:  # keep one pair at least HOOK_LAG_S back
            hist.popleft()
        if len(hist) < 3 or ts - hist[1][0] < c.HOOK_LAG_S:
            return None
        (t0, w0, _), (t1, w1, _) = hist[0], hist[1]
        for e, v1 in sorted(w1.items()):
            v0 = w0.get(e)
            rose = v1 - v0 if v0 is not None and v1 >= v0 else v1  # a reset (vLLM's loggers rebuilt) counts from 0
            if rose <= 0:
                continue
            for i, m in enumerate(c.HOOK_RECORDED):
                if not any(h[2][i] for h in hist):
                    continue  # the hook does not export this one (an older plugin): not evidence
                if len({h[2][i].get(e) for h in hist}) == 1:
                    # the conclusion first: a pool's reason shows this message's start and end
                    why = (f"the hook stopped recording: vLLM generated {rose:g} tokens on engine {e!r} between "
                           f"{t0:.0f} and {t1:.0f} ({c.VLLM_GENERATION_TOKENS}) but the sla-guard hook's "
                           f"{m.series()} did not move through {ts:.0f} (its stat logger dropped, e.g. by an "
                           f"elastic-EP rebuild, or its record() failing: see {c.HOOK_ERRORS.series()}); this "
                           f"target's contract data is frozen, not idle")
                    self._stalled[name] = (hist[-1][2], why)
                    return why
        return None

    def _ingest_router(self, text: str, ts: float, name: str, target: Target) -> IngestResult:
        """A router page (``target.adapter``) -> contract client-scope samples -> the store.
        The router's model label wins (a router serves several models); the target's model
        stands in where the router has none. A page with samples but nothing the adapter knows
        is counted as ``adapter_no_match`` (wrong adapter, or a renamed family)."""
        try:
            samples, _ = parse_exposition(text)
        except ExpositionError as err:
            res = IngestResult(parse_error=str(err))
            res.errors["parse"] += 1
            return res
        mapped = translate(samples, target.adapter, default_model=target.model)
        self._router_models[name] = _router_models(mapped, target.model)
        res = self.store.ingest_samples(mapped, ts, {"instance": name, "pool": target.pool}, group=name,
                                        honor_labels=True)
        if samples and not mapped:
            res.errors["adapter_no_match"] += 1
        return res

    async def _fetch(self, url: str, deadline: float) -> str:
        """The page at ``url``, complete before ``deadline`` (event-loop time), or ScrapeFailed.
        httpx's own timeout bounds each read; ``asyncio.timeout_at`` bounds the total."""
        try:
            async with asyncio.timeout_at(deadline):
                async with self._sem:
                    return await self._fetch_now(url)
        except TimeoutError as err:
            raise ScrapeFailed("timeout", f"no complete answer within {self.cfg.timeout_s:g}s") from err

    async def _fetch_now(self, url: str) -> str:
        limit = self.cfg.max_body_bytes
        try:
            async with self._client.stream("GET", url, timeout=self.cfg.timeout_s) as resp:
                if resp.status_code != 200:
                    raise ScrapeFailed("http_status", f"HTTP {resp.status_code}")
                return await read_page(resp, limit)
        except PageTooLarge as err:
            raise ScrapeFailed("too_large", f"{err}; raise source.max_body_bytes ({limit}) or make the page "
                                            f"smaller") from err
        except PageNotText as err:
            raise ScrapeFailed("parse", str(err)) from err
        except httpx.TimeoutException as err:
            raise ScrapeFailed("timeout", f"no answer within {self.cfg.timeout_s}s") from err
        except httpx.ConnectError as err:
            raise ScrapeFailed("connect", str(err) or "connection refused") from err
        except httpx.HTTPError as err:
            raise ScrapeFailed("http", f"{type(err).__name__}: {err}") from err

    def _limit_fix(self, kind: str) -> str:
        """The limit a refused series hit and the field that raises it (``series_limit``: the
        store's, when it is full, else the target's; ``label_limit``: either label bound)."""
        st = self.store
        if kind == "series_limit":
            if st.series_count() >= st.max_series:
                return (f"the store holds retention.max_series ({st.max_series}) series: raise it, "
                        f"or stop the label churn it counts")
            return (f"the target's page has more than retention.max_series_per_target ({st.max_series_per_group}) "
                    f"series: raise it, or drop series from the page")
        return (f"more than retention.max_labels_per_series ({st.max_labels}) labels on a series (raise it, "
                f"or drop labels) or a label value over {st.max_label_value_len} characters (shorten it)")

    def _up(self, name: str, target: Target, ts: float, value: float) -> None:
        """``up`` in the store (own group, so the target's staleness marker does not hide its
        up=0) for each (model, pool) the target speaks for: a router's page carries its own
        models, and an ``up`` under the target's model alone made every other model's pool
        look target-less (unknown, then forgotten) and the target's model a pool without data.
        An ``honor_labels`` page (an aggregator) speaks for its own pools, and its engines may carry
        their own ``instance``: ``up`` goes under each (instance, model, pool) its last good page
        carried, since its up=0 under its configured pool alone left the others judged "ok" on
        their remaining targets. Its configured (or default) model/pool is no pool of its own: up=1
        there made a pool without data, unknown for ever. It stands in for the target's pools only
        until a good page has named them (down from the start: unknown, never "ok").
        ``guard_target_up`` carries the same (model, pool)s."""
        if target.adapter is not None:
            models = self._router_models.get(name) or {target.model}
            keys = {(name, model, target.pool) for model in models}
        else:
            keys = self._page_pools.get(name) or {(name, target.model, target.pool)}
        for instance, model, pool in sorted(keys):
            self.store.append(UP, {"instance": instance, "model": model, "pool": pool}, ts, value,
                              group=name + "#up", limited=False)
        if self._metrics is not None:
            gauge = self._metrics[c.GUARD_TARGET_UP]
            pools = {(model, pool) for _, model, pool in keys}
            for model, pool in self._gauged.get(name, set()) - pools:  # pools its page no longer carries
                with contextlib.suppress(KeyError):
                    gauge.remove(name, model, pool)
            self._gauged[name] = pools
            for model, pool in sorted(pools):
                gauge.labels(name, model, pool).set(value)

    def _count(self, name: str, kind: str, n: int = 1) -> None:
        if self._metrics is not None:
            self._metrics[c.GUARD_SCRAPE_ERRORS].labels(name, kind).inc(n)
