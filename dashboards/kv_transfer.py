"""KV transfer (NIXL): latency percentiles, bytes/s, descriptors, failures, requests waiting for KV."""

from __future__ import annotations

from dashboards.common import RATE, Panels, dashboard, q, sel
from dashboards.latency import mean_and_percentiles
from exporters import contract as c
from exporters import promql as pq
from sla_guard.config import GuardConfig

UID = "sla-guard-kv-transfer"


def build(config: GuardConfig) -> dict:
    s = sel()

    def panels(p: Panels) -> None:
        p.row("Latency")
        p.ts("Transfer duration", "Duration of one KV transfer (per handle): mean, p50, p90, p99 per pool.",
             mean_and_percentiles(c.KV_XFER_DURATION, ["pool"], s), "s")
        p.ts("Post duration", "Time to post one KV transfer: p50, p90, p99 per pool.",
             mean_and_percentiles(c.KV_XFER_POST_DURATION, ["pool"], s, mean=False), "s")
        p.row("Volume")
        p.ts("Bytes per second", "KV bytes moved per second by pool and instance.",
             [q(pq.sum_by(["pool", "instance"], pq.rate(c.KV_XFER_BYTES, RATE, "_sum", s)), "{{pool}} {{instance}}")],
             "Bps", w=8)
        p.ts("Transfers per second", "KV transfers completed per second.",
             [q(pq.sum_by(["pool", "instance"], pq.rate(c.KV_XFER_DURATION, RATE, "_count", s)),
                "{{pool}} {{instance}}")], "ops", w=8)
        p.ts("Descriptors per transfer", "Mean descriptors per transfer (fragmentation of the KV layout).",
             [q(pq.mean(c.KV_XFER_DESCRIPTORS, RATE, ["pool"], s), "{{pool}} mean"),
              q(pq.quantile(0.99, c.KV_XFER_DESCRIPTORS, RATE, ["pool"], s), "{{pool}} p99")], w=8)
        p.row("Failures and waiting")
        p.ts("Failures", "KV-transfer failures per second by kind (transfer, notification, handshake).",
             [q(pq.sum_by(["pool", "kind"], pq.rate(c.KV_XFER_FAILURES, RATE, matchers=s)), "{{pool}} {{kind}}")],
             "ops", w=8)
        p.ts("Expired requests", "Requests whose KV expired before it was fetched, and notifications that "
             "arrived after expiry.",
             [q(pq.sum_by(["pool"], pq.rate(c.KV_XFER_EXPIRED, RATE, matchers=s)), "{{pool}} expired"),
              q(pq.sum_by(["pool"], pq.rate(c.KV_XFER_LATE_NOTIFICATIONS, RATE, matchers=s)),
                "{{pool}} late notifications")], "reqps", w=8)
        p.ts("Requests waiting for remote KV", "Requests waiting for remote KV, by stage.",
             [q(pq.sum_by(["pool", "stage"], pq.series(c.REQUESTS_KV_FETCH, matchers=s)), "{{pool}} {{stage}}")],
             w=8, stack=True)

    return dashboard(UID, "sla-guard / KV transfer", "KV-cache transfer between prefill and decode (NIXL).", panels)
