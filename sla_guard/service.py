"""The Guard: collect samples, run every evaluator on them, keep the result for the API.

One tick = ``tick(now)``: run each ``Evaluator`` (SLOs, detectors, advisor) on the source's
``MetricsView`` at time ``now``. Evaluators are isolated from each other: an exception escaping
one is logged, counted in ``guard_evaluator_errors{evaluator}``, and the others still run. The
same ``tick`` serves ``sla-guard check`` (one tick now), tests, and the simulator's offline
replay (ticks at simulated time over a ``StoreSource``); ``run`` is the asyncio loop of
``sla-guard serve`` (collect every scrape interval, tick every evaluation interval).

Evaluators that want to export gauges on the guard's own ``/metrics`` define
``bind_metrics(metrics: ContractMetrics)``; the Guard calls it once with its
``ContractMetrics`` (the contract's GUARD component on the guard's own CollectorRegistry).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from exporters import contract as c
from exporters.contract import Component
from exporters.prometheus import ContractMetrics
from sla_guard.config import GuardConfig
from sla_guard.ingest.source import Source, StoreSource
from sla_guard.model import Evaluator, MetricsView
from sla_guard.state import Stateful, StateStore

log = logging.getLogger("sla_guard.service")
# ``check --wait``: a wait over this scrapes a third time, this long before the last, so that the
# scraper can see a stalled hook (HOOK_LAG_S, plus slack: the scrapes are stamped by the wall clock)
CHECK_STALL_WAIT_S = c.HOOK_LAG_S + 0.25


@dataclass(slots=True)
class TickResult:
    """Outcome of one tick: when, how long, and which evaluators failed (name -> error)."""

    at: float
    duration_s: float
    errors: dict[str, str] = field(default_factory=dict)


class Guard:
    """Runs evaluators over a source. ``sla_guard.compose.compose`` builds the configured one
    (source, SLOs, detectors, advisor); or pass the parts (``Guard(config, source, evaluators,
    registry)``) to plug in your own."""

    def __init__(self, config: GuardConfig, source: Source, evaluators: Sequence[Evaluator] = (),
                 registry: CollectorRegistry | None = None, *, clock: Callable[[], float] = time.time,
                 state: StateStore | None = None, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.source = source
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ContractMetrics(self.registry, components=(Component.GUARD,))
        self.clock = clock
        # elapsed time (verdict age, the loop's schedule) is measured on ``monotonic``: the wall
        # clock can be stepped (NTP, a VM resumed), and a step back made old verdicts read fresh
        self.monotonic = monotonic
        self.evaluators: list[Evaluator] = []
        self.last_tick: TickResult | None = None
        self.ticks = 0
        self.started_at = clock()
        self._started_mono = monotonic()
        self._last_tick_mono: float | None = None  # ``monotonic`` when the last completed tick began
        self.expired_at: float | None = None
        self._expired_ticks = -1  # ``ticks`` when verdicts were last expired
        self._clock_behind = False  # the wall clock is before the last evaluation (stepped back)
        # crash-safe state (sla_guard.state): restored into each component as it is added,
        # saved after every tick; None: nothing persists
        self.state = state
        self._saved: dict[str, dict] = state.load() if state is not None else {}
        self._stateful: dict[str, Stateful] = {}
        self._full_save = True
        self._full_at: float | None = None  # when the last full save committed
        self._unsaved: dict[str, list[dict]] = {}
        self.last_persist_ms: float | None = None
        for ev in evaluators:
            self.add_evaluator(ev)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def for_store(cls, config: GuardConfig, store, evaluators: Sequence[Evaluator] = (),
                  registry: CollectorRegistry | None = None, *, with_slo: bool = True) -> Guard:
        """A guard over a store filled from outside (the simulator's replay, benchmarks)."""
        from sla_guard.slo import SLOEvaluator

        evs: list[Evaluator] = [SLOEvaluator(config)] if with_slo else []
        return cls(config, StoreSource(store), [*evs, *evaluators], registry)

    def add_evaluator(self, ev: Evaluator) -> None:
        """Add ``ev``; if it is ``Stateful`` and a state file is open, restore it first."""
        bind = getattr(ev, "bind_metrics", None)
        if callable(bind):
            bind(self.metrics)
        if isinstance(ev, Stateful):
            self.add_state(ev.name, ev)
        self.evaluators.append(ev)

    # -- crash-safe state ----------------------------------------------------------------------
    def add_state(self, name: str, component: Stateful) -> None:
        """Persist ``component`` under ``name`` (evaluators are added by their name; the findings
        book, which is not an evaluator, registers itself here) and restore it now from the
        state file. A component that fails to restore starts empty: logged, never fatal. One with
        ``bind_state(store, name)`` (the Alertmanager publisher, the advisor) is handed the store
        too: it writes what it is about to send before sending it (a save after the tick is too
        late for a crash in between)."""
        self._stateful[name] = component
        if self.state is None:
            return
        bind = getattr(component, "bind_state", None)
        if callable(bind):
            bind(self.state, name)
        self._restore(name, component, self._saved.pop(name, {}), "it starts empty")

    def _restore(self, name: str, component: Stateful, parts: dict, otherwise: str) -> None:
        """``component.state_load`` with its saved parts and the tail of its records; a failure is
        logged (``otherwise`` says what the component keeps), never raised."""
        tail = getattr(component, "state_tail", 0)
        records = self.state.tail(name, tail) if tail else []
        if not parts and not records:
            return
        try:
            component.state_load(parts, records)
            log.info("state: restored %s (%d parts, %d records)", name, len(parts), len(records))
        except Exception:
            log.exception("state: could not restore %s; %s", name, otherwise)

    def _attach_state(self) -> None:
        """A state file that could not be used at start (read-only, full, held by another guard:
        ``StateStore.detached``) is tried again; once usable, what it holds is restored into every
        component as at a start, on top of what was learned meanwhile (each ``state_load`` merges:
        ledgers bucket by bucket and fed on from the later ``_last_feed``, so no request counts
        twice; open findings of both; the file's detector baselines; advisor memory merged with the
        orders and clocks of meanwhile), and the next save is full. Never a save first: that would
        replace the file's budgets with these."""
        if not self.state.attach():
            return
        saved = self.state.load()
        for name, comp in self._stateful.items():
            self._restore(name, comp, saved.pop(name, {}), "it keeps what it learned")
        self._saved = saved  # components added later restore from it (add_state)
        self._full_save = True

    def persist(self, now: float) -> bool:
        """One transaction with every component's changed parts and new records. A failed save
        makes the next one full (the parts dumped since were never written). So does half the
        store's retention since the last full one: retention deletes parts not written for that
        long, and a part that never changes (a frozen stage baseline, the resolved findings of a
        quiet week) was otherwise only in memory after ``retention_s`` of uptime, lost at the
        next restart."""
        if self.state is None:
            return False
        t0 = time.perf_counter()
        full = self._full_save or self._full_at is None or now - self._full_at >= self.state.retention_s / 2
        parts: dict[str, dict] = {}
        for name, comp in self._stateful.items():
            try:
                parts[name] = comp.state_dump(full)
            except Exception:
                log.exception("state: could not dump %s", name)
            drain = getattr(comp, "state_records", None)
            if callable(drain):
                with contextlib.suppress(Exception):
                    self._unsaved.setdefault(name, []).extend(drain())
        ok = self.state.save(parts, self._unsaved, now)
        if not ok:  # on /metrics too: /v1/status needs the token, alerts need a series
            self.metrics[c.GUARD_STATE_SAVE_ERRORS].inc()
        if ok:
            self._unsaved = {}
        else:  # keep the records, bounded, for the next try
            self._unsaved = {k: v[-4096:] for k, v in self._unsaved.items()}
        self._full_save = not ok
        if ok and full:
            self._full_at = now
        self.last_persist_ms = (time.perf_counter() - t0) * 1e3
        return ok

    def state_status(self) -> dict | None:
        """The state file's health for ``/v1/status`` (moved aside, errors, save cost)."""
        if self.state is None:
            return None
        return {**self.state.status(), "persist_ms": self.last_persist_ms, "components": sorted(self._stateful)}

    def evaluator(self, name: str) -> Evaluator | None:
        return next((e for e in self.evaluators if e.name == name), None)

    # -- one tick ------------------------------------------------------------------------------
    def tick(self, now: float | None = None, *, view: MetricsView | None = None) -> TickResult:
        """Run every evaluator once on the view at ``now`` (default: the clock). Never raises
        for an evaluator's failure. ``view`` overrides the source's view for this tick."""
        now = self.clock() if now is None else float(now)
        mono = self.monotonic()
        if self.state is not None and self.state.detached is not None:
            self._attach_state()  # before the evaluators: no decision on a clock the file would restore
        t0 = time.perf_counter()
        errors: dict[str, str] = {}
        view = self.source.view if view is None else view
        begin = getattr(self.source, "begin_tick", None)
        if callable(begin):  # Prometheus mode: all queries of this tick share one budget
            begin(self.tick_budget_s, now)
        for ev in self.evaluators:
            try:
                ev.evaluate(view, now)
            except Exception as err:  # isolation: one evaluator's bug must not stop the guard
                errors[ev.name] = f"{type(err).__name__}: {err}"
                self.metrics[c.GUARD_EVALUATOR_ERRORS].labels(ev.name).inc()
                log.exception("evaluator %s failed at %.3f", ev.name, now)
                self._expire(ev, f"evaluator {ev.name} failed: {errors[ev.name]}", now)
        dt = time.perf_counter() - t0
        self.metrics[c.GUARD_EVAL_DURATION].observe(dt)
        store = getattr(self.source, "store", None)
        if store is not None:
            self.metrics[c.GUARD_SERIES].set(store.series_count())
            self.metrics[c.GUARD_STORE_BYTES].set(store.nbytes())
        self.last_tick = TickResult(now, dt, errors)
        self._last_tick_mono = mono
        self.ticks += 1
        if self.state is not None:
            self.persist(now)
        return self.last_tick

    @staticmethod
    def _expire(ev: Evaluator, reason: str, now: float) -> None:
        """``ev``'s verdicts unknown (a hold without data: 503 to KEDA) until it evaluates again:
        the staleness watchdog's, and a failed evaluation's, since an evaluator that raised kept
        its previous verdicts while the ticks around it completed (the advisor kept serving KEDA
        its last number, an SLO its last "ok")."""
        expire = getattr(ev, "expire", None)
        if callable(expire):
            try:
                expire(reason, now)
            except Exception:
                log.exception("expiring %s", ev.name)

    async def collect(self, now: float | None = None) -> None:
        """One ingestion round (a scrape of every target in embedded mode)."""
        await self.source.collect(self.clock() if now is None else now)

    async def check_once(self, wait_s: float = 0.0) -> TickResult:
        """What ``sla-guard check`` does. With a Prometheus source: one tick now. With the
        embedded scraper there is no history: ``wait_s > 0`` scrapes at the start and ``wait_s``
        later and evaluates PromQL windows over that; ``wait_s == 0`` scrapes once and judges each
        engine's lifetime (counters since start) through ``LifetimeView``. A wait longer than
        ``CHECK_STALL_WAIT_S`` adds a scrape between them, ``HOOK_LAG_S`` (and slack) before the
        last: the scraper's ``hook_stalled`` check needs three good scrapes, the last that far after
        the second, and with two a frozen hook read as an idle engine. It costs one scrape, no time."""
        if self.source.mode != "scrape":
            await self.collect()
            return self.tick()
        await self.collect()
        if wait_s > 0:
            loop = asyncio.get_running_loop()
            start = loop.time()
            end = start + wait_s
            if wait_s > CHECK_STALL_WAIT_S:
                await asyncio.sleep(min(wait_s / 2, wait_s - CHECK_STALL_WAIT_S))
                end = max(end, loop.time() + CHECK_STALL_WAIT_S)  # a late wake-up must not shorten the gap
                await self.collect()
            await asyncio.sleep(max(0.0, end - loop.time()))
            await self.collect()
            return self.tick()
        from sla_guard.ingest.lifetime import LifetimeView

        return self.tick(view=LifetimeView(self.source.store))

    # -- the serve loop ------------------------------------------------------------------------
    @property
    def tick_budget_s(self) -> float:
        """Wall time one tick's source queries may take: the evaluation interval, and at most
        half the staleness bound, so a slow source turns verdicts unknown, never stale."""
        return max(0.5, min(self.config.evaluation_interval_s, self.config.staleness_s / 2))

    def verdict_age(self, now: float | None = None) -> float:
        """Seconds since the last *completed* tick began (since start-up if none completed). On the
        monotonic clock; an explicit ``now`` (simulated time, tests) is compared with the tick's."""
        if now is None:
            last = self._last_tick_mono if self._last_tick_mono is not None else self._started_mono
            return max(0.0, self.monotonic() - last)
        last = self.last_tick.at if self.last_tick is not None else self.started_at
        return max(0.0, now - last)

    def stale(self, now: float | None = None) -> bool:
        return self.verdict_age(now) > self.config.staleness_s

    def expire_if_stale(self, now: float | None = None) -> bool:
        """Turn every evaluator's verdicts to unknown when the last completed tick is older than
        ``staleness_s``, whatever froze it (a slow source, a hung evaluator). True if stale."""
        if not self.stale(now):
            self.expired_at = None
            return False
        if self.expired_at is None or self._expired_ticks != self.ticks:  # once, and again after each tick
            age = self.verdict_age(now)
            now = self.clock() if now is None else now
            reason = (f"verdict is stale: last completed evaluation {age:.0f}s ago "
                      f"(staleness bound {self.config.staleness_s:g}s)")
            if self._clock_behind:
                reason += "; the wall clock was stepped back behind the last evaluation"
            for ev in self.evaluators:
                self._expire(ev, reason, now)
            self.expired_at = now
            self._expired_ticks = self.ticks
            log.warning("%s", reason)
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Collect every scrape interval and tick every evaluation interval until ``stop``.
        A watchdog beside the loop expires verdicts once they outlive ``staleness_s``."""
        scrape_every = getattr(self.config.source, "interval_s", self.config.evaluation_interval_s)
        next_scrape = next_tick = self.monotonic()  # the schedule: a wall-clock step must not move it
        # one dedicated thread for ticks: evaluators are CPU-bound numpy, run off the event loop
        # so scrapes and API requests go on; always the same thread, so its temporaries reuse one
        # malloc arena instead of fragmenting one per pool worker
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sla-guard-tick")
        watchdog = asyncio.create_task(self._watchdog(stop))
        try:
            await self._loop(stop, scrape_every, next_scrape, next_tick, loop, pool)
        finally:
            watchdog.cancel()
            # a tick still running (a hung evaluator) must not hold the process: it is abandoned
            pool.shutdown(wait=False, cancel_futures=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.source.aclose(), 2.0)

    async def _watchdog(self, stop: asyncio.Event) -> None:
        period = max(0.1, min(1.0, self.config.staleness_s / 4))
        while not stop.is_set():
            self.expire_if_stale()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=period)

    async def _loop(self, stop, scrape_every, next_scrape, next_tick, loop, pool) -> None:
        while not stop.is_set():
            mono = self.monotonic()
            if mono >= next_scrape:
                try:
                    await self.collect(self.clock())
                except Exception:  # a source bug: log, keep going, retry next round
                    log.exception("collect failed")
                next_scrape = max(next_scrape + scrape_every, mono)
            mono = self.monotonic()
            if mono >= next_tick:
                next_tick = max(next_tick + self.config.evaluation_interval_s, mono)
                if not self._wall_clock_ok(now := self.clock()):
                    continue
                # the tick runs in its thread while this loop waits on it or on ``stop``,
                # whichever comes first: SIGTERM is honoured even during a hung tick
                fut = loop.run_in_executor(pool, self.tick, now)
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({fut, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if stop.is_set():
                    return
            delay = max(0.0, min(next_scrape, next_tick) - self.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)

    def _wall_clock_ok(self, now: float) -> bool:
        """False while the wall clock is before the last evaluation (stepped back): the store holds
        samples stamped after ``now``, so an evaluation now would read data that old as current.
        The tick is skipped (the verdicts then go stale, hence unknown) until the clock is past it."""
        last = self.last_tick.at if self.last_tick is not None else None
        behind = last is not None and now < last
        if behind and not self._clock_behind:
            log.warning("wall clock is %.1fs behind the last evaluation (stepped back?): evaluations wait until "
                        "it passes %.3f; verdicts turn unknown after staleness_s (%gs)", last - now, last,
                        self.config.staleness_s)
        elif not behind and self._clock_behind:
            log.warning("wall clock is past the last evaluation again: evaluations resume")
        self._clock_behind = behind
        return not behind

    # -- state for the API ---------------------------------------------------------------------
    def ready(self) -> bool:
        """A tick ran on data and its verdict is not stale."""
        return self.last_tick is not None and self.source.ready() and not self.stale()

    def status(self, limit: int | None = None, evaluator: str | None = None, after: str | None = None) -> dict:
        """Everything at a glance: the guard, its source, and each evaluator's snapshot (only
        ``evaluator``'s when given). ``limit`` / ``after``: the page of the per-process and
        per-group maps of the evaluators that keep one (``paged``; ``sla_guard.model.page_map``)."""
        out: dict = {
            "source": self.source.mode,
            "started_at": self.started_at,
            "ticks": self.ticks,
            "last_tick": None,
            "evaluators": {},
        }
        if self.last_tick is not None:
            lt = self.last_tick
            out["last_tick"] = {"at": lt.at, "duration_s": lt.duration_s, "errors": lt.errors}
        if self.state is not None:
            out["state"] = self.state_status()
        discovery = getattr(self.source, "discovery", None)
        if discovery is not None and (disc := discovery.status()) is not None:
            out["discovery"] = disc  # a broken targets file: the last good list is scraped
        out["verdict_age_s"] = self.verdict_age()
        out["stale"] = self.stale()
        for ev in self.evaluators:
            if evaluator is not None and ev.name != evaluator:
                continue
            try:
                out["evaluators"][ev.name] = ev.snapshot(limit, after) if getattr(ev, "paged", False) \
                    else ev.snapshot()
            except Exception as err:
                out["evaluators"][ev.name] = {"error": f"{type(err).__name__}: {err}"}
        store = getattr(self.source, "store", None)
        if store is not None:
            out["store"] = {"series": store.series_count(), "bytes": store.nbytes(),
                            "dropped": dict(store.dropped)}
        return out

