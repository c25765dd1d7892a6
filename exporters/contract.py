"""The metric contract: the one place every metric sla-guard emits is defined.

Engine hooks, the sidecar, the simulator, the guard, the dashboards and the alert rules all
derive names, types, labels and buckets from here; nothing else spells a metric name.

Names follow Prometheus conventions (base units, ``_total`` for counters, ``_seconds`` /
``_bytes`` / ``_ratio`` suffixes) under the ``slaguard_`` prefix. The prefix is deliberately not
``vllm:``: vLLM's own Prometheus logger unregisters every collector whose name starts with it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

PREFIX: Final = "slaguard_"


class Kind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Pool(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    # Not a pool of engines: what the client sees at the P/D router or proxy, end to end across
    # prefill, KV hand-off and decode. A pool-like scope value so that SLO sets, dashboards and
    # alerts address it the way they address the engine pools.
    CLIENT = "client"


ENGINE_POOLS: Final = (Pool.PREFILL, Pool.DECODE, Pool.MIXED)


class Component(StrEnum):
    """Who emits a metric; groups the generated docs and tells the guard what to expect."""

    ENGINE = "engine"  # the stat-logger hook (API-server process) or the simulator
    PROCESS = "process"  # the per-process sampler in every vLLM process
    KV_TRANSFER = "kv_transfer"  # kv_connector_stats (NIXL)
    HOOKS = "hooks"  # the hooks' own health
    ROUTER = "router"  # the client scope: sla-guard-proxy, or a router adapter (Dynamo, llm-d, ...)
    GUARD = "guard"  # the guard service itself


class Route(StrEnum):
    """How the router served a request."""

    PD = "pd"  # prefill on one engine, KV hand-off, decode on another
    AGGREGATED = "aggregated"  # one engine did both


class Outcome(StrEnum):
    """How a request ended, as the client saw it. Only ``error`` is the service failing:
    ``client_error`` and ``aborted`` are the client's doing, so an error rate charged to the
    operator is ``error / (ok + error)``."""

    OK = "ok"
    # the service failed it: an engine or the router answered 5xx, 429 or 408 (see
    # outcome_of_status), a leg failed (unreachable, past its deadline), or a stream broke or
    # carried an error event after its 200
    ERROR = "error"
    # refused as the client's own mistake: a 4xx answer other than 408 and 429 (malformed body,
    # prompt over max_model_len, unknown model, body too large, bad credentials)
    CLIENT_ERROR = "client_error"
    ABORTED = "aborted"  # the client went away before the answer was complete


# 4xx statuses that are the service's doing, not the client's. 429: the service refused load
# (rate limit, overload). 408: the server timed out waiting for a request; behind a router the
# request an engine waits for is the router's (it read the client's whole body before it called
# any engine), so a 408 from an engine is a stall on the operator's side, and clients retry 408
# as they retry 429 and 5xx.
SERVICE_4XX: Final = frozenset({408, 429})


def outcome_of_status(status: int) -> Outcome:
    """The outcome of a request the client got a whole answer to, from that answer's HTTP status:
    2xx ok, 4xx client_error (except ``SERVICE_4XX``), the rest error (a 3xx or 1xx final answer
    from an engine is a broken deployment, not an answer). The one place that choice is made."""
    if 400 <= status < 500 and status not in SERVICE_4XX:
        return Outcome.CLIENT_ERROR
    return Outcome.OK if 200 <= status < 300 else Outcome.ERROR


class Stage(StrEnum):
    """Where a P/D request's TTFT goes, in the order it is spent. The router measures the legs
    and its own time (``CLIENT_STAGE``); the engine stages come from the engine histograms."""

    PROXY = "proxy"  # the router's own work before, between and after the legs
    PREFILL_LEG = "prefill_leg"  # request sent to prefill -> prefill answer received
    DECODE_FIRST_LEG = "decode_first_leg"  # request sent to decode -> first token received


# Label sets. ENGINE_LABELS identify one vLLM engine (DP rank) of one pool of one model.
ENGINE_LABELS: Final = ("model", "pool", "engine")
PROCESS_LABELS: Final = (*ENGINE_LABELS, "role", "process")
GUARD_SLO_LABELS: Final = ("model", "pool", "slo")
# The client scope: pool is always "client"; route is "pd" (prefill then decode) or "aggregated"
# (one engine did both); router names the proxy / router instance that measured it.
CLIENT_LABELS: Final = ("model", "pool", "route", "router")

# SLA thresholds that must be bucket boundaries (defaults: mean TTFT <= 2.5 s, mean TPOT <= 20 ms,
# the production SLAs of "From Day 0 to Production SLAs", DaoCloud). Overridable at engine start
# through the environment, see bucket_override().
DEFAULT_TTFT_SLO_S: Final = 2.5
DEFAULT_TPOT_SLO_S: Final = 0.020

TTFT_BUCKETS: Final = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)
TPOT_BUCKETS: Final = (
    0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.5,
)
LATENCY_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)
KV_XFER_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
BYTES_BUCKETS: Final = tuple(float(2**p) for p in range(10, 36, 2))  # 1 KiB .. 32 GiB
COUNT_BUCKETS: Final = (1.0, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric of the contract. ``name`` is the full exposed family name (counters without
    ``_total``, as prometheus_client expects; ``exposed`` adds it)."""

    name: str
    kind: Kind
    help: str
    unit: str
    labels: tuple[str, ...]
    component: Component
    buckets: tuple[float, ...] = ()
    # How prometheus_client aggregates a gauge across processes in multiprocess mode.
    multiprocess_mode: str = "mostrecent"
    # OpenTelemetry GenAI semantic-convention name, where one exists.
    otel_name: str | None = None
    slo_threshold_env: str | None = field(default=None)

    @property
    def exposed(self) -> str:
        """The family name as it appears in an exposition (``_total`` for counters)."""
        return self.name + "_total" if self.kind is Kind.COUNTER else self.name

    def series(self, suffix: str = "") -> str:
        """A sample name: ``series('_bucket')`` for histograms, ``series()`` for the rest."""
        return self.exposed + suffix


