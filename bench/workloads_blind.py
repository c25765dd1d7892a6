"""Blind workload suite for the autoscaling benchmark: ``suite("tuning-more")`` and ``suite("sealed")``.

Written without reading the project's own workload generator (``sla_guard/sim/workloads.py``, apart
from the ``Workload`` dataclass it exports), its agentic trace generator, its scaling advisor or its
policies, so that the advisor can be checked on traffic it was not tuned to. Only the trace types
(``sla_guard.sim.traces``), the deployment profile and fixed-size benchmark runs were used to pick
the load scale.

Each split holds one workload per generated family plus one replay of a shared trace: eight in all.
"tuning-more" draws its seeds from 800-899, "sealed" from 900-999; the family name and the seed feed
every random choice (``numpy.random.default_rng``), so a split always builds the same requests.

Arrivals
    Every generated family (but ``agentic``) has a designed rate envelope r(t) (requests/s on 10 s
    bins; ``swing`` = max r / min r). Arrivals are a Cox process on it: each 30 s window gets a
    gamma-distributed multiplier (mean 1, CV 0.2), then a Poisson count per 10 s bin, uniform times
    inside the bin. So counts are overdispersed (short-lived hot spots) around the envelope.

Requests (chat-like families)
    A prompt is a sequence of content segments: a system prompt drawn from a Zipf-popular pool,
    with probability 45%-80% a long attached document (RAG / file upload: lognormal, median 22K-34K
    tokens, cap 56K; documents come from a Zipf-popular pool, so popular ones are shared), then the
    conversation. Each arrival either continues an open conversation (follow-up probability set by
    the workload's prefix-sharing level; the history, previous answers included, is the new prompt's
    prefix) or opens a new one. Prefix-block hashes are chained per 512-token block over the exact
    segment content, so two prompts share block i only if everything up to the end of block i is
    equal. Sharing levels: "low" (400 system prompts, 15% follow-ups, 6000 documents, flat
    popularity), "mid" (60, 35%, 2000), "high" (8 system prompts, 55% follow-ups, 1200 documents,
    Zipf 1.0).
    Outputs are a mixture of short answers (lognormal median ~250), and reasoning-length answers
    (lognormal median ~3000, cap 16K) whose share varies per workload (5%-70%): some workloads load
    decode, most load prefill. MTP acceptance (multiplier of the profile's per-position rates) is drawn
    per workload from 0.65-1.0.

Families
    bursty            steady base rate with 3-6 non-overlapping bursts (MMPP-like; 4-8 min each,
                      separated by random gaps), each burst at the same multiple (2.5x-4x) of the base.
    diurnal           a compressed day: one or 1.25 cycles of a sinusoid plus a second harmonic (a
                      lunch dip) over the workload; peak/trough 2.5x-4x.
    step_up           low plateau, then one or two abrupt upward steps (total 2.5x-4.5x).
    step_down         starts at the peak, then one or two abrupt downward steps.
    ramp              low plateau, slow linear ramp up over 20-30 min, plateau, then a slow partial
                      ramp down.
    agentic           coding-agent sessions, not an envelope of single requests: sessions start as a
                      Poisson process whose intensity follows a workday shape (low, ramp up, plateau,
                      decline) and are simulated from 20 min before t=0 so the run starts mid-traffic.
                      A session's context is a shared harness prompt (one of 2-3, 12K-24K tokens), a
                      repository context shared by sessions on the same project (Zipf), and the task;
                      each turn appends the model's output and a tool result (lognormal, heavy-tailed
                      file reads), pauses for the tool (lognormal, median ~3 s, long tail) and sends the
                      grown context again. Contexts over ~160K tokens are compacted (a summary replaces
                      the history: the cached prefix breaks). With some probability per turn the agent
                      fans out to 2-6 sub-agents (Pareto-ish count) that share the harness + repository
                      prefix, run 2-8 turns each, and the parent resumes with their reports appended
                      once the last one finishes. ``swing`` is the ratio of the session-start intensity.
    surge_after_quiet a quiet period of 38-48 min at a trickle, then a sudden surge (6x-10x) that
                      lasts 12-20 min, with a short overshoot at its start.
    trace_phases      a replay of the shared Mooncake conversation trace (real arrivals, lengths and
                      prefix hashes) in 4-5 phases: each phase replays its own slice of the trace at its
                      own speed (0.35x-1.6x), thinned to 65% of the requests; a slice that runs past the
                      end of the trace wraps around with shifted hashes (new conversations). ``swing``
                      is the ratio of the fastest to the slowest phase speed.

Load scale: each generated trace is built at a pilot rate, its prefill work is estimated from the
profile's step-time model, and it is rebuilt at the rate that puts the peak at 3.5-5.5 busy prefill
replicas, capped at 2 requests/s on average and 3.6 at the peak (the cap binds for most chat draws:
the estimate is conservative). The request mix was then sized with fixed-size runs
(``bench_policies.run_one(..., "static")``): the troughs are served by 1-2 prefill and 1 decode
replica, the peaks need 3-5 prefill replicas (about 2 for the "high" sharing draws, whose documents
are mostly cached), or 2 decode replicas for the reasoning-heavy, low-acceptance draws.
"""

