"""Host memory of every vLLM process: RSS, memory by kind, GC, threads, FDs; leak findings as annotations."""

from __future__ import annotations

from alerts import promql as pq
from dashboards.common import GUARD_SEL, RATE, Panels, dashboard, prom_annotation, q, sel
from exporters import contract as c
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
        p.ts("GC frozen objects", "Objects in the permanent generation (gc.freeze).",
             [q(pq.sum_by(PROC, pq.series(c.PROCESS_GC_FROZEN, matchers=s)), LEGEND)], w=8)
        p.ts("GC collections", "Python garbage collections per second by generation.",
             [q(pq.sum_by([*PROC, "generation"], pq.rate(c.PROCESS_GC_COLLECTIONS, RATE, matchers=s)),
                LEGEND + " gen{{generation}}")], "ops", w=8)
        p.ts("Threads and open FDs", "OS threads and open file descriptors per process.",
             [q(pq.sum_by(PROC, pq.series(c.PROCESS_THREADS, matchers=s)), LEGEND + " threads"),
              q(pq.sum_by(PROC, pq.series(c.PROCESS_OPEN_FDS, matchers=s)), LEGEND + " fds")], w=8)

    return dashboard(UID, "sla-guard / Host memory", "Host memory of vLLM processes; leak findings annotated.",
                     panels, annotations=[leak])
