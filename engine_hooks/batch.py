"""Per-engine accumulation of step stats between flushes.

``record()`` runs after every engine step on vLLM's event loop. Updating prometheus_client
children there costs a locked increment per counter, a locked set per gauge and per histogram
bucket touched, every step. Instead each step is folded into a ``StepBatch`` (integer adds, list
extends, latest gauge values) and a flush thread applies the batch to the ``EngineRecorder``
every ``SLA_GUARD_FLUSH_INTERVAL_S`` (default 0.5 s): counters move by their sum, gauges take the
latest value, histogram lists are observed in one pass. Exposition therefore lags by at most one
flush interval, far below any scrape interval. Pure data; no I/O, no clocks.

Counts are summed here, so a negative one is refused per step (a sum would hide it: +100 then -50
is +50) and counted in ``bad``; ``apply()`` reports it as hook_errors{kind="bad_increment"} and
applies each part of the batch on its own, so one malformed value costs only itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_hooks.kv_connector import KvTransferBatch, parse_kv_connector_stats
from exporters.prometheus import BAD_INCREMENT, EngineRecorder

_INF = float("inf")


class StepBatch:
    """What one or more engine steps contributed since the last flush."""

    __slots__ = ("accepted", "accepted_pos", "bad", "computed", "draft_pos", "draft_tokens", "drafts", "ext_hits",
                 "ext_queries", "external", "finished", "generated", "itls", "kv_batches", "kv_fetch", "local_hit",
                 "local_hits", "local_queries", "preempted", "sched", "steps", "ttfts")

    def __init__(self) -> None:
        self.steps = 0
        self.sched: tuple[int, int, float] | None = None
        self.kv_fetch: dict[str, int] | None = None
        self.local_queries = self.local_hits = self.ext_queries = self.ext_hits = 0
        self.drafts = self.draft_tokens = self.accepted = 0
        self.accepted_pos: list[int] = []
        self.draft_pos: list[int] = []
        self.kv_batches: list[KvTransferBatch] = []
        self.ttfts: list[float] = []
        self.itls: list[float] = []
        self.generated = self.computed = self.local_hit = self.external = self.preempted = 0
        self.finished: list[tuple[float, float, float, float, float, int, str]] = []
        self.bad = 0  # counts refused (negative, NaN, non-number) since the last flush

    def _ok(self, n: Any) -> Any:
        """``n`` if it is a finite count >= 0, else 0 and one more in ``bad`` (the slow path only). An
        infinite step is refused here, per step: summed, it made the whole flush window's sum infinite, which
        the recorder then refused, losing every other step's count with it."""
        try:
            if 0 <= n < _INF:
                return n
        except TypeError:
            pass
        self.bad += 1
        return 0

    @property
    def size(self) -> int:
        """Rough count of queued observations (bounds memory: the caller flushes when large)."""
        return len(self.itls) + len(self.ttfts) + len(self.finished) + len(self.kv_batches)

    def add_scheduler(self, s: Any, kv_consumer: bool) -> None:
        waiting = s.num_waiting_reqs + s.num_skipped_waiting_reqs
        self.sched = (s.num_running_reqs, waiting, s.kv_cache_usage)
        self.steps += 1
        if kv_consumer:  # like vLLM: the remote-KV wait gauge exists on consumers only
            self.kv_fetch = s.num_kv_fetch_reqs_by_stage
        ok = self._ok
        p = s.prefix_cache_stats
        if p is not None:
            self.local_queries += ok(p.queries)
            self.local_hits += ok(p.hits)
        p = s.connector_prefix_cache_stats
        if p is not None:
            self.ext_queries += ok(p.queries)
            self.ext_hits += ok(p.hits)

    def add_spec(self, sd: Any) -> None:
        ok = self._ok
        self.drafts += ok(sd.num_drafts)
        self.draft_tokens += ok(sd.num_draft_tokens)
        self.accepted += ok(sd.num_accepted_tokens)
        self.bad += _add_into(self.accepted_pos, sd.num_accepted_tokens_per_pos)
        self.bad += _add_into(self.draft_pos, sd.num_draft_tokens_per_pos)

    def add_kv_connector(self, data: Any) -> None:
        self.kv_batches.extend(parse_kv_connector_stats(data))

    def add_iteration(self, it: Any, reasons: dict) -> None:
        if it.time_to_first_tokens_iter:
            self.ttfts.extend(it.time_to_first_tokens_iter)
        if it.inter_token_latencies_iter:
            self.itls.extend(it.inter_token_latencies_iter)
        pts = it.prompt_token_stats
        g, pc, lh, ext, pre = (it.num_generation_tokens, pts.computed, pts.local_cache_hit, pts.external_kv_transfer,
                               it.num_preempted_reqs)
        try:  # one check per step; the per-field path only when it fails
            fine = 0 <= g < _INF and 0 <= pc < _INF and 0 <= lh < _INF and 0 <= ext < _INF and 0 <= pre < _INF
        except TypeError:
            fine = False
        if not fine:
            ok = self._ok
            g, pc, lh, ext, pre = ok(g), ok(pc), ok(lh), ok(ext), ok(pre)
        self.generated += g
        self.computed += pc
        self.local_hit += lh
        self.external += ext
        self.preempted += pre
        for f in it.finished_requests:
            reason = reasons.get(f.finish_reason)
            if reason is None:
                reason = reasons[f.finish_reason] = str(f.finish_reason)
            self.finished.append((f.e2e_latency, f.queued_time, f.prefill_time, f.decode_time,
                                  f.mean_time_per_output_token, f.num_generation_tokens, reason))


