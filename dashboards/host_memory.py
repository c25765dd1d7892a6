"""Host memory of every vLLM process: RSS, memory by kind, GC, threads, FDs; leak findings as annotations;
the object census (which Python containers grow, engine_hooks/census.py)."""

from __future__ import annotations

from dashboards.common import GUARD_SEL, RATE, Panels, dashboard, prom_annotation, q, sel
from exporters import contract as c
from exporters import promql as pq
from sla_guard.config import GuardConfig

UID = "sla-guard-host-memory"
PROC = ["instance", "role", "process"]
LEGEND = "{{instance}} {{role}} {{process}}"


def build(config: GuardConfig) -> dict:
    s = sel()
    findings = pq.series(c.GUARD_FINDINGS, matchers=[*GUARD_SEL, 'detector=~".*leak.*"'])
    leak = prom_annotation(
        "Leak findings", f"max by (model, pool, detector, severity) ({findings}) > 0",
        "red", "{{detector}} finding ({{severity}})", "{{model}}/{{pool}}: open {{detector}} finding",
        "detector,severity")

    def panels(p: Panels) -> None:
        p.row("Resident memory")
        p.ts("RSS per process", "Resident set size of every vLLM process (API server, EngineCore, workers).",
             [q(pq.sum_by(PROC, pq.series(c.PROCESS_RSS, matchers=s)), LEGEND)], "bytes", w=12)
        p.ts("Memory by kind", "RSS split into anonymous, file-backed and shared memory.",
             [q(pq.sum_by([*PROC, "kind"], pq.series(c.PROCESS_MEMORY, matchers=s)), LEGEND + " {{kind}}")],
             "bytes", w=12)
        p.ts("Leak slope (guard)", "Memory growth the guard's leak detector estimates per process series.",
             [q(pq.series(c.GUARD_LEAK_SLOPE, matchers=GUARD_SEL), "{{pool}} {{process}}")], "Bps", w=24,
             min0=False)
        p.row("Python runtime")
        p.ts("GC frozen objects", c.PROCESS_GC_FROZEN.help,
             [q(pq.sum_by(PROC, pq.series(c.PROCESS_GC_FROZEN, matchers=s)), LEGEND)], w=8)
        p.ts("GC collections", "Python garbage collections per second by generation.",
             [q(pq.sum_by([*PROC, "generation"], pq.rate(c.PROCESS_GC_COLLECTIONS, RATE, matchers=s)),
                LEGEND + " gen{{generation}}")], "ops", w=8)
        p.ts("Threads and open FDs", "OS threads and open file descriptors per process.",
             [q(pq.sum_by(PROC, pq.series(c.PROCESS_THREADS, matchers=s)), LEGEND + " threads"),
              q(pq.sum_by(PROC, pq.series(c.PROCESS_OPEN_FDS, matchers=s)), LEGEND + " fds")], w=8)
        p.row("Object census: what grows (docs/census.md)")
        owner = LEGEND + " {{owner}}"
        p.ts("Growing containers: estimated memory",
             "Python containers (list, dict, set, deque) that grow steadily across census walks, by owner path "
             "(the top growers of each process), as estimated bytes per hour: getsizeof of the container and a "
             "sample of its newest elements.",
             [q(f"3600 * {pq.series(c.CENSUS_CONTAINER_BYTES, matchers=s)}", owner)], "bytes", w=12)
        p.ts("Growing containers: elements per hour", "Growth rate of the same containers, elements per hour.",
             [q(f"3600 * {pq.series(c.CENSUS_CONTAINER_GROWTH, matchers=s)}", owner)], w=12)
        p.ts("Growing containers: length", "Current length of the same containers.",
             [q(pq.series(c.CENSUS_CONTAINER_LENGTH, matchers=s), owner)], w=6)
        p.ts("RSS growth explained by the census",
             "Share of the process's RSS growth (over the census walks) that the growing containers' estimated "
             "bytes explain. The rest is memory the census cannot see: native allocations, C extensions, torch, "
             "allocator fragmentation.",
             [q(pq.series(c.CENSUS_RSS_EXPLAINED, matchers=s), LEGEND)], "percentunit", w=6, min0=False)
        p.ts("Census cost", "GIL time of the last census walk (the sum of its slices, each <= 5 ms) and its longest "
             "slice.",
             [q(pq.series(c.CENSUS_WALK_SECONDS, matchers=s), LEGEND + " walk"),
              q(pq.series(c.CENSUS_WALK_MAX_SLICE, matchers=s), LEGEND + " max slice")], "s", w=6)
        p.ts("Census objects visited", "Objects the last census walk expanded (frames walks: the engine's "
             "objects; every 6th walk: module globals too), and census walks that failed in the last hour "
             "(caught; the first is logged by the process).",
             [q(pq.series(c.CENSUS_OBJECTS, matchers=s), LEGEND),
              q(pq.increase(c.CENSUS_ERRORS, "1h", matchers=s), LEGEND + " failed walks")], w=6)

    return dashboard(UID, "sla-guard / Host memory", "Host memory of vLLM processes; leak findings annotated.",
                     panels, annotations=[leak])
