"""The advisor as a guard ``Evaluator``: runs every tick, publishes recommendations.

Outputs, all from the same decision: the contract gauges ``guard_desired_replicas`` /
``guard_current_replicas`` (for HPA External metrics through prometheus-adapter), the
``guard_scaling_decisions`` counter, one JSONL line per pool per tick in the decision log, the
state the ``/v1/recommendations`` and KEDA endpoints serve, and, in active mode only, a call to
the actuator. Nothing here raises into the guard: bad data holds, actuator failures are counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from exporters import contract as c
from exporters.prometheus import ContractMetrics
from sla_guard.defaults import TPOT_SLO_S, TTFT_SLO_S
from sla_guard.model import Finding, MetricsView, PoolRecommendation, page_map
from sla_guard.scale.actuators import ActuationError, Actuator, CappedError, StandbyError, idempotency_key
from sla_guard.scale.advisor import POOLS, Advisor, _Learned, to_recommendation
from sla_guard.scale.guardrails import Decision, PoolMemory, without_data
from sla_guard.scale.learn import SPREAD_GRID, PrefillCapacity, StepModel, TpotSpread
from sla_guard.settings.advisor import AdvisorConfig

log = logging.getLogger(__name__)


class DecisionLog:
    """Append-only JSONL file; one line per decision. Write errors are logged, never raised."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self.errors = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict) -> None:
        if self.path is None:
            return
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record, sort_keys=True, default=float) + "\n")
        except OSError as err:
            self.errors += 1
            log.warning("decision log %s: %s", self.path, err)


UNKNOWN_OUTCOME = "unknown: the guard stopped before the outcome of this order was saved"


