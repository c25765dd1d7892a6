"""Generate docs/metrics.md from the contract (`python -m exporters.docs [--check]`)."""

from __future__ import annotations

import sys
from pathlib import Path

from exporters import contract as c

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"

_TITLES = {
    c.Component.ENGINE: "Engine (stat-logger hook, sidecar, simulator)",
    c.Component.KV_TRANSFER: "KV transfer (kv_connector_stats, NIXL format)",
    c.Component.PROCESS: "Host memory and runtime of every vLLM process",
    c.Component.HOOKS: "Hook health",
    c.Component.ROUTER: "Client scope (sla-guard-proxy or a router adapter)",
    c.Component.GUARD: "The guard service",
}


def render() -> str:
    out = [
        "# Metric contract",
        "",
        "Generated from `exporters/contract.py` by `python -m exporters.docs`; do not edit by hand.",
        "",
        f"Prefix `{c.PREFIX}`. Engine labels: `{', '.join(c.ENGINE_LABELS)}`; `pool` is one of "
        f"{', '.join(p.value for p in c.ENGINE_POOLS)} (from `kv_transfer_config.kv_role`, or `SLA_GUARD_POOL`).",
        f"Client-scope labels: `{', '.join(c.CLIENT_LABELS)}`; `pool` is always `{c.Pool.CLIENT.value}`, "
        f"`route` is {' or '.join(r.value for r in c.Route)}, and `stage` of `{c.CLIENT_STAGE.name}` is "
        f"{', '.join(s.value for s in c.Stage)}.",
        "Histogram buckets contain the SLA thresholds; add more at engine start with "
        "`SLA_GUARD_TTFT_SLO_S` / `SLA_GUARD_TPOT_SLO_S` (comma-separated seconds).",
        "",
    ]
    for comp in c.Component:
        out += [f"## {_TITLES[comp]}", "", "| name | type | unit | labels | help |", "|---|---|---|---|---|"]
        for m in c.by_component(comp):
            extra = f" OTel: `{m.otel_name}`." if m.otel_name else ""
            if m.buckets:
                extra += " Buckets: " + ", ".join(f"{b:g}" for b in m.buckets) + "."
            out.append(f"| `{m.exposed}` | {m.kind} | {m.unit} | {', '.join(m.labels) or '-'} | "
                       f"{m.help}{extra} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python -m exporters.docs", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
