"""Recording rules: the contract's client scope from the routers' own series (Prometheus mode).

The guard in Prometheus mode queries contract names. For a deployment whose router is Dynamo's
frontend, llm-d's endpoint picker or the production-stack router, these rules record the client
families from the router's native series, from the same table the scraper uses
(``exporters.routers``): the router's other labels summed away per scrape target (``instance``,
``job`` and any target labels kept, so rate() sees each process's own counter resets), its model
label copied to ``model``, and ``pool="client"``, ``route`` and ``router`` added. Bucket
boundaries stay the router's. Where a router has an old and a new name for one quantity, the
new one wins per (instance, job, model): ``new or on (instance, job, model) old``.
"""

from __future__ import annotations

from exporters import contract as c
from exporters.routers import ADAPTERS, Adapter, Matcher, RouterMapping

KEEP_ON = ("instance", "job", "model")


def _selector(name: str, matchers: tuple[Matcher, ...]) -> str:
    if not matchers:
        return name
    return name + "{" + ",".join(f'{k}{op}"{v}"' for k, op, v in matchers) + "}"


def _native(mp: RouterMapping, suffix: str, matchers: tuple[Matcher, ...] = ()) -> str:
    """``sum without (router labels) (<series>)`` with the model label renamed to ``model``."""
    sel = _selector(mp.native + suffix, (*mp.where, *matchers))
    if mp.model_label != "model":
        sel = f'label_replace({sel}, "model", "$1", "{mp.model_label}", "(.*)")'
    drop = sorted((set(mp.labels) | {mp.model_label}) - {"model"})
    return f"sum without ({', '.join(drop)}) ({sel})" if drop else f"sum without () ({sel})"


def _first_of(parts: list[str]) -> str:
    if len(parts) == 1:
        return parts[0]
    return f"\nor on ({', '.join(KEEP_ON)}) ".join(parts)


def adapter_rules(ad: Adapter) -> list[dict]:
    static = {"pool": c.Pool.CLIENT.value, "route": ad.route.value, "router": ad.name}
    rules: list[dict] = []
    for metric in ad.metrics:
        mps = ad.for_metric(metric)
        if metric.kind is c.Kind.HISTOGRAM:
            for suffix in ("_bucket", "_sum", "_count"):
                rules.append({"record": metric.series(suffix),
                              "expr": _first_of([_native(mp, suffix) for mp in mps]), "labels": dict(static)})
        elif metric is c.CLIENT_REQUESTS:
            outcomes = dict.fromkeys(o for mp in mps for _, o in mp.outcomes)
            for outcome in outcomes:
                parts = [_native(mp, "", ms) for mp in mps for ms, o in mp.outcomes if o is outcome]
                rules.append({"record": metric.series(), "expr": _first_of(parts),
                              "labels": {**static, "outcome": outcome.value}})
        else:
            rules.append({"record": metric.series(), "expr": _first_of([_native(mp, "") for mp in mps]),
                          "labels": dict(static)})
    return [{"name": f"sla-guard-router-{ad.name}", "rules": rules}]


def router_groups() -> list[dict]:
    return [g for ad in ADAPTERS.values() for g in adapter_rules(ad)]