class AdvisorEvaluator:
    """Evaluator protocol: ``evaluate(view, now)`` and ``snapshot()``.

    One ``Advisor`` (learned capacities, guardrail memory) per model: with ``advisor.model: '*'``
    each model the engines report gets its own, bounded by ``max_models``, so three models'
    pools are sized separately and never summed into one "default" pool."""

    name = "advisor"
    state_tail = 256  # decision records handed back at restore (the /v1/decisions history)

    def __init__(self, cfg: AdvisorConfig, *, model: str | None = None, slo_ttft_s: float = TTFT_SLO_S,
                 slo_tpot_s: float = TPOT_SLO_S, metrics: ContractMetrics | None = None,
                 actuator: Actuator | None = None,
                 findings: Callable[[], Iterable[Finding]] | None = None, max_models: int = 64,
                 forget_after_s: float = 3600.0) -> None:
        self.cfg = cfg
        self.model = model or (cfg.model if cfg.model != "*" else "default")
        # advisor.model "*" sizes whatever the pools serve, one advisor per model the engines
        # report; advice carries that model so dashboards join it with engine series
        self._label_from_data = model is None and cfg.model == "*"
        self._fixed = cfg.model if model is None else model
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.max_models = max_models
        self.forget_after_s = forget_after_s
        self.advisors: dict[str, Advisor] = {}
        self._seen: dict[str, float] = {}
        self.metrics = metrics
        self.actuator = actuator if cfg.mode == "active" else None
        self.findings = findings
        self.log = DecisionLog(cfg.decision_log)
        self.history: deque[dict] = deque(maxlen=256)
        self._records: deque[dict] = deque(maxlen=4096)  # not yet persisted (sla_guard.state)
        self.actuation_errors = 0
        self._lock = threading.Lock()
        self._recs: list[PoolRecommendation] = []
        self._restarts: list[PoolRecommendation] = []
        self.updated_at: float | None = None
        self._published: set[tuple[str, str]] = set()  # (model, pool) with replica gauges on /metrics
        self._said: dict[str, str] = {}  # pool -> the last line logged on its unschedulable replicas
        self._store = None  # the state file, written before each order (bind_state)
        self._state_name = ""
        self._ordering: set[str] = set()  # names of the notes written ahead of orders (order/<model>/<pool>)

    @property
    def advisor(self) -> Advisor:
        """The advisor of the (single) model in view: the one tests and tools inspect."""
        key = self.model if self.model in self.advisors else next(iter(self.advisors), self._fixed)
        return self._advisor_for(key)

    @property
    def wildcard(self) -> bool:
        """``advisor.model: '*'``: one advisor per model the engines report."""
        return self._label_from_data

    def known_models(self) -> list[str]:
        """The models a wildcard advisor advises or saw within ``forget_after_s``: a ``?model=`` that
        is none of them is a typo (404), where a known model without data this tick is a 503."""
        return sorted((set(self.advisors) | set(self._seen)) - {"*"})

    def _advisor_for(self, model: str) -> Advisor:
        adv = self.advisors.get(model)
        if adv is None:
            adv = self.advisors[model] = Advisor(self.cfg, model=model, slo_ttft_s=self.slo_ttft_s,
                                                 slo_tpot_s=self.slo_tpot_s)
        return adv

    def _models(self, view: MetricsView, now: float) -> list[tuple[str, str]]:
        """(advisor key, model label) pairs to step this tick."""
        if not self._label_from_data:
            return [(self._fixed, self.model)]
        labs = [*view.instant(c.REQUESTS_RUNNING.name, {}, now), *view.instant(c.REQUESTS_WAITING.name, {}, now)]
        models = sorted({dict(lab).get("model", "") for lab in labs} - {""})
        if not models:
            return [("*", self.model)]
        for m in models:
            self._seen[m] = now
        for m in [m for m, t in self._seen.items() if now - t > self.forget_after_s]:
            self._seen.pop(m, None)
            self.advisors.pop(m, None)
        room = self.max_models - len(self.advisors)
        kept = [m for m in models if m in self.advisors or (room := room - 1) >= 0]  # bounded
        if len(kept) < len(models):
            log.warning("advisor: %d models beyond max_models=%d get no advice", len(models) - len(kept),
                        self.max_models)
        if kept:
            self.model = kept[0] if len(kept) == 1 else "*"
        return [(m, m) for m in kept]

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        """Called once by the Guard: publish on the guard's own /metrics."""
        self.metrics = metrics

    # -- Evaluator protocol --------------------------------------------------------------------
    def evaluate(self, view: MetricsView, now: float) -> None:
        try:
            found = tuple(self.findings()) if self.findings else ()
        except Exception:  # a detector's problem must not stop scaling advice
            log.exception("advisor: findings source failed")
            found = ()
        recs, all_restarts = [], []
        self._check_autoscalers()
        for key, label in self._models(view, now):
            adv = self._advisor_for(key)
            overridden = self._check_orders(adv, label, now)
            decisions, restarts = adv.step(view, now, {}, found)
            all_restarts.extend(restarts)
            for pool, d in decisions.items():
                rec = to_recommendation(label, d)
                recs.append(rec)
                actuated: str | bool = False
                if self.actuator is not None and d.direction != "none":
                    ikey = idempotency_key(label, pool, d.desired, now)
                    grace = d.numbers.get("drain_grace_s")
                    if grace and hasattr(self.actuator, "drain_grace_s"):
                        self.actuator.drain_grace_s[pool] = float(grace)  # checked before a scale-down
                    before = adv.pending.get(pool)
                    elector = getattr(self.actuator, "elector", None)
                    if elector is None or elector.is_leader():  # a standby orders nothing
                        if getattr(self.actuator, "get_replicas", None) is not None:
                            # written ahead as ordered: a restart checks it against the target's
                            # size (_check_orders); a webhook's cannot be, so is not trusted after one
                            adv.expect(pool, d.desired, now)
                        self._write_ahead(key, adv, self._record(now, label, pool, d, UNKNOWN_OUTCOME))
                    try:
                        self.actuator.set_replicas(label, pool, d.desired, ikey)
                        adv.expect(pool, d.desired, now)
                        actuated = True
                    except StandbyError as err:  # a second guard: not an error, nothing ordered
                        _unexpect(adv, pool, before)
                        actuated = str(err)
                    except ActuationError as err:
                        if isinstance(err, CappedError):  # patched, but to another size: count what holds
                            adv.expect(pool, err.applied, now)
                        else:
                            _unexpect(adv, pool, before)
                        actuated = f"error: {err}"
                        self.actuation_errors += 1
                        self._inc(c.GUARD_ACTUATION_ERRORS, label, pool, self.actuator.name)
                        log.warning("advisor: %s", err)
                self._publish(rec, d.direction)
                record = self._record(now, label, pool, d, actuated)
                if pool in overridden:
                    record["overridden"] = overridden[pool]
                self.log.append(record)
                self.history.append(record)
                self._records.append(record)
        self._unpublish_stale(recs)
        for r in all_restarts:
            record = {"t": now, "model": r.model, "pool": r.pool, "mode": self.cfg.mode, "action": r.action,
                      "replica": r.replica, "reasons": r.reasons, "confidence": r.confidence, "numbers": r.numbers}
            self.log.append(record)
            self._inc(c.GUARD_SCALING_DECISIONS, r.model, r.pool or "unknown", "none", "leak_rolling_restart")
        with self._lock:
            self._recs, self._restarts, self.updated_at = recs, all_restarts, now

    def _check_orders(self, adv: Advisor, model: str, now: float) -> dict[str, str]:
        """Compare each pool's outstanding order with the size the target holds now (Kubernetes:
        ``spec.replicas``). The advisor counts ordered replicas as starting until they serve, for
        up to ``pending_timeout_s`` (30 min); an HPA or KEDA on the same target, an admission
        policy or a person that set the size back left it holding, sure the capacity was coming.
        A lower size replaces the order (counted as an actuation error, logged, and recorded as
        ``overridden``); a size it cannot read leaves the order as it was."""
        read = getattr(self.actuator, "get_replicas", None) if self.actuator is not None else None
        stuck = getattr(self.actuator, "unschedulable", None) if self.actuator is not None else None
        out: dict[str, str] = {}
        adv.unschedulable = {}
        if read is None:
            return out
        for pool, (want, since) in list(adv.pending.items()):
            try:
                spec = int(read(pool))
            except ActuationError as err:
                log.warning("advisor: checking the order of %s=%d: %s", pool, want, err)
                continue
            if stuck is not None:
                self._check_unschedulable(adv, stuck, pool, min(spec, want))
            if spec >= want:
                continue
            adv.pending[pool] = (spec, since)
            out[pool] = (f"{pool}: the target's size is {spec}, not the {want} this guard ordered {now - since:.0f} s "
                         f"ago: another writer set it back (an HPA or KEDA ScaledObject on the same target, an "
                         f"admission policy, a person); counting {spec}")
            log.warning("advisor: %s", out[pool])
            self.actuation_errors += 1
            self._inc(c.GUARD_ACTUATION_ERRORS, model, pool, self.actuator.name)  # type: ignore[union-attr]
        return out

    def _check_unschedulable(self, adv: Advisor, read: Callable[[str], tuple[int, str]], pool: str, want: int) -> None:
        """How many of the ``want`` replicas ordered for ``pool`` the scheduler cannot place (one
        pod list, only while an order is outstanding), for the advisor, which then neither counts
        them as starting nor orders more on top of them. Logged when the count changes."""
        try:
            n, why = read(pool)
        except ActuationError as err:  # not known: they keep counting as starting
            self._say(pool, f"cannot tell whether the {want} {pool} replicas ordered can be scheduled, so they "
                            f"count as starting: {err}")
            return
        adv.unschedulable[pool] = n
        if not n:
            self._said.pop(pool, None)
            return
        self._say(pool, f"{pool}: {min(n, want)} of the {want} replicas ordered cannot be scheduled "
                        f"(PodScheduled=False, Unschedulable{': ' + why if why else ''}); they are not counted as "
                        f"starting and no more are ordered on top of them: add GPU nodes or lower "
                        f"advisor.pools.{pool}.max_replicas")

    def _say(self, pool: str, line: str) -> None:
        """Log ``line`` once, until the line for ``pool`` changes (a tick is 15 s)."""
        if self._said.get(pool) != line:
            self._said[pool] = line
            log.warning("advisor: %s", line)

    def _check_autoscalers(self) -> None:
        """At the first tick and every few minutes after (the actuator's ``check_autoscalers``):
        an HPA (or a KEDA ScaledObject's) on a target is logged as an error naming it and the fix,
        and counted; the actuator refuses to patch that pool until it is gone."""
        check = getattr(self.actuator, "check_autoscalers", None) if self.actuator is not None else None
        if check is None:
            return
        try:
            found = check()
        except Exception:  # a failed look-around must not stop the tick
            log.exception("advisor: looking for autoscalers on the targets failed")
            return
        for pool, line in found.items():
            log.error("advisor: %s", line)
            self.actuation_errors += 1
            self._inc(c.GUARD_ACTUATION_ERRORS, self.model, pool, self.actuator.name)  # type: ignore[union-attr]

    def _record(self, now: float, model: str, pool: str, d: Decision, actuated: str | bool) -> dict:
        """One decision record (the decision log, ``/v1/decisions``, the state's append stream)."""
        return {"t": now, "model": model, "pool": pool, "mode": self.cfg.mode, "current": d.current,
                "desired": d.desired, "direction": d.direction, "action": d.action, "reasons": d.reasons,
                "confidence": d.confidence, "numbers": d.numbers, "actuated": actuated}

    # -- crash-safe state (sla_guard.state.Stateful) -------------------------------------------
    def bind_state(self, store, name: str) -> None:
        """The state file (component ``name``), written before each order (``_write_ahead``)."""
        self._store, self._state_name = store, name

    def _write_ahead(self, key: str, adv: Advisor, record: dict) -> None:
        """Before an order goes out: the model's state as decided (cool-down and no-reversal
        clocks, the size gone down to) and the decision, its outcome unknown, into the state
        file. Saved only after the tick, a guard killed between the order and that save came
        back without them: it took the next scale-down step at once, within the cool-down, and
        ``/v1/decisions`` lacked the order the target had taken. The tick's save replaces the
        note with the decision's record. A failed write is the store's (counted, on
        ``/v1/status``): the order still goes."""
        if self._store is None:
            return
        name = f"order/{record['model']}/{record['pool']}"
        self._ordering.add(name)
        self._store.save({self._state_name: {f"model/{key}": _advisor_part(adv), name: record}})

    def state_dump(self, full: bool) -> dict:
        """Each model's learned capacities and guardrail memory (failed sizes, cool-downs, the
        stabilisation history); the decisions go to the append stream (``state_records``), in
        the same save that deletes the notes written ahead of their orders."""
        out: dict = {f"model/{m}": _advisor_part(a) for m, a in self.advisors.items()}
        out["meta"] = {"seen": dict(self._seen)}
        out.update(dict.fromkeys(self._ordering))  # bounded: one name per model and pool
        return out

    def state_records(self) -> list[dict]:
        out = list(self._records)
        self._records.clear()
        return out

    def state_load(self, parts: dict, records: list[dict]) -> None:
        """At a start, the file's advisor memory and decisions. Restored into a running guard (a
        file that could not be used at start, ``Guard._attach_state``) a model this guard has
        decided on meanwhile is merged with the file's (``_merge_advisor``), not replaced: the
        file's older clocks and orders made it forget an order it had placed (a later smaller
        'up' cut the target) and step down inside its cooldown. Decisions are kept in time order."""
        from sla_guard.state import decode

        running = bool(self.history)  # restored into a running guard: merged, in time order
        for name, value in parts.items():
            if not name.startswith("model/"):
                continue
            model = name[len("model/"):]
            if model not in self.advisors and len(self.advisors) >= self.max_models:
                continue
            try:
                state = {k: v for k, v in decode(value, _ADVISOR_CLASSES).items() if k in _ADVISOR_STATE}
                problem = state_problem(state)
            except (ValueError, TypeError, KeyError, AttributeError) as err:
                problem = f"{type(err).__name__}: {err}"
            if problem:
                log.warning("advisor: saved state of model %r not restored (%s); it learns afresh", model, problem)
                continue
            adv = self._advisor_for(model)
            if _decided(adv):
                _merge_advisor(adv, state)
                continue
            for k, v in state.items():
                setattr(adv, k, v)
        for m, t in ((parts.get("meta") or {}).get("seen") or {}).items():
            self._seen[m] = max(t, self._seen[m]) if m in self._seen and isinstance(t, int | float) else t
        self.history.extend(records)
        for name, note in sorted(parts.items()):  # orders the guard died in: their outcome is not known
            if name.startswith("order/") and isinstance(note, dict) and isinstance(note.get("t"), int | float):
                self._ordering.add(name)
                log.warning("advisor: the guard stopped while ordering %s=%s (model %s); the outcome is not "
                            "known", note.get("pool"), note.get("desired"), note.get("model"))
                self.history.append(note)
                self._records.append(note)
        if running:
            self.history = deque(sorted(self.history, key=_record_t), maxlen=self.history.maxlen)

    def _inc(self, metric, *labels: str) -> None:
        if self.metrics is not None:
            self.metrics[metric].labels(*labels).inc()

    def _publish(self, rec: PoolRecommendation, direction: str) -> None:
        if self.metrics is None:
            return
        if not without_data(rec.reasons):  # no data: no number (see _unpublish_stale)
            self.metrics[c.GUARD_DESIRED_REPLICAS].labels(rec.model, rec.pool).set(rec.desired)
            self.metrics[c.GUARD_CURRENT_REPLICAS].labels(rec.model, rec.pool).set(rec.current)
        reason = rec.reasons[0] if rec.reasons else "none"
        self.metrics[c.GUARD_SCALING_DECISIONS].labels(rec.model, rec.pool, direction, reason).inc()

    def _unpublish_stale(self, recs: list[PoolRecommendation]) -> None:
        """Take the replica gauges of every pool not sized this tick off /metrics: a pool without
        data, or a model whose targets all went down (it is no longer in the view). HPA's External
        metric then has no value and HPA holds, where the last number would have stayed on
        /metrics for good, and a 0 from the empty view would have scaled the pool down."""
        if self.metrics is None:
            return
        now = {(r.model, r.pool) for r in recs if not without_data(r.reasons)}
        for key in self._published - now:
            for metric in (c.GUARD_DESIRED_REPLICAS, c.GUARD_CURRENT_REPLICAS):
                with contextlib.suppress(KeyError):  # never published under this metric
                    self.metrics[metric].remove(*key)
        self._published = now

    def expire(self, reason: str, now: float) -> None:
        """The guard's watchdog: no tick completed within ``staleness_s``. KEDA polls
        ``/v1/scale/keda`` and HPA reads the desired-replicas gauge through prometheus-adapter, and
        both kept following a frozen guard's last number; every pool is now a hold without data
        (the KEDA endpoints answer 503, the gauges leave /metrics), so the autoscaler holds or
        takes its fallback until a tick completes again."""
        with self._lock:
            self._recs = [dataclasses.replace(r, desired=r.current, action="hold", confidence=0.0,
                                              reasons=["hold_stale_data", reason]) for r in self._recs]
        self._unpublish_stale([])

    def recommendations(self) -> tuple[list[PoolRecommendation], list[PoolRecommendation], float | None]:
        with self._lock:
            return list(self._recs), list(self._restarts), self.updated_at

    paged = True  # snapshot(limit, after): the rolling restarts by "model/finding" (``sla_guard.model.page_map``)

    def snapshot(self, limit: int | None = None, after: str | None = None, model: str | None = None) -> dict:
        """The last decision (only ``model``'s when given). Its rolling restarts, one per open leak
        finding, grow with the fleet (3,272 at 1,000 engines: 0.8 MB of /v1/status, 0.75 MB of
        /v1/recommendations), so they come ``limit`` a page past ``after`` (``restarts_total`` and
        ``next`` when paged); the pool decisions stay whole: two per model, at most ``max_models``."""
        recs, restarts, at = self.recommendations()
        if model is not None:
            recs, restarts = [r for r in recs if r.model == model], [r for r in restarts if r.model == model]
        got, extra = page_map({restart_key(r): r for r in restarts}, limit, after, "restarts")
        return {"mode": self.cfg.mode, "updated_at": at, "actuation_errors": self.actuation_errors,
                "recommendations": [rec_json(r) for r in recs],
                "restarts": [rec_json(r) for r in got.values()], **extra}