from __future__ import annotations

import functools
import math
import zlib
from pathlib import Path

import numpy as np

from sla_guard.sim.traces import BUNDLED_MOONCAKE, Trace, TraceRequest, load_trace
from sla_guard.sim.workloads import Workload

SPLITS = ("tuning-more", "sealed")
FAMILIES = ("bursty", "diurnal", "step_up", "step_down", "ramp", "agentic", "surge_after_quiet")
TRACE_FAMILY = "trace_phases"
SEED_BASE = {"tuning-more": 800, "sealed": 900}
BLOCK = 512
BIN_S = 10.0
# the shared Mooncake trace beside the checkout, else the package's bundled copy (the same file, gzipped)
SHARED_MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MOONCAKE = SHARED_MOONCAKE if SHARED_MOONCAKE.exists() else BUNDLED_MOONCAKE

# Load scale. Each generated trace is built twice: once at a pilot scale, to measure its prefill work
# (seconds of one prefill replica per request, by the profile's step-time model, counting a prefix
# block as cached once any earlier request had it), then at the scale that makes the envelope's peak
# need about ``peak_prefill`` replicas (drawn per workload) at PREFILL_BUSY utilisation. PREFILL_BUSY
# folds in what the ideal-cache estimate misses (misses across replicas, queueing for the TTFT SLA);
# it was set from static runs. The rate is then capped (mean and peak requests/s).
PREFILL_BUSY = 0.75
MAX_MEAN_RPS = 2.0
MAX_PEAK_RPS = 3.6
MIN_PEAK_RPS = 1.2


def _rng(family: str, seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(family.encode()), seed, stream])


# ----------------------------------------------------------------------------------------------------
# prefix-block hashing over content segments


class _Interner:
    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}

    def get(self, key: tuple) -> int:
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.ids)
        return i


class _Context:
    """An append-only prompt: full blocks already hashed, plus the pieces of the partial last block."""

    __slots__ = ("full", "intern", "pieces", "room", "tokens")

    def __init__(self, intern: _Interner) -> None:
        self.intern = intern
        self.full: list[int] = []
        self.pieces: list[tuple[int, int, int]] = []
        self.room = BLOCK
        self.tokens = 0

    def copy(self) -> _Context:
        c = _Context(self.intern)
        c.full = list(self.full)
        c.pieces = list(self.pieces)
        c.room = self.room
        c.tokens = self.tokens
        return c

    def append(self, seg: int, n: int) -> None:
        n = int(n)
        self.tokens += n
        off = 0
        if self.pieces:  # fill the partial block first
            take = min(n, self.room)
            self.pieces.append((seg, 0, take))
            off, n = take, n - take
            self.room -= take
            if self.room:
                return
            prev = self.full[-1] if self.full else -1
            self.full.append(self.intern.get((prev, tuple(self.pieces))))
            self.pieces = []
            self.room = BLOCK
        ids = self.intern.ids
        full = self.full
        prev = full[-1] if full else -1
        while n >= BLOCK:  # whole blocks of this segment alone
            key = (prev, seg, off)
            prev = ids.get(key, -2)
            if prev == -2:
                prev = ids[key] = len(ids)
            full.append(prev)
            off += BLOCK
            n -= BLOCK
        if n:
            self.pieces.append((seg, off, off + n))
            self.room = BLOCK - n

    def hashes(self) -> tuple[int, ...]:
        if not self.pieces:
            return tuple(self.full)
        prev = self.full[-1] if self.full else -1
        return (*self.full, self.intern.get((prev, tuple(self.pieces))))


