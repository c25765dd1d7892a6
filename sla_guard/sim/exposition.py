"""Contract exposition of simulated engines, through the project's exporters.

Each simulated replica gets its own ``CollectorRegistry`` with ``ContractMetrics`` for the ENGINE,
KV_TRANSFER and PROCESS components and an ``EngineRecorder`` bound to (model, pool, engine): the
very code path the vLLM hooks use. A restart builds a fresh registry, so counters reset as they
do when a real engine restarts. :class:`MetricsServer` serves one replica's current registry on a
loopback port (503 while the replica is down).

The simulated P/D proxy gets one more registry, :class:`ClientMetrics`: the ROUTER component
(the client scope, ``pool="client"``, ``route="pd"``, ``router=<proxy name>``) recorded per
finished request exactly as sla-guard-proxy measures it, and served and scraped like an engine.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST, ThreadingWSGIServer

from exporters import contract as c
from exporters.contract import Component
from exporters.prometheus import ContractMetrics, EngineRecorder, FastHistogram, fast_inc

COMPONENTS = (Component.ENGINE, Component.KV_TRANSFER, Component.PROCESS)


class _Exposed:
    """A registry served at /metrics (text) or read in-process (samples)."""

    registry: CollectorRegistry

    def _sync(self) -> None:
        """Bring lazily kept values into the registry before it is read."""

    def exposition(self) -> bytes:
        self._sync()
        return generate_latest(self.registry)

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """The samples a scrape of the exposition would yield (minus ``_created``), without
        rendering and parsing text: the offline replay's in-process scrape."""
        self._sync()
        out = []
        for fam in self.registry.collect():
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    out.append((s.name, s.labels, s.value))
        return out