def _unexpect(adv: Advisor, pool: str, before: tuple[int, float] | None) -> None:
    """Put back the order ``pool`` had outstanding before one that did not go through."""
    if before is None:
        adv.pending.pop(pool, None)
    else:
        adv.pending[pool] = before


def _advisor_part(adv: Advisor) -> dict:
    """What an advisor learned and remembers, encoded for the state file (``_ADVISOR_STATE``)."""
    from sla_guard.state import encode

    return encode({k: getattr(adv, k) for k in _ADVISOR_STATE})


def _record_t(record: dict) -> float:
    """A decision record's time, for ordering (one without a number first)."""
    t = record.get("t")
    return float(t) if isinstance(t, int | float) else -math.inf


def _decided(adv: Advisor) -> bool:
    """The advisor has decided since this guard started (a fresh one has nothing to merge)."""
    return bool(adv.pending) or any(m.first_t is not None for m in adv.memory.values())


def _merge_series(a: Iterable, b: Iterable, maxlen: int | None) -> deque:
    """Two bounded (t, value) histories as one, in time order, each point once."""
    return deque(sorted(dict.fromkeys(map(tuple, [*a, *b])), key=lambda p: p[0]), maxlen=maxlen)


def _merge_advisor(adv: Advisor, state: dict) -> None:
    """Merge a model's saved state (``state``) into the advisor of a running guard that has
    decided meanwhile: each pool's clocks and histories (``PoolMemory.merge``), the newer
    outstanding order of each pool, and what the guard learned from the live data where it learned
    anything (its capacities and the utilisation target adapted on them, the newer TPOT spread),
    the file's otherwise; histories of both in time order."""
    for pool, mem in (state.get("memory") or {}).items():
        if pool in adv.memory:
            adv.memory[pool].merge(mem)
        else:
            adv.memory[pool] = mem
    for pool, (want, since) in (state.get("pending") or {}).items():
        if pool not in adv.pending or since > adv.pending[pool][1]:
            adv.pending[pool] = (want, since)
    mine, theirs = adv.learned, state.get("learned")
    if theirs is not None:
        if not mine.prefill.samples:
            mine.prefill = theirs.prefill
            adv.u_target = state.get("u_target", adv.u_target)
        if not mine.decode.samples:
            mine.decode = theirs.decode
        if theirs.tpot_spread_t is not None and (mine.tpot_spread_t is None
                                                 or theirs.tpot_spread_t > mine.tpot_spread_t):
            mine.tpot_spread, mine.tpot_spread_t = theirs.tpot_spread, theirs.tpot_spread_t
        for engine, t in theirs.first_seen.items():
            mine.first_seen[engine] = min(t, mine.first_seen.get(engine, t))
        if theirs.initial_engines is not None:
            mine.initial_engines = (mine.initial_engines or set()) | set(theirs.initial_engines)
        for key, hist in theirs.waiting_hist.items():
            own = mine.waiting_hist.get(key)
            mine.waiting_hist[key] = _merge_series(own or (), hist, (own if own is not None else hist).maxlen)
        mine.running_hist = _merge_series(mine.running_hist, theirs.running_hist, mine.running_hist.maxlen)
    if adv._accepted_len is None:
        adv._accepted_len = state.get("_accepted_len")
    if "_proven" in state:
        adv._proven = _merge_series(adv._proven, state["_proven"], adv._proven.maxlen)