class _Segs:
    def __init__(self) -> None:
        self.n = 0

    def new(self) -> int:
        self.n += 1
        return self.n


# ----------------------------------------------------------------------------------------------------
# rate envelopes (requests/s per 10 s bin, relative: peak = 1)


def _grid(duration_s: float) -> np.ndarray:
    return (np.arange(math.ceil(duration_s / BIN_S)) + 0.5) * BIN_S


def _envelope(family: str, seed: int) -> tuple[float, np.ndarray, str]:
    """(duration_s, relative rate per bin with max 1, note) of a generated family."""
    g = _rng(family, seed, 1)
    if family == "bursty":
        dur = float(g.uniform(50, 70)) * 60
        t = _grid(dur)
        mult = float(g.uniform(2.5, 4.0))
        r = np.ones_like(t)
        s = float(g.uniform(3, 8)) * 60
        n = 0
        while True:
            length = float(g.uniform(4, 8)) * 60
            if s + length > dur - 60:
                break
            r[(t >= s) & (t < s + length)] = mult
            n += 1
            s += length + float(g.uniform(4, 12)) * 60
        note = f"{n} bursts at {mult:.2f}x base"
    elif family == "diurnal":
        dur = float(g.uniform(55, 72)) * 60
        t = _grid(dur)
        cycles = float(g.choice([1.0, 1.25]))
        phase = float(g.uniform(0, 2 * math.pi))
        x = 2 * math.pi * cycles * t / dur + phase
        shape = np.sin(x) + float(g.uniform(0.15, 0.35)) * np.sin(2 * x + float(g.uniform(0, 6.28)))
        target = float(g.uniform(2.5, 4.0))
        lo, hi = shape.min(), shape.max()
        r = 1.0 + (shape - lo) / (hi - lo) * (target - 1.0)
        note = f"{cycles} cycles, peak/trough {target:.2f}"
    elif family in ("step_up", "step_down"):
        dur = float(g.uniform(50, 70)) * 60
        t = _grid(dur)
        total = float(g.uniform(2.5, 4.5))
        two = bool(g.random() < 0.5)
        if two:
            cuts = sorted(g.uniform(0.25, 0.75, 2) * dur)
            while cuts[1] - cuts[0] < 0.18 * dur:
                cuts = sorted(g.uniform(0.25, 0.75, 2) * dur)
            mid = float(np.sqrt(total) * g.uniform(0.85, 1.15))
            levels, edges = [1.0, mid, total], cuts
        else:
            levels, edges = [1.0, total], [float(g.uniform(0.3, 0.55)) * dur]
        if family == "step_down":
            levels = levels[::-1]
        r = np.full_like(t, levels[0])
        for lvl, e in zip(levels[1:], edges, strict=True):
            r[t >= e] = lvl
        note = "levels " + " -> ".join(f"{x:.2f}" for x in levels) + " at min " + \
            ", ".join(f"{e / 60:.0f}" for e in edges)
    elif family == "ramp":
        dur = float(g.uniform(55, 75)) * 60
        t = _grid(dur)
        total = float(g.uniform(2.5, 4.0))
        a = float(g.uniform(6, 12)) * 60
        b = a + float(g.uniform(20, 30)) * 60
        c = b + float(g.uniform(6, 12)) * 60
        back = float(g.uniform(0.3, 0.6))  # share of the rise given back at the end
        end_lvl = total - back * (total - 1.0)
        r = np.interp(t, [0, a, b, c, dur], [1.0, 1.0, total, total, end_lvl])
        note = f"ramp 1 -> {total:.2f} over min {a / 60:.0f}-{b / 60:.0f}, down to {end_lvl:.2f}"
    elif family == "agentic":
        dur = float(g.uniform(50, 70)) * 60
        t = _grid(dur)
        total = float(g.uniform(2.0, 3.0))
        a = float(g.uniform(5, 10)) * 60
        b = a + float(g.uniform(12, 18)) * 60
        c = dur - float(g.uniform(8, 14)) * 60
        end_lvl = total * float(g.uniform(0.45, 0.65))
        r = np.interp(t, [0, a, b, c, dur], [1.0, 1.0, total, total, max(1.0, end_lvl)])
        note = f"session starts 1 -> {total:.2f} (ramp min {a / 60:.0f}-{b / 60:.0f})"
    elif family == "surge_after_quiet":
        quiet = float(g.uniform(38, 48)) * 60
        dur = quiet + float(g.uniform(12, 20)) * 60
        t = _grid(dur)
        total = float(g.uniform(6.0, 10.0))
        r = np.ones_like(t)
        r[t >= quiet] = total / 1.25
        r[(t >= quiet) & (t < quiet + 180)] = total  # overshoot: 3 min at the full surge
        note = f"quiet {quiet / 60:.0f} min, surge {total:.1f}x"
    else:
        raise ValueError(f"unknown family {family!r}")
    return dur, r / r.max(), note


