"""Discrete-event simulation of a P/D deployment: prefill pool -> KV transfer -> decode pool.

One heap of events, one seeded RNG: the same inputs give the same outputs. A request follows the
P/D proxy path of vLLM (docs.vllm.ai, "NixlConnector Usage Guide"): prefill replica with
max_tokens=1 (prefix-cache lookup, chunked prefill, one generated token), then a decode replica that
allocates KV, pulls it from the prefill replica (transfer), and decodes with speculative drafts.
Client TTFT = prefill queue + prefill + transfer + decode queue + first decode step, plus the
profile's ``frontend_s`` per hop (four: to prefill, back, to decode, back) and ``router_overhead_s``
(the proxy's own work, in three equal passes: before the prefill leg, between the legs, after).

Engines record the contract through ``EngineRecorder`` exactly as the hooks would from vLLM's
SchedulerStats / IterationStats: the prefill engine sees TTFT at its side and one generated token,
the decode engine sees external KV hits, the kv-fetch stage gauge, TPOT, ITL, spec-decode counters
and the KV-transfer stats (pulling side).

The P/D proxy (:class:`Proxy`, ``sim-proxy``) records the client scope as sla-guard-proxy does:
client TTFT and its stages when the first token is forwarded (``prefill_leg`` = prefill request
sent -> answer received, ``decode_first_leg`` = decode request sent -> first token received,
``proxy`` = the rest), TPOT, e2e and the outcome when a request ends, and the in-flight gauge.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from exporters.contract import Outcome, Pool, outcome_of_status
from exporters.prometheus import FinishedRequest
from sla_guard.defaults import TPOT_SLO_S, TTFT_SLO_S
from sla_guard.sim.exposition import ClientMetrics, EngineMetrics
from sla_guard.sim.faults import FaultSchedule
from sla_guard.sim.kvcache import PrefixCache
from sla_guard.sim.processes import ProcessSampler
from sla_guard.sim.profile import Profile
from sla_guard.sim.traces import Trace, TraceRequest

STARTING, READY, DRAINING, DOWN, STOPPED = "starting", "ready", "draining", "down", "stopped"
DEFAULT_EPOCH = 1_767_225_600.0  # 2026-01-01T00:00:00Z: simulated time 0 in metric timestamps
PROXY_NAME = "sim-proxy"  # the client scope's router label and the proxy's scrape instance

_tb_counter = 0


class Req:
    """One request's state through both pools (slots: millions of these are touched per run)."""

    __slots__ = (
        "arrival",
        "ctx_done",
        "d_arrival",
        "d_replica",
        "d_sched",
        "finish",
        "first_token",
        "generated",
        "hashes",
        "hit_tokens",
        "input_len",
        "kv_alloc",
        "last_token",
        "local_hit",
        "output_len",
        "p_arrival",
        "p_done",
        "p_kv",
        "p_replica",
        "p_sched",
        "recompute",
        "remaining",
        "rid",
        "stage",
        "status",
        "xfer_tokens",
    )

    def __init__(self, rid: int, tr: TraceRequest, arrival: float) -> None:
        self.rid = rid
        self.arrival = arrival  # at the client (the proxy)
        self.p_arrival = arrival  # at the prefill engine (after the API front end)
        self.input_len = tr.input_len
        self.output_len = tr.output_len
        self.hashes = tr.hash_ids
        self.status = "queued"
        self.p_replica = self.d_replica = None
        self.p_sched = self.p_done = self.d_arrival = self.d_sched = -1.0
        self.first_token = self.last_token = self.finish = -1.0
        self.remaining = 0
        self.ctx_done = 0
        self.hit_tokens = 0
        self.local_hit = 0
        self.xfer_tokens = 0
        self.generated = 0
        self.kv_alloc = 0
        self.p_kv = 0
        self.recompute = 0
        self.stage = ""


@dataclass(slots=True)
class Summary:
    """What a replay reports (one JSON line)."""

    requests: int
    finished: int
    aborted: int
    unfinished: int
    slo_attainment: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_mean_s: float
    tpot_p90_s: float
    gpu_hours: float
    scaling_actions: int
    sim_duration_s: float
    extra: dict = field(default_factory=dict)
    rejected: int = 0  # over the profile's max_model_len: a 400 at once, as vLLM answers; not in attainment