def _m(name: str, kind: Kind, help: str, unit: str, labels: tuple[str, ...], component: Component,
       **kw) -> Metric:
    return Metric(PREFIX + name, kind, help, unit, tuple(labels), component, **kw)


E, P, X, H, G = Component.ENGINE, Component.PROCESS, Component.KV_TRANSFER, Component.HOOKS, Component.GUARD
C, Ga, Hi = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
EL = ENGINE_LABELS

# --- per request (one observation per finished request) -------------------------------------
REQUEST_TTFT = _m("request_ttft_seconds", Hi, "Time to first token of finished requests, as seen by this engine.",
                  "s", EL, E, buckets=TTFT_BUCKETS, otel_name="gen_ai.server.time_to_first_token",
                  slo_threshold_env="SLA_GUARD_TTFT_SLO_S")
REQUEST_TPOT = _m("request_tpot_seconds", Hi,
                  "Mean time per output token after the first, per finished request with >1 output token.",
                  "s", EL, E, buckets=TPOT_BUCKETS, otel_name="gen_ai.server.time_per_output_token",
                  slo_threshold_env="SLA_GUARD_TPOT_SLO_S")
REQUEST_E2E = _m("request_e2e_seconds", Hi, "End-to-end latency of finished requests.", "s", EL, E,
                 buckets=LATENCY_BUCKETS, otel_name="gen_ai.server.request.duration")
REQUEST_QUEUE = _m("request_queue_seconds", Hi, "Time finished requests spent waiting in the scheduler queue.",
                   "s", EL, E, buckets=LATENCY_BUCKETS)
REQUEST_PREFILL = _m("request_prefill_seconds", Hi, "Prefill phase time of finished requests.", "s", EL, E,
                     buckets=LATENCY_BUCKETS)