def _add_into(acc: list[int], values) -> int:
    """Add per-position counts into ``acc``; returns how many were refused (negative, NaN, inf)."""
    bad = 0
    for i, v in enumerate(values):
        if not 0 <= v < _INF:
            bad += 1
            v = 0
        if i < len(acc):
            acc[i] += v
        else:
            acc.append(v)
    return bad


def apply(rec: EngineRecorder, b: StepBatch, on_error: Callable[[str, BaseException], None] | None = None) -> None:
    """Move a batch into the recorder's Prometheus children. Each part (scheduler state, each KV
    batch, token counts, each finished request, ...) is applied on its own: an exception costs that
    part only and goes to ``on_error("flush", exc)`` (default: the recorder's hook_errors), so the
    finished requests after a malformed one are still counted."""
    err = on_error if on_error is not None else (lambda kind, e: rec.count_error(kind, 1, e))
    parts: list[tuple[Callable[..., None], tuple]] = []
    if b.sched is not None:
        parts.append((rec.scheduler, (*b.sched, b.steps)))
    if b.kv_fetch is not None:
        parts.append((rec.kv_fetch_by_stage, (b.kv_fetch,)))
    if b.local_queries or b.local_hits:
        parts.append((rec.prefix_cache, ("local", b.local_queries, b.local_hits)))
    if b.ext_queries or b.ext_hits:
        parts.append((rec.prefix_cache, ("external", b.ext_queries, b.ext_hits)))
    if b.drafts or b.draft_pos:
        parts.append((rec.spec_decode, (b.drafts, b.draft_tokens, b.accepted, b.accepted_pos, b.draft_pos)))
    for k in b.kv_batches:
        parts.append((rec.kv_transfer, (k.durations, k.post_durations, k.nbytes, k.descriptors, k.failures,
                                        k.expired, k.late_notifications)))
    if b.ttfts:
        parts.append((rec.observe_ttfts, (b.ttfts,)))
    if b.itls:
        parts.append((rec.observe_itls, (b.itls,)))
    parts.append((rec.tokens, (b.generated, b.computed, b.local_hit, b.external)))
    parts.append((rec.preempted, (b.preempted,)))
    bad = b.bad + sum(k.bad for k in b.kv_batches)
    if bad:
        parts.append((rec.count_error, (BAD_INCREMENT, bad)))
    for fn, args in parts:
        try:
            fn(*args)
        except Exception as e:
            err("flush", e)
    done = rec.request_done
    for f in b.finished:
        try:
            done(*f)
        except Exception as e:
            err("flush", e)