# what an Advisor learns (and must not relearn after a restart); the rest is configuration
_ADVISOR_STATE = ("learned", "memory", "pending", "_accepted_len", "u_target", "_proven")
_ADVISOR_CLASSES = {k.__name__: k for k in (_Learned, PrefillCapacity, StepModel, TpotSpread, PoolMemory)}


def _numbers(obj: object) -> Iterator[object]:
    """Every number in a decoded state (dataclass fields, containers), recursively."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int | float):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _numbers(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(k)
            yield from _numbers(v)
    elif isinstance(obj, list | tuple | set | deque):
        for v in obj:
            yield from _numbers(v)


def state_problem(state: dict) -> str | None:
    """Why a saved advisor state cannot be restored (None: it can). The state is written every
    tick and read back at start, so a value no tick could have learned (NaN or infinite numbers,
    a utilisation target outside (0, 1], a pool missing, a spread over another grid: an older or
    hand-edited file) made every tick of the restored advisor raise, or size on NaN, until the
    file was deleted."""
    learned, memory = state.get("learned"), state.get("memory")
    if learned is not None and not isinstance(learned, _Learned):
        return "learned is not a learned state"
    if memory is not None and not (isinstance(memory, dict) and set(memory) == set(POOLS)
                                   and all(isinstance(m, PoolMemory) for m in memory.values())):
        return f"memory is not one guardrail memory per pool {list(POOLS)}"
    if not isinstance(state.get("_proven", deque()), deque):
        return "_proven is not a bounded history"
    u = state.get("u_target")
    if u is not None and not (isinstance(u, int | float) and 0 < u <= 1):
        return f"u_target {u!r} is not a utilisation in (0, 1]"
    acc = state.get("_accepted_len")
    if acc is not None and not (isinstance(acc, int | float) and acc > 0):
        return f"_accepted_len {acc!r} is not a positive length"
    if learned is not None and learned.tpot_spread.loglik and len(learned.tpot_spread.loglik) != len(SPREAD_GRID):
        return f"tpot_spread has {len(learned.tpot_spread.loglik)} points, this version {len(SPREAD_GRID)}"
    bad = next((v for v in _numbers(state) if not math.isfinite(v)), None)
    if bad is not None:
        return f"a number is {bad}"
    return None


def restart_key(r: PoolRecommendation) -> str:
    """A rolling restart's page key: its model and the leak finding it comes from (a finding
    without a model label is advised for every model of a wildcard advisor)."""
    return f"{r.model}/{r.finding or r.replica or ''}"


def rec_json(r: PoolRecommendation) -> dict:
    out = {"model": r.model, "pool": r.pool, "current": r.current, "desired": r.desired, "action": r.action,
           "reasons": list(r.reasons), "confidence": r.confidence, "numbers": dict(r.numbers)}
    if r.replica is not None:  # a rolling restart names its replica
        out["replica"] = r.replica
    if r.finding is not None:  # and the leak finding it comes from
        out["finding"] = r.finding
    return out