REQUEST_DECODE = _m("request_decode_seconds", Hi, "Decode phase time of finished requests.", "s", EL, E,
                    buckets=LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = _m("inter_token_latency_seconds", Hi, "Latency between consecutive output tokens.",
                         "s", EL, E, buckets=TPOT_BUCKETS)
REQUESTS_FINISHED = _m("requests_finished", C, "Finished requests by finish reason.", "1",
                       (*EL, "reason"), E)
# Per API server, not per engine: vLLM refuses these at the frontend (AsyncLLM.check_admission,
# HTTP 503), before any engine sees them, so they are in no latency histogram. The reasons vLLM
# 0.32 passes (vllm.v1.metrics.loggers.ADMISSION_REASONS); exporters start them at 0, and a reason
# a later vLLM adds is a new series.
ADMISSION_REASONS: Final = ("max_num_queued_reqs", "max_num_queued_tokens")
ADMISSION_REJECTIONS = _m("admission_rejections", C,
                          "Requests refused at the API server by a queue limit (vLLM admission control, HTTP 503), "
                          "by reason=max_num_queued_reqs|max_num_queued_tokens; the guard counts them as TTFT "
                          "attainment misses.", "1", ("model", "pool", "reason"), E)
PROMPT_TOKENS = _m("prompt_tokens", C,
                   "Prompt tokens by source: computed here, local prefix-cache hit, or external KV transfer.",
                   "1", (*EL, "source"), E)
GENERATION_TOKENS = _m("generation_tokens", C, "Generated (output) tokens.", "1", EL, E,
                       otel_name="gen_ai.client.token.usage")

# --- the client scope (one observation per finished client request, at the router) ----------
CL, R = CLIENT_LABELS, Component.ROUTER
CLIENT_TTFT = _m("client_ttft_seconds", Hi,
                 "Time to first token as the client sees it: router arrival to first streamed token.",
                 "s", CL, R, buckets=TTFT_BUCKETS, slo_threshold_env="SLA_GUARD_TTFT_SLO_S")
CLIENT_TPOT = _m("client_tpot_seconds", Hi,
                 "Mean time per output token after the first, per streamed client request with >1 token.",
                 "s", CL, R, buckets=TPOT_BUCKETS, slo_threshold_env="SLA_GUARD_TPOT_SLO_S")
CLIENT_E2E = _m("client_e2e_seconds", Hi, "Client request duration: router arrival to last byte sent.",
                "s", CL, R, buckets=LATENCY_BUCKETS)
CLIENT_REQUESTS = _m("client_requests", C, f"Client requests by outcome={'|'.join(Outcome)}.", "1",
                     (*CL, "outcome"), R)
# Streamed requests that ended in a server error (outcome=error) with no observation of an indicator
# to show for it: before the first token a request is in no TTFT histogram, after it (stream cut,
# stalled, error event) it has a TTFT but no TPOT. The guard and the rules count each as a miss of
# that indicator's attainment, once. Not counted: non-streamed requests (no TTFT observed, ok or
# not: their errors are availability's, below), several choices in one stream (no TPOT observed),
# client_error and aborted.
CLIENT_FAILED_BEFORE_FIRST_TOKEN = _m(
    "client_failed_before_first_token", C,
    "Streamed client requests that ended in a server error before their first token (in no TTFT histogram); "
    "the guard counts them as client TTFT attainment misses.", "1", CL, R)
CLIENT_FAILED_AFTER_FIRST_TOKEN = _m(
    "client_failed_after_first_token", C,
    "Streamed single-choice client requests that ended in a server error after their first token (a TTFT "
    "observed, no TPOT); the guard counts them as client TPOT attainment misses.", "1", CL, R)
# Each latency histogram's misses that it holds no observation of: requests refused or failed
# before the histogram could observe them. Attainment (the guard's and the generated rules') adds
# them to the misses and to the requests, once; means and percentiles are over the requests served.
UNOBSERVED_MISSES: Final[dict[Metric, Metric]] = {
    REQUEST_TTFT: ADMISSION_REJECTIONS,
    CLIENT_TTFT: CLIENT_FAILED_BEFORE_FIRST_TOKEN,
    CLIENT_TPOT: CLIENT_FAILED_AFTER_FIRST_TOKEN,
}
# The availability SLI, an error ratio over CLIENT_REQUESTS: the requests the service failed
# (outcome=error, streamed or not) over those it answered or failed. client_error and aborted are
# the client's doing and count in neither, the rule the streamed-failure counters above follow.
AVAILABILITY_FAILED: Final = Outcome.ERROR
AVAILABILITY_COUNTED: Final = (Outcome.OK, Outcome.ERROR)
CLIENT_IN_FLIGHT = _m("client_requests_in_flight", Ga, "Client requests the router is serving now.", "1", CL, R,
                      multiprocess_mode="livesum")
CLIENT_STAGE = _m("client_ttft_stage_seconds", Hi,
                  "The router-measured parts of a P/D request's TTFT, by stage=proxy|prefill_leg|decode_first_leg.",
                  "s", (*CL, "stage"), R, buckets=TTFT_BUCKETS)
del CL, R

# --- scheduler state -------------------------------------------------------------------------
REQUESTS_RUNNING = _m("requests_running", Ga, "Requests in the running batch.", "1", EL, E)
REQUESTS_WAITING = _m("requests_waiting", Ga, "Requests waiting to be scheduled.", "1", EL, E)
REQUESTS_KV_FETCH = _m("requests_kv_fetch", Ga, "Requests waiting for remote KV, by stage.", "1",
                       (*EL, "stage"), E)
KV_CACHE_USAGE = _m("kv_cache_usage_ratio", Ga, "Fraction of KV-cache blocks in use (0..1).", "1", EL, E)
PREFIX_CACHE_QUERIES = _m("prefix_cache_queries_tokens", C,
                          "Prompt tokens looked up in a prefix cache; cache=local|external (connector).",
                          "1", (*EL, "cache"), E)
PREFIX_CACHE_HITS = _m("prefix_cache_hits_tokens", C,
                       "Prompt tokens found in a prefix cache; cache=local|external (connector).",
                       "1", (*EL, "cache"), E)
PREEMPTIONS = _m("preemptions", C, "Requests preempted (KV cache full).", "1", EL, E)
ENGINE_STEPS = _m("engine_steps", C, "Scheduler steps recorded by the hook.", "1", EL, E)
# Liveness of the hook's recording path (docs/hooks.md, "When the hook stops recording"). vLLM's own
# generated-token counter is on the same /metrics; whenever it rises, vLLM called its loggers' record(),
# so the hook's counters below must rise too. One of them standing still while it rises means the hook
# stopped recording (its logger dropped by an elastic-EP rebuild, or record() failing every step): the
# target's contract data is frozen, not idle, and the guard reads it as unknown (kind "hook_stalled").
# An idle engine leaves both still. Not a contract metric: vLLM exports it, under its own labels.
VLLM_GENERATION_TOKENS: Final = "vllm:generation_tokens_total"
HOOK_RECORDED: Final = (GENERATION_TOKENS, ENGINE_STEPS)
HOOK_LAG_S: Final = 2.0  # the hook's series lag vLLM's by one flush interval (SLA_GUARD_FLUSH_INTERVAL_S, 0.5 s)
# Where Prometheus holds the series (Prometheus mode, the SlaGuardHookStalled rule): vLLM's counter rose,
# at least HOOK_STALL_SETTLE_S ago, after the hook's last moved, and the hook's has stood still for at
# least HOOK_STALL_WINDOW_S + HOOK_STALL_SETTLE_S (the settle time: at least one scrape interval plus
# HOOK_LAG_S after vLLM's rise, so a hook that only lags has flushed by a later scrape). Held until the
# hook's counter moves (or a restart resets it), or for HOOK_STALL_LOOKBACK_S after vLLM's last rise;
# last moves are placed to HOOK_STALL_STEP_S.
HOOK_STALL_WINDOW_S: Final = 300.0
HOOK_STALL_SETTLE_S: Final = 60.0
HOOK_STALL_LOOKBACK_S: Final = 2 * 3600.0  # its subquery's cost grows with it: 0.25 s a 1 h for 500 engines
HOOK_STALL_STEP_S: Final = 60.0

# --- speculative decoding --------------------------------------------------------------------
SPEC_DRAFTS = _m("spec_decode_drafts", C, "Speculative-decoding drafts proposed.", "1", EL, E)
SPEC_DRAFT_TOKENS = _m("spec_decode_draft_tokens", C, "Draft tokens proposed.", "1", EL, E)
SPEC_ACCEPTED_TOKENS = _m("spec_decode_accepted_tokens", C, "Draft tokens accepted.", "1", EL, E)
SPEC_DRAFT_TOKENS_POS = _m("spec_decode_draft_tokens_per_pos", C, "Draft tokens proposed at each position.",
                           "1", (*EL, "position"), E)
SPEC_ACCEPTED_TOKENS_POS = _m("spec_decode_accepted_tokens_per_pos", C,
                              "Draft tokens accepted at each position.", "1", (*EL, "position"), E)

# --- KV transfer (kv_connector_stats, NIXL format) -------------------------------------------
KV_XFER_DURATION = _m("kv_transfer_duration_seconds", Hi, "Duration of one KV transfer (per transfer handle).",
                      "s", EL, X, buckets=KV_XFER_BUCKETS)
KV_XFER_POST_DURATION = _m("kv_transfer_post_duration_seconds", Hi, "Time to post one KV transfer.", "s", EL,
                           X, buckets=KV_XFER_BUCKETS)
KV_XFER_BYTES = _m("kv_transfer_bytes", Hi, "Bytes moved by one KV transfer.", "By", EL, X,
                   buckets=BYTES_BUCKETS)
KV_XFER_DESCRIPTORS = _m("kv_transfer_descriptors", Hi, "Descriptors in one KV transfer.", "1", EL, X,
                         buckets=COUNT_BUCKETS)
KV_XFER_FAILURES = _m("kv_transfer_failures", C, "KV-transfer failures; kind=transfer|notification|handshake.",
                      "1", (*EL, "kind"), X)
KV_XFER_EXPIRED = _m("kv_transfer_expired_requests", C, "Requests whose KV expired before it was fetched.",
                     "1", EL, X)
KV_XFER_LATE_NOTIFICATIONS = _m("kv_transfer_notifications_after_expiry", C,
                                "Transfer notifications that arrived after the request expired.", "1", EL, X)

# --- per process host memory (every vLLM process) --------------------------------------------
PL = PROCESS_LABELS
PROCESS_RSS = _m("process_resident_memory_bytes", Ga, "Resident set size of a vLLM process.", "By", PL, P,
                 multiprocess_mode="mostrecent")
PROCESS_MEMORY = _m("process_memory_bytes", Ga, "RSS split by kind=anon|file|shmem (from /proc status).",
                    "By", (*PL, "kind"), P)
PROCESS_GC_COLLECTIONS = _m("process_gc_collections", C, "Python GC collections by generation.", "1",
                            (*PL, "generation"), P)
PROCESS_GC_FROZEN = _m("process_gc_frozen_objects", Ga, "Objects in the permanent generation (gc.freeze); "
                       "once counting them costs (a walk under the GIL), re-read at most hourly.",
                       "1", PL, P)
PROCESS_THREADS = _m("process_threads", Ga, "OS threads of the process.", "1", PL, P)
PROCESS_OPEN_FDS = _m("process_open_fds", Ga, "Open file descriptors of the process.", "1", PL, P)
# "process_pid", not "pid": prometheus_client's multiprocess collector (vLLM with several API
# servers) strips any label named "pid" from mostrecent gauges.
PROCESS_INFO = _m("process_info", Ga, "Always 1; maps a process label to its PID and start time.", "1",
                  (*PL, "process_pid", "start_time"), P)

# --- object census (engine_hooks/census.py): which Python containers grow inside a process ---
# Only the top growers of each process (SLA_GUARD_CENSUS_TOP, default 5) carry an owner label,
# a readable path from the process's roots (docs/census.md).
PO = (*PL, "owner")
CENSUS_CONTAINER_LENGTH = _m("census_container_length", Ga,
                             "Elements in a steadily growing Python container of the process, by owner path "
                             "(top growers only).", "1", PO, P)
CENSUS_CONTAINER_GROWTH = _m("census_container_growth_elements_per_second", Ga,
                             "Growth of that container in elements per second (least squares over the last "
                             "census walks).", "1/s", PO, P)
CENSUS_CONTAINER_BYTES = _m("census_container_growth_bytes_per_second", Ga,
                            "Estimated memory that container's growth holds, bytes per second (getsizeof of the "
                            "container and of a sample of its newest elements).", "By/s", PO, P)
CENSUS_RSS_EXPLAINED = _m("census_rss_explained_ratio", Ga,
                          "Share of the process's RSS growth over the census walks that the top growers' "
                          "estimated bytes explain; the rest is memory the census cannot see (native).", "1",
                          PL, P)
CENSUS_WALK_SECONDS = _m("census_walk_seconds", Ga, "GIL time the last census walk took (sum of its slices).",
                         "s", PL, P)
CENSUS_WALK_MAX_SLICE = _m("census_walk_max_slice_seconds", Ga,
                           "Longest single GIL slice of the last census walk.", "s", PL, P)
CENSUS_OBJECTS = _m("census_objects_visited", Ga, "Objects the last census walk expanded.", "1", PL, P)
CENSUS_ERRORS = _m("census_errors", C, "Census walks of the process that raised (caught and skipped; the first "
                   "is logged).", "1", PL, P)
del PO

# --- engine identity and hook health ---------------------------------------------------------
ENGINE_INFO = _m("engine_info", Ga, "Always 1; static facts about an engine.", "1",
                 (*EL, "kv_connector", "kv_role", "spec_method", "num_spec_tokens", "vllm_version",
                  "dp_size"), E)
HOOK_ERRORS = _m("hook_errors", C, "Errors caught inside the hooks (never raised into vLLM), by kind.", "1",
                 ("model", "pool", "kind"), H)

# --- the guard service -----------------------------------------------------------------------
GUARD_EVAL_DURATION = _m("guard_evaluation_duration_seconds", Hi, "Time one evaluation tick took.", "s", (), G,
                         buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
GUARD_SCRAPE_ERRORS = _m("guard_scrape_errors", C, "Ingestion errors by kind.", "1", ("target", "kind"), G)
GUARD_TARGET_UP = _m("guard_target_up", Ga, "1 if the last scrape of a target succeeded.", "1",
                     ("target", "model", "pool"), G)
GUARD_SERIES = _m("guard_series", Ga, "Series held in the guard's store.", "1", (), G)
GUARD_EVALUATOR_ERRORS = _m("guard_evaluator_errors", C,
                            "Exceptions that escaped an evaluator (caught and logged; the tick goes on), and "
                            "leak checks of one process that raised (that process unknown, the others judged).",
                            "1", ("evaluator",), G)
GUARD_STORE_BYTES = _m("guard_store_bytes", Ga, "Bytes held by the embedded series store's arrays.", "By", (), G)
GUARD_STATE_SAVE_ERRORS = _m("guard_state_save_errors", C,
                             "State saves that failed (disk full, read-only, locked): what the guard learned since "
                             "its last save is only in memory until a save succeeds.", "1", (), G)
GUARD_SLO_STATUS = _m("guard_slo_status", Ga,
                      "1 for the current status of an SLO (status=ok|at_risk|violated|unknown), else 0.",
                      "1", (*GUARD_SLO_LABELS, "status"), G)
GUARD_SLO_VALUE = _m("guard_slo_value", Ga, "Current value of an SLO's indicator (seconds or ratio).", "1",
                     GUARD_SLO_LABELS, G)
GUARD_BURN_RATE = _m("guard_burn_rate", Ga, "Error-budget burn rate over a window.", "1",
                     (*GUARD_SLO_LABELS, "window"), G)
GUARD_BUDGET_REMAINING = _m("guard_error_budget_remaining_ratio", Ga, "Error budget left (1 = untouched).",
                            "1", GUARD_SLO_LABELS, G)
GUARD_GOODPUT = _m("guard_goodput_ratio", Ga, "Share of requests meeting both TTFT and TPOT thresholds.", "1",
                   ("model", "pool"), G)
GUARD_FINDINGS = _m("guard_findings", Ga, "Open findings by detector and severity.", "1",
                    ("model", "pool", "detector", "severity"), G)
GUARD_FINDINGS_TOTAL = _m("guard_findings_opened", C, "Findings opened since start.", "1",
                          ("model", "pool", "detector"), G)
GUARD_LEAK_SLOPE = _m("guard_leak_slope_bytes_per_second", Ga, "Estimated memory growth of a process series.",
                      "By/s", ("model", "pool", "instance", "process"), G)
GUARD_ALERT_PUSH_ERRORS = _m("guard_alertmanager_push_errors", C, "Failed pushes to Alertmanager.", "1",
                             ("reason",), G)
GUARD_DESIRED_REPLICAS = _m("guard_desired_replicas", Ga, "Replicas the advisor recommends for a pool.", "1",
                            ("model", "pool"), G)
GUARD_CURRENT_REPLICAS = _m("guard_current_replicas", Ga, "Replicas the guard sees serving a pool.", "1",
                            ("model", "pool"), G)
GUARD_SCALING_DECISIONS = _m("guard_scaling_decisions", C, "Advisor decisions by direction and reason.", "1",
                             ("model", "pool", "direction", "reason"), G)
GUARD_ACTUATION_ERRORS = _m("guard_actuation_errors", C, "Scaling actions an actuator failed to apply.", "1",
                            ("model", "pool", "actuator"), G)

del E, P, X, H, G, C, Ga, Hi, EL, PL

ALL: Final[tuple[Metric, ...]] = tuple(v for v in list(globals().values()) if isinstance(v, Metric))
BY_NAME: Final[dict[str, Metric]] = {m.name: m for m in ALL}


def by_component(component: Component) -> tuple[Metric, ...]:
    return tuple(m for m in ALL if m.component is component)


def buckets_with(buckets: tuple[float, ...], *thresholds: float) -> tuple[float, ...]:
    """Buckets with each SLA threshold inserted as a boundary (a latency SLI is counted from
    the bucket whose upper bound equals the threshold)."""
    return tuple(sorted(set(buckets) | {float(t) for t in thresholds if t > 0}))


def bucket_override(metric: Metric, env: dict[str, str] | None = None) -> tuple[float, ...]:
    """Buckets for ``metric`` at engine start: the contract's, plus the SLA threshold given in
    its environment variable (e.g. ``SLA_GUARD_TPOT_SLO_S=0.018``). Bad values are ignored
    with the contract's buckets kept, since a hook must never fail vLLM's start-up."""
    env = os.environ if env is None else env
    if not metric.slo_threshold_env or metric.slo_threshold_env not in env:
        return metric.buckets
    try:
        extra = [float(x) for x in env[metric.slo_threshold_env].split(",") if x.strip()]
    except ValueError:
        # said, not only ignored: the guard would then judge an attainment SLO at a threshold the
        # engines' histograms lack (its config check names the bucket to add)
        logging.getLogger("sla_guard.contract").warning(
            "%s=%r is not a comma-separated list of seconds; %s keeps the contract's buckets",
            metric.slo_threshold_env, env[metric.slo_threshold_env], metric.name)
        return metric.buckets
    return buckets_with(metric.buckets, *extra)


def pool_from_kv_role(kv_role: str | None, env: dict[str, str] | None = None) -> Pool:
    """Pool of an engine: ``SLA_GUARD_POOL`` wins, else producer -> prefill, consumer -> decode,
    both or none -> mixed."""
    env = os.environ if env is None else env
    override = env.get("SLA_GUARD_POOL", "").strip().lower()
    if override in {p.value for p in ENGINE_POOLS}:
        return Pool(override)
    if override:  # a misspelt 'prefil' left the engine in its kv-role pool without a word
        logging.getLogger("sla_guard.contract").warning(
            "SLA_GUARD_POOL=%r is not one of %s; the pool comes from the KV role", env["SLA_GUARD_POOL"],
            ", ".join(p.value for p in ENGINE_POOLS))
    return {"kv_producer": Pool.PREFILL, "kv_consumer": Pool.DECODE}.get(kv_role or "", Pool.MIXED)


_LATENCY_BY_SCOPE: Final = {
    "ttft": (REQUEST_TTFT, CLIENT_TTFT), "tpot": (REQUEST_TPOT, CLIENT_TPOT), "e2e": (REQUEST_E2E, CLIENT_E2E),
}


def latency_metric(indicator: str, pool: str | None) -> Metric:
    """The histogram behind ``indicator`` (ttft | tpot | e2e) for a scope: the client families for
    ``pool == "client"``, the engine families otherwise. The one place that choice is made."""
    engine, client = _LATENCY_BY_SCOPE[indicator]
    return client if pool == Pool.CLIENT else engine