class EngineMetrics(_Exposed):
    """One simulated engine's registry, recorder and the non-recorder families, children bound once."""

    def __init__(self, model: str, pool: str, engine: str, *, spec_method: str = "", num_spec: int = 0,
                 kv_role: str = "", env: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.metrics = ContractMetrics(self.registry, COMPONENTS, env=env or {})
        self.rec = EngineRecorder(self.metrics, model, pool, engine)
        labels = (model, pool, engine)
        self.labels = labels
        m = self.metrics
        m[c.ENGINE_INFO].labels(*labels, "NixlConnector", kv_role, spec_method, str(num_spec), "sim", "1").set(1)
        self.xfer_duration = m[c.KV_XFER_DURATION].labels(*labels)
        self.xfer_post = m[c.KV_XFER_POST_DURATION].labels(*labels)
        self.xfer_bytes = m[c.KV_XFER_BYTES].labels(*labels)
        self.xfer_desc = m[c.KV_XFER_DESCRIPTORS].labels(*labels)
        self.xfer_fail = {k: m[c.KV_XFER_FAILURES].labels(*labels, k) for k in ("transfer", "notification",
                                                                                "handshake")}
        self.xfer_expired = m[c.KV_XFER_EXPIRED].labels(*labels)
        self.xfer_late = m[c.KV_XFER_LATE_NOTIFICATIONS].labels(*labels)
        # Touch so every family has a sample from the start (as the hooks do on first record()).
        self.xfer_expired.inc(0)
        self.xfer_late.inc(0)
        for reason in c.ADMISSION_REASONS:  # no queue limit is simulated: refusals stay 0, as the hook starts them
            m[c.ADMISSION_REJECTIONS].labels(model, pool, reason)
        self.rec.kv_fetch_by_stage({"waiting_to_start": 0, "in_progress": 0, "completed_waiting": 0})
        self.rec.preempted(0)
        self.rec.spec_decode(0, 0, 0, [0] * num_spec, [0] * num_spec)
        self._proc: dict[str, dict] = {}

    def kv_transfer(self, duration_s: float, post_s: float, nbytes: float, descriptors: int) -> None:
        self.xfer_duration.observe(duration_s)
        self.xfer_post.observe(post_s)
        self.xfer_bytes.observe(nbytes)
        self.xfer_desc.observe(descriptors)

    def kv_failure(self, kind: str = "transfer") -> None:
        self.xfer_fail[kind].inc()

    def process(self, role: str, name: str, pid: int, start_time: float, rss: float, anon: float, file: float,
                shmem: float, gc_counts: tuple[int, int, int], frozen: int, threads: int, fds: int) -> None:
        """One sample of a process, as the hooks' per-process sampler would set it."""
        ch = self._proc.get(name)
        if ch is None:
            m, lab = self.metrics, (*self.labels, role, name)
            ch = self._proc[name] = {
                "rss": m[c.PROCESS_RSS].labels(*lab),
                "kind": {k: m[c.PROCESS_MEMORY].labels(*lab, k) for k in ("anon", "file", "shmem")},
                "gc": [m[c.PROCESS_GC_COLLECTIONS].labels(*lab, str(g)) for g in range(3)],
                "gc_seen": [0, 0, 0],
                "frozen": m[c.PROCESS_GC_FROZEN].labels(*lab),
                "threads": m[c.PROCESS_THREADS].labels(*lab),
                "fds": m[c.PROCESS_OPEN_FDS].labels(*lab),
            }
            m[c.PROCESS_INFO].labels(*lab, str(pid), f"{start_time:.3f}").set(1)
        ch["rss"].set(rss)
        ch["kind"]["anon"].set(anon)
        ch["kind"]["file"].set(file)
        ch["kind"]["shmem"].set(shmem)
        for g in range(3):
            d = gc_counts[g] - ch["gc_seen"][g]
            if d > 0:
                ch["gc"][g].inc(d)
                ch["gc_seen"][g] = gc_counts[g]
        ch["frozen"].set(frozen)
        ch["threads"].set(threads)
        ch["fds"].set(fds)

    # what one census walk of an EngineCore costs on real CPU vLLM (docs/census.md): ~1,000 objects,
    # ~10 ms of GIL time in slices of at most 2.5 ms
    WALK = (0.010, 0.0025, 1000.0)

    def census(self, role: str, name: str, growers: list[tuple[str, float, float, float]]) -> None:
        """The object census of a process (engine_hooks/census.py): the last walk's cost, always,
        and its growing containers, when some grow (a leak fault that names its owner). The
        simulated leak is all in that container, so the census explains all of the RSS slope."""
        lab = (*self.labels, role, name)
        walk_s, max_slice_s, objects = self.WALK
        self.metrics[c.CENSUS_WALK_SECONDS].labels(*lab).set(walk_s)
        self.metrics[c.CENSUS_WALK_MAX_SLICE].labels(*lab).set(max_slice_s)
        self.metrics[c.CENSUS_OBJECTS].labels(*lab).set(objects)
        self.metrics[c.CENSUS_ERRORS].labels(*lab)  # no walk fails here: the counter is exposed at 0, as the hooks do
        for owner, length, growth, bps in growers:
            self.metrics[c.CENSUS_CONTAINER_LENGTH].labels(*lab, owner).set(length)
            self.metrics[c.CENSUS_CONTAINER_GROWTH].labels(*lab, owner).set(growth)
            self.metrics[c.CENSUS_CONTAINER_BYTES].labels(*lab, owner).set(bps)
        if growers:
            self.metrics[c.CENSUS_RSS_EXPLAINED].labels(*lab).set(1.0)


class ClientMetrics(_Exposed):
    """The simulated P/D proxy's client scope (``CLIENT_LABELS`` = model, pool="client", route="pd",
    router), children bound once, recorded when pd_proxy records it: TTFT and the three TTFT
    stages when the first token is forwarded; TPOT (more than one token), e2e and ``outcome="ok"``
    after the last one; a failed request's outcome and e2e. The in-flight gauge is read from
    ``in_flight`` (a callable) when the registry is read, so the simulation's hot path only keeps
    an integer."""

    def __init__(self, model: str, router: str, *, in_flight=None, env: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.metrics = m = ContractMetrics(self.registry, (Component.ROUTER,), env=env or {})
        self.labels = labels = (model, c.Pool.CLIENT.value, c.Route.PD.value, router)
        self.ttft = FastHistogram(m[c.CLIENT_TTFT].labels(*labels))
        self.tpot = FastHistogram(m[c.CLIENT_TPOT].labels(*labels))
        self.e2e = FastHistogram(m[c.CLIENT_E2E].labels(*labels))
        self.stage = {st: FastHistogram(m[c.CLIENT_STAGE].labels(*labels, st.value)) for st in c.Stage}
        self._outcome = {}
        for o in c.Outcome:  # every outcome exposed from the start (0), as a proxy does
            child = m[c.CLIENT_REQUESTS].labels(*labels, o.value)
            child.inc(0)
            self._outcome[o] = fast_inc(child)
        self._failed = {before: fast_inc(m[fam].labels(*labels)) for before, fam in (
            (True, c.CLIENT_FAILED_BEFORE_FIRST_TOKEN), (False, c.CLIENT_FAILED_AFTER_FIRST_TOKEN))}
        self._in_flight_gauge = m[c.CLIENT_IN_FLIGHT].labels(*labels)
        self._in_flight_gauge.set(0)
        self._in_flight = in_flight

    def first_tokens(self, ttft: list[float], prefill_leg: list[float], decode_first_leg: list[float],
                     proxy: list[float]) -> None:
        """A batch of requests whose first token was forwarded: TTFT and its stages."""
        self.ttft.observe_many(ttft)
        st = self.stage
        st[c.Stage.PREFILL_LEG].observe_many(prefill_leg)
        st[c.Stage.DECODE_FIRST_LEG].observe_many(decode_first_leg)
        st[c.Stage.PROXY].observe_many(proxy)

    def finished(self, tpot: list[float], e2e: list[float]) -> None:
        """A batch of requests that ended ``ok`` (``tpot``: only those with more than one token)."""
        self.tpot.observe_many(tpot)
        self.e2e.observe_many(e2e)
        self._outcome[c.Outcome.OK](len(e2e))

    def failed(self, outcome: c.Outcome, e2e_s: float | None = None, first_token: bool = False) -> None:
        """One request that did not end ``ok``; ``e2e_s`` when the client got an answer (an
        error status), none when it went away (``aborted``). An ``error`` counts, as the proxy
        counts it, as failed before or after its first token (``first_token``): every simulated
        request streams."""
        self._outcome[outcome](1)
        if outcome is c.Outcome.ERROR:
            self._failed[not first_token](1)
        if e2e_s is not None and outcome is not c.Outcome.ABORTED:
            self.e2e.observe(e2e_s)

    def _sync(self) -> None:
        if self._in_flight is not None:
            self._in_flight_gauge.set(self._in_flight())


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class MetricsServer:
    """Serves ``holder()``'s current EngineMetrics at /metrics on 127.0.0.1 (port 0 = free port).
    ``holder`` returns None while the engine is down: the scrape then gets 503, like a dead target."""

    def __init__(self, holder, host: str = "127.0.0.1", port: int = 0) -> None:
        self._holder = holder

        def app(environ, start_response):
            if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found\n"]
            em = self._holder()
            if em is None:
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"engine down\n"]
            body = em.exposition()
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
            return [body]

        self._httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
        self.port = self._httpd.server_port
        self.url = f"http://{host}:{self.port}/metrics"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name=f"sim-metrics-{port}")
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