def _arrivals(g: np.random.Generator, rate: np.ndarray) -> np.ndarray:
    """Cox process: gamma(shape 25, CV 0.2) multiplier per 30 s window, Poisson per 10 s bin."""
    per = int(30 / BIN_S)
    mod = np.repeat(g.gamma(25.0, 0.04, size=len(rate) // per + 1), per)[: len(rate)]
    counts = g.poisson(rate * mod * BIN_S)
    starts = np.repeat(np.arange(len(rate)) * BIN_S, counts)
    return np.sort(starts + g.uniform(0, BIN_S, size=len(starts)))


# ----------------------------------------------------------------------------------------------------
# request mix of the chat-like families

SHARING = {  # n system prompts, Zipf exponent, follow-up probability, document pool size
    "low": (400, 0.6, 0.15, 6000),
    "mid": (60, 0.9, 0.35, 2000),
    "high": (8, 1.0, 0.55, 1200),
}


def _mix(family: str, seed: int) -> dict:
    g = _rng(family, seed, 3)
    return {
        "sharing": str(g.choice(list(SHARING))),
        "p_doc": float(g.uniform(0.45, 0.8)),
        "doc_median": float(g.uniform(22_000, 34_000)),
        "p_reason": float(g.choice([0.05, 0.15, 0.4, 0.7])),
        "peak_prefill": float(g.uniform(3.5, 5.5)),
        "acceptance": float(g.choice([0.65, 0.75, 0.85, 0.95, 1.0])),
        "sys_median": float(g.uniform(1500, 6000)),
    }


def _clip(x: float, lo: int, hi: int) -> int:
    return int(min(max(x, lo), hi))


def _zipf_pick(g: np.random.Generator, n: int, a: float) -> int:
    w = 1.0 / np.arange(1, n + 1) ** a
    return int(g.choice(n, p=w / w.sum()))


def _chat_trace(name: str, family: str, seed: int, dur: float, rel: np.ndarray, scale: float) -> Trace:
    m = _mix(family, seed)
    g = _rng(family, seed, 2)
    rate = rel * scale
    times = _arrivals(g, rate)
    n_sys, zipf_a, p_follow, n_docs = SHARING[m["sharing"]]
    intern, segs = _Interner(), _Segs()
    sys_cdf = np.cumsum(1.0 / np.arange(1, n_sys + 1) ** zipf_a)
    doc_cdf = np.cumsum(1.0 / np.arange(1, n_docs + 1) ** zipf_a)
    sys_len = np.clip(g.lognormal(math.log(m["sys_median"]), 0.7, n_sys), 200, 20_000).astype(int)
    doc_len = np.clip(g.lognormal(math.log(m["doc_median"]), 0.35, n_docs), 4_000, 56_000).astype(int)
    sys_seg = [segs.new() for _ in range(n_sys)]
    doc_seg = [segs.new() for _ in range(n_docs)]
    open_convs: list[list] = []  # [ready_at, last_t, context, sid]
    reqs: list[TraceRequest] = []
    next_sid = 0
    for i, t in enumerate(times):
        t = float(t)
        if t >= dur:
            break
        if i % 50 == 0:
            open_convs = [c for c in open_convs if t - c[1] < 900]
        conv = None
        if open_convs and g.random() < p_follow:
            for _ in range(6):  # a random open conversation whose user is ready to ask again
                c = open_convs[int(g.integers(len(open_convs)))]
                if c[0] <= t and t - c[1] < 900:
                    conv = c
                    break
        if conv is not None:
            ctx = conv[2]
            ctx.append(segs.new(), _clip(g.lognormal(math.log(250), 1.0), 5, 8000))
            if ctx.tokens > 100_000:  # too long: the user starts over
                open_convs.remove(conv)
                conv = None
        if conv is None:
            ctx = _Context(intern)
            k = int(np.searchsorted(sys_cdf, g.random() * sys_cdf[-1]))
            ctx.append(sys_seg[k], sys_len[k])
            if g.random() < m["p_doc"]:
                d = int(np.searchsorted(doc_cdf, g.random() * doc_cdf[-1]))
                ctx.append(doc_seg[d], doc_len[d])
            ctx.append(segs.new(), _clip(g.lognormal(math.log(300), 1.1), 5, 12_000))
            conv = [0.0, t, ctx, next_sid]
            next_sid += 1
            open_convs.append(conv)
        if g.random() < m["p_reason"]:
            out = _clip(g.lognormal(math.log(3000), 0.5), 300, 16_000)
        else:
            out = _clip(g.lognormal(math.log(250), 0.9), 4, 3000)
        reqs.append(TraceRequest(t, ctx.tokens, out, ctx.hashes(), conv[3], conv[3]))
        ctx.append(segs.new(), out)
        conv[1] = t
        conv[0] = t + out * 0.02 + 3.0 + float(g.lognormal(math.log(25), 1.0))  # read + think + type
    return Trace(name, tuple(reqs), BLOCK)


# ----------------------------------------------------------------------------------------------------
# agentic sessions

AGENT_PILOT = 0.08  # pilot session starts/s at the envelope peak


def _agentic_trace(name: str, seed: int, dur: float, rel: np.ndarray, scale: float) -> Trace:
    g = _rng("agentic", seed, 2)
    intern, segs = _Interner(), _Segs()
    n_harness = int(g.integers(2, 4))
    harness = [(segs.new(), int(g.uniform(12_000, 24_000))) for _ in range(n_harness)]
    n_repos = 40
    repos = [(segs.new(), _clip(g.lognormal(math.log(30_000), 0.5), 5000, 80_000)) for _ in range(n_repos)]
    lead = 1200.0  # simulate from 20 min before t=0
    # session-start intensity on [-lead, dur): first bin's value before t=0
    pre = np.full(int(lead / BIN_S), rel[0])
    starts_rate = np.concatenate([pre, rel]) * scale
    starts = _arrivals(g, starts_rate) - lead
    reqs: list[TraceRequest] = []
    agent_ids = [0]

    def tool_out() -> int:
        return _clip(g.lognormal(math.log(1500), 1.1), 20, 40_000)

    def model_out(long_p: float = 0.12) -> int:
        if g.random() < long_p:
            return _clip(g.lognormal(math.log(1500), 0.6), 200, 8000)
        return _clip(g.lognormal(math.log(180), 0.8), 10, 2000)

    def pause() -> float:
        return float(min(600.0, g.lognormal(math.log(3.0), 1.5)))

    def compact(ctx: _Context, base: _Context) -> _Context:
        new = base.copy()
        new.append(segs.new(), int(g.uniform(2500, 6000)))
        return new

    def run(sid: int, t: float, base: _Context, ctx: _Context, turns: int, depth: int) -> float:
        """Runs one agent from time t; returns when it finishes."""
        aid = agent_ids[0]
        agent_ids[0] += 1
        for _ in range(turns):
            if t >= dur:
                return t
            out = model_out()
            if t >= 0:
                reqs.append(TraceRequest(t, ctx.tokens, out, ctx.hashes(), sid, aid))
            ctx.append(segs.new(), out)
            t += 0.5 + out * 0.018
            if depth == 0 and g.random() < 0.03:  # fan out to sub-agents
                k = min(6, 2 + int(g.pareto(2.0)))
                ends = []
                for _ in range(k):
                    sub = base.copy()
                    sub.append(segs.new(), int(g.uniform(300, 1500)))
                    ends.append(run(sid, t + float(g.uniform(0, 1.5)), base, sub, int(g.integers(2, 9)), 1))
                t = max(ends) + 0.5
                for _ in range(k):
                    ctx.append(segs.new(), int(g.uniform(200, 900)))
            else:
                ctx.append(segs.new(), tool_out())
                t += pause()
            if ctx.tokens > 160_000:
                ctx = compact(ctx, base)
        return t

    for sid, s in enumerate(starts):
        base = _Context(intern)
        h = harness[int(g.integers(n_harness))]
        base.append(*h)
        r = repos[_zipf_pick(g, n_repos, 1.1)]
        base.append(*r)
        ctx = base.copy()
        ctx.append(segs.new(), _clip(g.lognormal(math.log(600), 0.8), 50, 6000))
        turns = _clip(g.lognormal(math.log(9), 0.4), 3, 40)
        run(sid, float(s), base, ctx, turns, 0)
    reqs.sort(key=lambda r: r.t)
    return Trace(name, tuple(reqs), BLOCK)


# ----------------------------------------------------------------------------------------------------
# shared trace in phases


@functools.lru_cache(maxsize=1)
def _mooncake() -> Trace:
    return load_trace(MOONCAKE)


def _trace_plan(seed: int) -> tuple[list[tuple[float, float, float]], float]:
    """[(phase length s, speed, source offset s)], thinning keep share."""
    g = _rng(TRACE_FAMILY, seed, 1)
    n = int(g.integers(4, 6))
    speeds = [0.35, 0.6, 1.0, 1.6][: 4]
    extra = [float(g.uniform(0.5, 1.3)) for _ in range(n - 4)]
    order = [float(x) for x in g.permutation(speeds)] + extra
    lengths = g.uniform(10, 16, n) * 60
    offsets = g.uniform(0, 3000, n)
    return [(float(a), s, float(o)) for a, s, o in zip(lengths, order, offsets, strict=True)], 0.65


def _phases_trace(name: str, seed: int) -> Trace:
    src = _mooncake()
    plan, keep = _trace_plan(seed)
    g = _rng(TRACE_FAMILY, seed, 2)
    src_t = np.array([r.t for r in src.requests])
    span = float(src_t[-1]) + 1.0
    hash_step = src.max_hash() + 1
    out: list[TraceRequest] = []
    t0 = 0.0
    wraps = 0
    for length, speed, offset in plan:
        need = length * speed  # source seconds this phase replays
        a = offset
        done = 0.0
        while need - done > 1e-3:
            b = min(span, a + (need - done))
            lo, hi = np.searchsorted(src_t, [a, b])
            for i in range(lo, hi):
                if g.random() >= keep:
                    continue
                r = src.requests[i]
                hs = tuple(h + wraps * hash_step for h in r.hash_ids)
                out.append(TraceRequest(t0 + (done + r.t - a) / speed, r.input_len, r.output_len, hs))
            done += b - a
            if b >= span:
                a = 0.0
                wraps += 1
            else:
                a = b
        wraps += 1  # each phase's slice counts as new conversations
        t0 += length
    out.sort(key=lambda r: r.t)
    return Trace(name, tuple(out), src.block_tokens)


# ----------------------------------------------------------------------------------------------------
# suite


@functools.lru_cache(maxsize=1)
def _prefill_model() -> tuple[float, float, float]:
    from sla_guard.sim.profile import load_profile

    pf = load_profile("default").prefill
    return pf.step_base_s, pf.per_token_s, pf.per_token_per_kctx_s


def prefill_work(trace: Trace) -> float:
    """Seconds of one prefill replica the trace needs with an unbounded, shared prefix cache."""
    base, per_tok, per_kctx = _prefill_model()
    seen: set[int] = set()
    total = 0.0
    for r in trace.requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        cached = min(k * trace.block_tokens, r.input_len - 1)
        n = r.input_len - cached
        total += base + n * (per_tok + per_kctx * (cached + n / 2) / 1000)
        seen.update(r.hash_ids)
    return total


def _scaled_build(make, rel: np.ndarray, pilot: float, peak_prefill: float) -> Trace:
    """Builds ``make(scale)`` at the scale that puts the peak at ``peak_prefill`` busy prefill replicas."""
    tr = make(pilot)
    dur = len(rel) * BIN_S
    env_s = float(rel.sum()) * BIN_S  # seconds of peak-rate traffic the envelope is worth
    work_per_peak_s = prefill_work(tr) / env_s  # replica-seconds per second at the peak, at the pilot scale
    rps_per_pilot = len(tr.requests) / env_s  # requests/s at the peak, at the pilot scale
    scale = pilot * peak_prefill * PREFILL_BUSY / max(work_per_peak_s, 1e-9)
    peak_rps = rps_per_pilot * scale / pilot
    cap = min(MAX_PEAK_RPS, MAX_MEAN_RPS * dur / env_s)
    peak_rps = min(max(peak_rps, MIN_PEAK_RPS), cap)
    scale = pilot * peak_rps / max(rps_per_pilot, 1e-9)
    tr = make(scale)
    for _ in range(2):  # session traffic is not exactly linear in the scale: correct towards the target
        got = len(tr.requests) / env_s
        if abs(got / peak_rps - 1) < 0.08:
            break
        scale *= peak_rps / max(got, 1e-9)
        tr = make(scale)
    return tr


def _build_chat(name: str, family: str, seed: int, dur: float, rel: np.ndarray) -> Trace:
    m = _mix(family, seed)
    return _scaled_build(functools.partial(_chat_trace, name, family, seed, dur, rel), rel, 0.3, m["peak_prefill"])


def _build_agentic(name: str, seed: int, dur: float, rel: np.ndarray) -> Trace:
    peak = float(_rng("agentic", seed, 3).uniform(3.5, 5.5))
    return _scaled_build(functools.partial(_agentic_trace, name, seed, dur, rel), rel, AGENT_PILOT, peak)


def _seed(split: str, family: str) -> int:
    """One seed per family in the split's range, spread over it."""
    k = (*FAMILIES, TRACE_FAMILY).index(family)
    return SEED_BASE[split] + (k * 13 + 7) % 100


def workload(family: str, seed: int, split: str) -> Workload:
    name = f"blind-{family}/s{seed}"
    if family == TRACE_FAMILY:
        plan, keep = _trace_plan(seed)
        speeds = [s for _, s, _ in plan]
        dur = sum(a for a, _, _ in plan)
        note = "mooncake phases " + ", ".join(f"{a / 60:.0f}min@{s:.2f}x" for a, s, _ in plan) + f", keep {keep}"
        return Workload(name, family, seed, split, dur, max(speeds) / min(speeds),
                        functools.partial(_phases_trace, name, seed), 1.0, note)
    dur, rel, note = _envelope(family, seed)
    swing = float(rel.max() / rel.min())
    if family == "agentic":
        acc = float(_rng(family, seed, 3).choice([0.8, 0.9, 1.0]))
        return Workload(name, family, seed, split, dur, swing, functools.partial(_build_agentic, name, seed, dur, rel),
                        acc, note)
    m = _mix(family, seed)
    note += f"; sharing {m['sharing']}, doc p {m['p_doc']:.2f}, reasoning p {m['p_reason']:.2f}"
    return Workload(name, family, seed, split, dur, swing, functools.partial(_build_chat, name, family, seed, dur, rel),
                    m["acceptance"], note)


def suite(split: str, seeds: tuple[int, ...] | None = None) -> list[Workload]:
    """One workload per kind at the split's fixed seeds, or (``seeds``) every kind at each of
    these, which must lie in the split's range (more cells to diagnose on, never the other split's)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    kinds = (*FAMILIES, TRACE_FAMILY)
    if seeds is None:
        return [workload(f, _seed(split, f), split) for f in kinds]
    lo = SEED_BASE[split]
    if bad := [s for s in seeds if not lo <= s < lo + 100]:
        raise ValueError(f"seeds {bad} are outside the {split} seeds {lo}-{lo + 99}")
    return [workload(f, s, split) for s in seeds for f in kinds]