class Replica:
    """State shared by prefill and decode replicas: lifecycle, metrics, processes, KV."""

    def __init__(self, dep: Deployment, pool: str, name: str, capacity_tokens: int, cpu_blocks: int) -> None:
        self.dep = dep
        self.pool = pool
        self.name = name
        self.state = STARTING
        self.capacity = capacity_tokens
        self.block_tokens = dep.trace_block_tokens
        self.cache = PrefixCache(capacity_tokens // self.block_tokens, cpu_blocks)
        self.active_tokens = 0
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.busy = False
        self.metrics: EngineMetrics | None = None
        self.alive_since = 0.0
        self.gpu_seconds = 0.0
        self.started_at = 0.0
        self.stopped_at: float | None = None  # when scaled away or retired (the report's fault story)
        self.sampler: ProcessSampler | None = None
        self.generation = 0  # bumps on crash, invalidates scheduled step events
        self.stale_marked = True  # scrape bookkeeping (harness.scrape_into)
        self.was_ready = False  # a discovered target: once served, a restart reads as up == 0

    # -- lifecycle --------------------------------------------------------------------------------
    def boot(self, now: float, ready_at: float) -> None:
        self.state = STARTING
        self.alive_since = now
        self.started_at = now
        self.generation += 1
        self.dep.at(ready_at, self._ready, self.generation)

    def _ready(self, gen: int) -> None:
        if gen != self.generation or self.state != STARTING:
            return
        self.state = READY
        self.was_ready = True
        dep = self.dep
        if dep.record:
            p = dep.profile
            self.metrics = EngineMetrics(
                dep.model, self.pool, self.name, spec_method=p.spec.method if self.pool == "decode" else "",
                num_spec=p.spec.num_spec_tokens if self.pool == "decode" else 0,
                kv_role="kv_producer" if self.pool == "prefill" else "kv_consumer", env=dep.metrics_env)
            self.sampler = ProcessSampler(list(p.processes), dep.epoch + self.started_at,
                                          dep.rng.randrange(1000, 4_000_000), random.Random(dep.rng.random()))
        dep._notify()

    def close_gpu_time(self, now: float) -> None:
        self.gpu_seconds += now - self.alive_since
        self.alive_since = now

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def sample_processes(self, now: float) -> None:
        if self.metrics is None or self.sampler is None:
            return
        faults = self.dep.faults
        t_since = self.started_at
        for s in self.sampler.sample(self.dep.epoch + now, self.load(),
                                     lambda role, _t: faults.leak_bytes(self.name, role, now, t_since)):
            self.metrics.process(*s)
            # every process runs the census; a leak that names its container shows as a grower
            self.metrics.census(s[0], s[1], faults.census(self.name, s[0], now, t_since))


class PrefillReplica(Replica):
    def __init__(self, dep: Deployment, name: str) -> None:
        p = dep.profile
        cpu_blocks = int(p.kv.cpu_offload_bytes / p.kv.bytes_per_token / dep.trace_block_tokens)
        super().__init__(dep, "prefill", name, p.kv.prefill_capacity_tokens, cpu_blocks)
        self.pending_tokens = 0  # tokens still to compute (routing signal)
        self.held: set[int] = set()  # rids whose KV waits for the decode side to pull it

    def route_cost(self, r: Req) -> float:
        hit = min(self.cache.peek(r.hashes) * self.block_tokens, r.input_len - 1) if r.hashes else 0
        return self.pending_tokens + (r.input_len - hit)

    def enqueue(self, r: Req, now: float) -> None:
        r.p_replica = self
        r.status = "prefill_wait"
        self.waiting.append(r)
        self.pending_tokens += r.input_len
        if not self.busy:
            self._step(now)

    def _admit(self, now: float) -> None:
        """Move waiting requests into the running batch as vLLM V1's scheduler does: the running
        requests take the step's token budget first (FIFO), and a waiting request is admitted only
        while budget is left for its first chunk (and a slot and KV space). So while a long prompt
        computes, the queue behind it stays in ``waiting``, and a request's prefill time is its own
        compute shared with the one or two others the budget reaches, not the whole queue's."""
        prof = self.dep.profile
        bt = self.block_tokens
        left = prof.prefill.chunk_tokens - sum(r.remaining for r in self.running)
        while self.waiting and len(self.running) < prof.prefill.max_num_seqs and left > 0:
            r = self.waiting[0]
            if self.active_tokens + r.input_len > self.capacity and self.running:
                break  # wait for KV to free up
            self.waiting.popleft()
            g = c = 0
            if r.hashes:
                g, c = self.cache.lookup(r.hashes)
            hit = min((g + c) * bt, r.input_len - 1)
            gpu_hit = min(g * bt, hit)
            restored = hit - gpu_hit
            r.hit_tokens = hit
            r.ctx_done = hit
            r.remaining = r.input_len - hit
            self.pending_tokens -= hit
            r.recompute = restored  # restore cost charged in the first step
            r.p_sched = now
            r.p_kv = r.input_len
            self.active_tokens += r.input_len
            self.running.append(r)
            left -= r.remaining
            if self.metrics is not None:
                self.metrics.rec.prefix_cache("local", r.input_len, hit)
            r.status = "prefill"

    def _step(self, now: float) -> None:
        if self.state not in (READY, DRAINING):
            self.busy = False
            return
        self._admit(now)
        if not self.running:
            self.busy = False
            self._maybe_stop(now)
            return
        prof = self.dep.profile.prefill
        budget = prof.chunk_tokens
        sched: list[tuple[Req, int]] = []
        cost = prof.step_base_s
        per_tok, per_k = prof.per_token_s, prof.per_token_per_kctx_s / 1000.0
        restore = 0.0
        for r in self.running:
            if budget <= 0:
                break
            n = min(r.remaining, budget)
            budget -= n
            sched.append((r, n))
            cost += n * (per_tok + per_k * (r.ctx_done + n / 2))
            if r.recompute:
                restore += r.recompute * self.dep.restore_s_per_token
                r.recompute = 0
        dt = (cost + restore) * self.dep.jitter(prof.jitter)
        self.busy = True
        self.dep.at(now + dt, self._step_done, (self.generation, sched))

    def _step_done(self, arg) -> None:
        gen, sched = arg
        if gen != self.generation:
            return
        now = self.dep.now
        done: list[Req] = []
        computed = 0
        for r, n in sched:
            r.remaining -= n
            r.ctx_done += n
            computed += n
            if r.remaining <= 0:
                done.append(r)
        self.pending_tokens -= computed
        if done:
            self.running = [r for r in self.running if r.remaining > 0]
        m = self.metrics
        if m is not None:
            rec = m.rec
            local_hits = sum(r.hit_tokens for r in done)
            rec.tokens(len(done), computed=computed, local_hit=local_hits)
            if done:
                rec.observe_ttfts([now - r.p_arrival for r in done])
            for r in done:
                ttft = now - r.p_arrival
                rec.finished(FinishedRequest(e2e_s=ttft, queue_s=r.p_sched - r.p_arrival, prefill_s=now - r.p_sched,
                                             decode_s=0.0, tpot_s=0.0, prompt_tokens=r.input_len,
                                             cached_tokens=r.hit_tokens, generated_tokens=1, reason="length"))
            rec.scheduler(len(self.running), len(self.waiting), min(1.0, self.active_tokens / self.capacity))
        for r in done:
            r.p_done = now
            if r.hashes:
                limit = max(0, (self.capacity - self.active_tokens) // self.block_tokens)
                self.cache.insert(r.hashes, limit)
            self.held.add(r.rid)
            if self.dep.between_legs_s:  # answer back through the API server and proxy, on to decode's
                self.dep.at(now + self.dep.between_legs_s, self.dep._to_decode_now, r)
            else:
                self.dep.to_decode(r, now)
        self._step(now)

    def release(self, r: Req) -> None:
        """The decode side pulled (or gave up on) this request's KV: free the blocks."""
        if r.rid in self.held:
            self.held.discard(r.rid)
            self.active_tokens -= r.p_kv
        r.p_kv = 0
        if self.state == DRAINING:
            self._maybe_stop(self.dep.now)

    def _maybe_stop(self, now: float) -> None:
        if self.state == DRAINING and self.idle() and not self.held:
            self.dep._stop(self, now)


class DecodeReplica(Replica):
    def __init__(self, dep: Deployment, name: str) -> None:
        super().__init__(dep, "decode", name, dep.profile.kv.decode_capacity_tokens, 0)
        self.transferring: dict[int, Req] = {}
        self.ready_q: list[Req] = []  # KV arrived, joins the batch at the next step
        spec = dep.profile.spec
        self.k = spec.num_spec_tokens
        a = [1.0, *spec.acceptance_per_pos]
        self.cond = [a[i + 1] / a[i] if a[i] > 0 else 0.0 for i in range(self.k)]

    def enqueue(self, r: Req, now: float) -> None:
        r.d_replica = self
        r.d_arrival = now
        r.status = "decode_wait"
        r.stage = "waiting_to_start"
        self.waiting.append(r)
        self._admit(now)
        if not self.busy:
            self._step(now)

    def load(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.ready_q) + len(self.transferring)

    def idle(self) -> bool:
        return self.load() == 0

    def _admit(self, now: float) -> None:
        dep = self.dep
        prof = dep.profile
        bt = self.block_tokens
        while self.waiting:
            r = self.waiting[0]
            need = r.input_len + r.generated + 1
            if self.active_tokens + need > self.capacity and (self.running or self.transferring):
                break
            self.waiting.popleft()
            r.kv_alloc = need
            self.active_tokens += need
            if r.recompute < 0:  # preempted earlier: recompute the context locally, no transfer
                r.recompute = r.input_len + r.generated
                r.stage = "completed_waiting"
                self.ready_q.append(r)
                continue
            local = 0
            if r.hashes:
                g, _ = self.cache.lookup(r.hashes)
                local = min(g * bt, r.input_len - 1)
            r.local_hit = local
            r.xfer_tokens = r.input_len - local
            src = r.p_replica
            nbytes = r.xfer_tokens * prof.kv.bytes_per_token
            tp = prof.transfer
            # the KV is there to pull only while the prefill replica holds it: a crash since the
            # prefill lost it (the replica is restarting, not DOWN, by the time a pull starts)
            fail = src is None or r.rid not in src.held or (
                dep.rng.random() < dep.faults.transfer_failure_prob(now, tp.failure_prob))
            dur = (tp.latency_s + nbytes / tp.bandwidth_bytes_s) * dep.faults.transfer_factor(now)
            dur *= dep.jitter(tp.jitter)
            r.stage = "in_progress"
            self.transferring[r.rid] = r
            dep.at(now + tp.post_s + dur, self._xfer_done, (self.generation, r, fail, dur, nbytes))

    def _xfer_done(self, arg) -> None:
        gen, r, fail, dur, nbytes = arg
        dep = self.dep
        if r.p_replica is not None:
            r.p_replica.release(r)
        if gen != self.generation:
            return
        self.transferring.pop(r.rid, None)
        tp = dep.profile.transfer
        m = self.metrics
        if fail:
            r.recompute = r.xfer_tokens  # fall back to computing the prompt here
            r.xfer_tokens = 0
            if m is not None:
                m.kv_failure("transfer")
        elif m is not None:
            m.kv_transfer(dur, tp.post_s, nbytes, max(1, math.ceil(nbytes / tp.bytes_per_descriptor)))
        r.stage = "completed_waiting"
        self.ready_q.append(r)
        if not self.busy:
            self._step(dep.now)

    def _step(self, now: float) -> None:
        if self.state not in (READY, DRAINING):
            self.busy = False
            return
        dep = self.dep
        prof = dep.profile.decode
        if self.ready_q:
            room = prof.max_num_seqs - len(self.running)
            join, self.ready_q = self.ready_q[:room], self.ready_q[room:]
            for r in join:
                if r.d_sched < 0:
                    r.d_sched = now
                r.status = "decode"
                r.stage = ""
            self.running.extend(join)
        if self.metrics is not None:
            self._kv_fetch_gauge()
        if not self.running:
            self.busy = False
            self._maybe_stop(now)
            return
        b = len(self.running)
        ctx = 0
        extra = 0.0
        pp = dep.profile.prefill
        for r in self.running:
            ctx += r.input_len + r.generated
            if r.recompute > 0:  # local prefill of a failed transfer / preempted request stalls the step
                extra += r.recompute * (pp.per_token_s + pp.per_token_per_kctx_s * r.recompute / 2000.0)
                r.recompute = 0
        cost = prof.step_base_s + prof.per_seq_s * b + prof.per_kctx_s * ctx / 1000.0
        if self.k == 0:
            cost *= prof.nospec_factor
        dt = (cost + extra) * dep.jitter(prof.jitter)
        self.busy = True
        dep.at(now + dt, self._step_done, (self.generation, list(self.running)))

    def _kv_fetch_gauge(self) -> None:
        inprog = len(self.transferring)
        self.metrics.rec.kv_fetch_by_stage({"waiting_to_start": len(self.waiting), "in_progress": inprog,
                                            "completed_waiting": len(self.ready_q)})

    def _step_done(self, arg) -> None:
        gen, batch = arg
        if gen != self.generation:
            return
        dep = self.dep
        now = dep.now
        rng = dep.rng.random
        k = self.k
        cond = self.cond
        f = dep.faults.acceptance_factor(self.name, now) if k else 1.0
        c0 = cond[0] * f if k else 0.0
        drafts = 0
        acc_pos = [0] * k
        itls: list[float] = []
        ttfts: list[float] = []
        firsts: list[Req] = []
        emitted_total = 0
        finished: list[Req] = []
        for r in batch:
            if r.first_token < 0:
                r.first_token = now
                emitted = 1
                ttfts.append(now - r.d_arrival)
                firsts.append(r)
            else:
                itls.append(now - r.last_token)
                emitted = 1
                if k:
                    drafts += 1
                    if rng() < c0:
                        acc_pos[0] += 1
                        emitted += 1
                        for i in range(1, k):
                            if rng() < cond[i]:
                                acc_pos[i] += 1
                                emitted += 1
                            else:
                                break
            left = r.output_len - r.generated
            if emitted > left:
                emitted = left
            r.generated += emitted
            r.kv_alloc += emitted
            r.last_token = now
            emitted_total += emitted
            if r.generated >= r.output_len:
                finished.append(r)
        self.active_tokens += emitted_total
        if firsts:
            dep._client_first_tokens(firsts)
        m = self.metrics
        if finished:
            fin = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in fin]
            for r in finished:
                self.active_tokens -= r.kv_alloc
                r.kv_alloc = 0
                r.finish = now
                r.status = "finished"
                if r.hashes:
                    self.cache.insert(r.hashes, max(0, (self.capacity - self.active_tokens) // self.block_tokens))
                dep._finished(r)
            dep._client_finished(finished)
        # Preemption when the batch outgrew the KV cache: newest first, as vLLM does.
        preempted = 0
        while self.active_tokens > self.capacity and len(self.running) > 1:
            r = self.running.pop()
            self.active_tokens -= r.kv_alloc
            r.kv_alloc = 0
            r.recompute = -1
            r.status = "decode_wait"
            r.stage = "waiting_to_start"
            self.waiting.appendleft(r)
            preempted += 1
        if m is not None:
            rec = m.rec
            if ttfts:
                rec.observe_ttfts(ttfts)
            if itls:
                rec.observe_itls(itls)
            rec.tokens(emitted_total, computed=sum(1 for _ in ttfts),
                       external=sum(r.xfer_tokens for r in batch if r.first_token == now),
                       local_hit=sum(r.local_hit for r in batch if r.first_token == now))
            for r in batch:
                if r.first_token == now:
                    rec.prefix_cache("local", r.input_len, r.local_hit)
                    rec.prefix_cache("external", r.input_len - r.local_hit, r.xfer_tokens)
            if k:
                rec.spec_decode(drafts, drafts * k, sum(acc_pos), acc_pos, [drafts] * k)
            rec.preempted(preempted)
            for r in finished:
                dec = r.finish - r.first_token
                rec.finished(FinishedRequest(
                    e2e_s=r.finish - r.d_arrival, queue_s=r.d_sched - r.d_arrival, prefill_s=r.first_token - r.d_sched,
                    decode_s=dec, tpot_s=dec / (r.generated - 1) if r.generated > 1 else 0.0,
                    prompt_tokens=r.input_len, cached_tokens=r.local_hit, generated_tokens=r.generated,
                    reason="length"))
            rec.scheduler(len(self.running), len(self.waiting), min(1.0, self.active_tokens / self.capacity))
        if self.waiting:
            self._admit(now)
        self._step(now)

    def _maybe_stop(self, now: float) -> None:
        if self.state == DRAINING and self.idle():
            self.dep._stop(self, now)


class Proxy:
    """The P/D proxy in front of both pools: a scrape target like a replica (``name``, ``pool``,
    ``state``, ``metrics``) serving the client scope. It does not crash or scale."""

    pool = Pool.CLIENT.value
    state = READY
    was_ready = True

    def __init__(self, dep: Deployment, name: str = PROXY_NAME) -> None:
        self.name = name
        self.stale_marked = True
        self.metrics: ClientMetrics | None = None
        if dep.record:
            self.metrics = ClientMetrics(dep.model, name, in_flight=lambda: dep.in_flight, env=dep.metrics_env)


class Deployment:
    """A simulated P/D deployment. Drive it with ``submit`` + ``run_until``; scale it with
    ``set_replicas``; read ``summary()``."""

    def __init__(self, profile: Profile, prefill: int = 2, decode: int = 2, *, seed: int = 0,
                 faults: FaultSchedule | None = None, record: bool = True, epoch: float = DEFAULT_EPOCH,
                 trace_block_tokens: int = 512, slo_ttft_s: float = TTFT_SLO_S, slo_tpot_s: float = TPOT_SLO_S,
                 metrics_env: dict[str, str] | None = None, warm: bool = True) -> None:
        self.profile = profile
        self.model = profile.model
        self.rng = random.Random(seed)
        self.faults = faults or FaultSchedule()
        self.record = record
        self.epoch = epoch
        self.trace_block_tokens = trace_block_tokens
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.metrics_env = metrics_env or {}
        self.frontend_s = profile.frontend_s
        self.router_pass_s = profile.router_overhead_s / 3  # the proxy's own time per pass (three per request)
        self.to_prefill_s = self.frontend_s + self.router_pass_s  # proxy arrival -> prefill engine arrival
        self.between_legs_s = 2 * self.frontend_s + self.router_pass_s  # prefill done -> decode engine arrival
        self.to_client_s = self.frontend_s + self.router_pass_s  # a token at decode -> at the client
        self.in_flight = 0  # requests the proxy is serving (arrived, not ended)
        self.restore_s_per_token = profile.kv.restore_s_per_gb * profile.kv.bytes_per_token / 1e9
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.replicas: list[Replica] = []
        self._names = {"prefill": 0, "decode": 0}
        self.requests: list[Req] = []
        self.done: list[Req] = []
        self.aborted: list[Req] = []
        self.rejected: list[Req] = []
        self.scaling_actions = 0
        self.timeline: list[tuple[float, int, int, int, int]] = []  # t, P ready, D ready, P total, D total
        self.listeners: list[Callable[[Deployment], None]] = []
        self._rr = 0
        self.proxy = Proxy(self)
        for _ in range(prefill):
            self._add("prefill", warm)
        for _ in range(decode):
            self._add("decode", warm)
        for c in self.faults.crashes:
            self.at(c.at_s, self._crash, c)
        self._record_timeline()

    # -- events -------------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable, arg=None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def every(self, interval_s: float, fn: Callable[[Deployment, float], None], start_s: float | None = None) -> None:
        """Call ``fn(dep, now)`` every ``interval_s`` of simulated time."""
        def tick(_arg) -> None:
            fn(self, self.now)
            self.at(self.now + interval_s, tick)
        self.at(interval_s if start_s is None else start_s, tick)

    def run_until(self, t_end: float) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= t_end:
            t, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
        self.now = max(self.now, t_end)

    def jitter(self, rel: float) -> float:
        return max(0.2, 1.0 + rel * self.rng.gauss(0.0, 1.0)) if rel else 1.0

    # -- load ---------------------------------------------------------------------------------------
    def submit(self, trace: Trace, offset_s: float = 0.0) -> int:
        """Schedule the trace's arrivals (plus the extra copies load-spike faults ask for)."""
        spikes = self.faults.spikes
        n = 0
        reqs: Iterable[TraceRequest] = trace.requests
        for tr in reqs:
            t = tr.t + offset_s
            copies = 1
            for s in spikes:
                if s.start_s <= t < s.end_s:
                    whole = int(s.factor)
                    copies = copies * whole + (1 if self.rng.random() < s.factor - whole else 0) * copies
            for i in range(copies):
                r = Req(len(self.requests), tr, t + (self.rng.uniform(0, 1.0) if i else 0.0))
                self.requests.append(r)
                r.p_arrival = r.arrival + self.to_prefill_s
                self.at(r.p_arrival, self._arrive, r)
                n += 1
        return n

    def _arrive(self, r: Req) -> None:
        if r.input_len + r.output_len > self.profile.max_model_len:
            # vLLM refuses a prompt plus its max_tokens beyond max_model_len with a 400 before any
            # work: no queue, no prefill, not the deployment's SLA (it counts apart, as ``rejected``),
            # and the proxy counts the client's own 4xx as client_error, not as an error
            r.status = "rejected"
            self.rejected.append(r)
            if self.proxy.metrics is not None:
                self.proxy.metrics.failed(outcome_of_status(400), self.now + self.to_client_s - r.arrival)
            return
        cands = [p for p in self.replicas if p.pool == "prefill" and p.state == READY]
        if not cands:  # the proxy answers 503 at once: never in flight
            self._abort(r, in_flight=False)
            return
        self.in_flight += 1
        best = min(cands, key=lambda p: p.route_cost(r))
        best.enqueue(r, self.now)

    def _abort(self, r: Req, in_flight: bool = True) -> None:
        """A request the deployment could not serve (no ready replica, or its engine crashed).
        The client sees an error status or a failed leg: ``outcome="error"`` (the contract's
        ``aborted`` is a client going away, which the simulator does not model; a failed KV
        transfer is recomputed on the decode side, as vLLM does, and still ends ``ok``)."""
        r.status = "aborted"
        self.aborted.append(r)
        if in_flight:
            self.in_flight -= 1
        m = self.proxy.metrics
        if m is not None:  # the error answer reaches the client one pass later
            m.failed(Outcome.ERROR, self.now + self.to_client_s - r.arrival, first_token=r.first_token >= 0)

    def _to_decode_now(self, r: Req) -> None:
        self.to_decode(r, self.now)

    def to_decode(self, r: Req, now: float) -> None:
        cands = [d for d in self.replicas if d.pool == "decode" and d.state == READY]
        if not cands:
            r.p_replica.release(r)
            self._abort(r)
            return
        best = min(cands, key=lambda d: (d.load(), -d.cache.gpu.prefix_len(r.hashes) if r.hashes else 0))
        best.enqueue(r, now)

    def _finished(self, r: Req) -> None:
        self.done.append(r)
        self.in_flight -= 1

    def _client_first_tokens(self, reqs: list[Req]) -> None:
        """Client TTFT and its stages of requests whose first token was just generated, as the
        proxy measures them when it forwards that token: arrival at the proxy -> first token
        forwarded; prefill request sent -> answer received; decode request sent -> first token
        received; the proxy's own share is what the two legs do not explain."""
        m = self.proxy.metrics
        if m is None:
            return
        fe2, out = 2 * self.frontend_s, self.to_client_s
        ttft, pleg, dleg, proxy = [], [], [], []
        for r in reqs:
            t = r.first_token + out - r.arrival
            p = r.p_done - r.p_arrival + fe2
            d = r.first_token - r.d_arrival + fe2
            ttft.append(t)
            pleg.append(p)
            dleg.append(d)
            proxy.append(max(0.0, t - p - d))
        m.first_tokens(ttft, pleg, dleg, proxy)

    def _client_finished(self, reqs: list[Req]) -> None:
        """Client TPOT, e2e (arrival -> last byte) and ``outcome="ok"`` of requests whose last
        token was just generated."""
        m = self.proxy.metrics
        if m is None:
            return
        out = self.to_client_s
        m.finished([(r.finish - r.first_token) / (r.generated - 1) for r in reqs if r.generated > 1],
                   [r.finish + out - r.arrival for r in reqs])

    def client_ttft(self, r: Req) -> float:
        """TTFT as the client sees it (first token forwarded by the proxy)."""
        return r.first_token + self.to_client_s - r.arrival

    # -- replicas -----------------------------------------------------------------------------------
    def _add(self, pool: str, warm: bool = False) -> Replica:
        i = self._names[pool]
        self._names[pool] += 1
        name = f"{pool[0]}{i}"
        rep = PrefillReplica(self, name) if pool == "prefill" else DecodeReplica(self, name)
        self.replicas.append(rep)
        rep.boot(self.now, self.now if warm else self.now + self.profile.cold_start_s)
        if warm:
            self.run_due()
        return rep

    def run_due(self) -> None:
        """Process events due now (used while building the deployment)."""
        self.run_until(self.now)

    def pool_counts(self, pool: str) -> dict[str, int]:
        out = {STARTING: 0, READY: 0, DRAINING: 0}
        for r in self.replicas:
            if r.pool == pool and r.state in out:
                out[r.state] += 1
        return out

    def set_replicas(self, pool: str, n: int) -> int:
        """Scale ``pool`` to ``n`` (ready + starting). Returns the change applied."""
        n = max(0, int(n))
        live = [r for r in self.replicas if r.pool == pool and r.state in (STARTING, READY)]
        delta = n - len(live)
        if delta > 0:
            revived = [r for r in self.replicas if r.pool == pool and r.state == DRAINING][:delta]
            for r in revived:  # cancel a drain before starting new machines
                r.state = READY
            for _ in range(delta - len(revived)):
                self._add(pool)
        elif delta < 0:
            # Remove starting replicas first (cheapest), then the least loaded ready ones.
            victims = sorted(live, key=lambda r: (r.state != STARTING, r.load()))[: -delta]
            for r in victims:
                if r.state == STARTING:
                    self._stop(r, self.now)
                else:
                    r.state = DRAINING
                    if r.idle() and not getattr(r, "held", None):
                        self._stop(r, self.now)
        if delta:
            self.scaling_actions += 1
            self._notify()
        return delta

    def rolling_restart(self, name: str) -> bool:
        """Replace replica ``name``: start a fresh one now, drain the old one once it is ready
        (surge first, so capacity never dips). Not a scaling action."""
        rep = next((r for r in self.replicas if r.name == name and r.state == READY), None)
        if rep is None:
            return False
        self._add(rep.pool)
        self._notify()  # the surge replica is held (and counted in the timeline) from now, not once ready
        self.at(self.now + self.profile.cold_start_s, self._retire, rep)
        return True

    def _retire(self, rep: Replica) -> None:
        if rep.state == READY:
            rep.state = DRAINING
            if rep.idle() and not getattr(rep, "held", None):
                self._stop(rep, self.now)
            self._notify()

    def _stop(self, r: Replica, now: float) -> None:
        r.close_gpu_time(now)
        r.state = STOPPED
        r.stopped_at = now
        r.generation += 1
        r.metrics = None
        self._notify()

    def _crash(self, c) -> None:
        rep = next((r for r in self.replicas if r.name == c.replica and r.state in (READY, DRAINING)), None)
        if rep is None:
            return
        now = self.now
        draining = rep.state == DRAINING
        rep.state = DOWN
        lost = list(rep.waiting) + list(rep.running)
        if isinstance(rep, DecodeReplica):
            lost += rep.ready_q + list(rep.transferring.values())
            rep.ready_q = []
            rep.transferring = {}
        for r in lost:
            if r.p_replica is not None and r.p_replica is not rep:
                r.p_replica.release(r)  # a decode request queued for KV space: its prefill KV is freed
            self._abort(r)
        rep.waiting.clear()
        rep.running = []
        rep.active_tokens = 0
        rep.busy = False
        if isinstance(rep, PrefillReplica):
            rep.pending_tokens = 0
            rep.held = set()  # its KV is gone: pulls from it fail
        rep.cache = PrefixCache(rep.cache.gpu.capacity, rep.cache.cpu.capacity if rep.cache.cpu else 0)
        rep.metrics = None  # endpoint goes dark; counters restart from zero on the new process
        rep.generation += 1
        if draining:  # it was told to go: it stops, it does not come back as an unordered replica
            self._stop(rep, now)
            return
        delay = self.profile.cold_start_s if c.restart_after_s is None else c.restart_after_s
        rep.close_gpu_time(now)  # the machine stays rented while it restarts
        rep.boot(now, now + delay)
        rep.alive_since = now
        self._notify()  # after boot: the timeline counts the restarting replica (its GPUs are held)

    def _notify(self) -> None:
        self._record_timeline()
        for fn in self.listeners:
            fn(self)

    def _record_timeline(self) -> None:
        p, d = self.pool_counts("prefill"), self.pool_counts("decode")
        self.timeline.append((self.now, p[READY], d[READY], sum(p.values()), sum(d.values())))

    def sample_processes(self) -> None:
        for r in self.replicas:
            if r.state in (READY, DRAINING):
                r.sample_processes(self.now)

    # -- results ------------------------------------------------------------------------------------
    def gpu_hours(self) -> float:
        total = 0.0
        for r in self.replicas:
            total += r.gpu_seconds
            if r.state != STOPPED:
                total += self.now - r.alive_since
        return total * self.profile.gpus_per_replica / 3600.0

    def summary(self) -> Summary:
        import numpy as np

        # arrivals are submitted up front: a summary taken mid-run (an interrupted demo) counts the
        # requests sent so far, not later ones as unfinished misses
        n = sum(1 for r in self.requests if r.arrival <= self.now)
        fin = self.done
        out = self.to_client_s
        ttft = np.array([r.first_token + out - r.arrival for r in fin], dtype=float)
        tpot = np.array([(r.finish - r.first_token) / (r.generated - 1) if r.generated > 1 else 0.0 for r in fin],
                        dtype=float)
        ok = int(np.count_nonzero((ttft <= self.slo_ttft_s) & (tpot <= self.slo_tpot_s))) if fin else 0

        def q(a: np.ndarray, p: float) -> float:
            return round(float(np.quantile(a, p)), 6) if a.size else float("nan")

        multi = tpot[[r.generated > 1 for r in fin]] if fin else tpot
        return Summary(
            requests=n, finished=len(fin), aborted=len(self.aborted),
            unfinished=n - len(fin) - len(self.aborted) - len(self.rejected),
            slo_attainment=round(ok / (n - len(self.rejected)), 6) if n > len(self.rejected) else float("nan"),
            ttft_p50_s=q(ttft, 0.5), ttft_p90_s=q(ttft, 0.9),
            tpot_mean_s=round(float(multi.mean()), 6) if multi.size else float("nan"), tpot_p90_s=q(multi, 0.9),
            gpu_hours=round(self.gpu_hours(), 4), scaling_actions=self.scaling_actions,
            sim_duration_s=round(self.now, 3), rejected=len(self.rejected))
