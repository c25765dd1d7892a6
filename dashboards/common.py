"""Shared pieces of every sla-guard dashboard: variables, selectors, panel and query helpers.

Built on grafana-foundation-sdk (Grafana 11.6 flavour, schemaVersion 41). Panels take PromQL
made by ``exporters.promql`` from contract metrics, so no dashboard spells a metric name.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.builders import stat as sb
from grafana_foundation_sdk.builders import timeseries as tb
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from exporters import contract as c
from exporters import promql as pq
from sla_guard.config import SLO, GuardConfig, Indicator, Objective

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
TAGS = ["sla-guard", "vllm", "p-d"]

# Matchers engine-side series carry (Prometheus adds ``instance``); guard series have no engine instance.
ENGINE_SEL = ('model=~"$model"', 'pool=~"$pool"', 'instance=~"$instance"')
GUARD_SEL = ('model=~"$model"', 'pool=~"$pool"')
# Metric from outside the contract, shown only when present (NVIDIA DCGM exporter).
DCGM_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
OPTIONAL_METRICS = (DCGM_GPU_UTIL,)


def sel(*extra: str, base: Sequence[str] = ENGINE_SEL) -> list[str]:
    return [*base, *extra]


def variables(pools: str = ".*") -> list:
    """datasource, model, pool (restricted to ``pools``), instance; each chained to the previous."""
    anchor = c.REQUESTS_RUNNING.name  # a gauge every engine exposes from its first step

    def query_var(name: str, label: str, matchers: str) -> db.QueryVariable:
        return (db.QueryVariable(name).label(label).datasource(DATASOURCE)
                .query({"query": f"label_values({anchor}{{{matchers}}}, {name})" if matchers
                        else f"label_values({anchor}, {name})",
                        "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1})
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".*")
                .current(dm.VariableOption(selected=True, text="All", value="$__all")))

    return [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        query_var("model", "Model", ""),
        query_var("pool", "Pool", f'model=~"$model", pool=~"{pools}"'),
        query_var("instance", "Instance", 'model=~"$model", pool=~"$pool"'),
    ]


class Ids:
    """Panel ids, unique per dashboard."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def q(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> pb.Dataquery:
    t = pb.Dataquery().expr(expr).ref_id(ref).legend_format(legend or "__auto").datasource(DATASOURCE)
    return t.instant() if instant else t.range()


def _targets(panel, queries: Sequence[pb.Dataquery]):
    for i, t in enumerate(queries):
        panel = panel.with_target(t.ref_id(chr(ord("A") + i)))
    return panel


def special_map(match: dm.SpecialValueMatch, text: str, color: str) -> dm.SpecialValueMap:
    """Grafana shows NaN and null as "NaN" / an empty tile in the base threshold colour (green):
    map them to words and a colour of their own."""
    return dm.SpecialValueMap(options=dm.DashboardSpecialValueMapOptions(
        match=match, result=dm.ValueMappingResult(text=text, color=color)))


def value_map(value: str, text: str, color: str) -> dm.ValueMap:
    return dm.ValueMap(options={value: dm.ValueMappingResult(text=text, color=color)})


def up_thresholds() -> db.ThresholdsConfig:
    """Red below 1 (nothing reporting), green from 1."""
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=None, color="red"), dm.Threshold(value=1, color="green")])


def engines_reporting(matchers: Sequence[str]) -> str:
    """Engines with a current sample per pool, and 0 for a pool seen in the dashboard's range
    whose engines all went silent: a silent pool drops out of every other panel (its series are
    stale), so without this it just vanished, no different from a pool never deployed."""
    anchor = pq.series(c.REQUESTS_RUNNING, matchers=matchers)
    return f"count by (pool) ({anchor}) or (0 * count by (pool) (last_over_time({anchor}[$__range])))"


def guards() -> str:
    """Guards Prometheus has a current sample from (``guard_series``, exported from start); empty when none."""
    return f"count({pq.series(c.GUARD_SERIES)})"


def guard_reporting() -> str:
    """``guards()``, 0 when none: the verdicts and findings panels are empty both when the guard is
    down and when it has nothing to say; this says which."""
    return f"{guards()} or vector(0)"


def sla_thresholds(*values: float) -> cb.ThresholdsConfigBuilder | db.ThresholdsConfig:
    steps = [dm.Threshold(value=None, color="green")]
    steps += [dm.Threshold(value=v, color="red") for v in sorted(set(values))]
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)


@dataclass
class Panels:
    """Collects panels in order, assigning ids; ``row`` starts a titled row."""

    ids: Ids
    items: list

    def row(self, title: str) -> None:
        self.items.append(("row", db.Row(title).id(self.ids())))

    def ts(self, title: str, description: str, queries: Sequence[pb.Dataquery], unit: str = "short", *,
           w: int = 12, h: int = 8, sla: Sequence[float] = (), min0: bool = True, stack: bool = False) -> None:
        p = (tb.Panel().id(self.ids()).title(title).description(description).datasource(DATASOURCE)
             .unit(unit).span(w).height(h).line_width(1).fill_opacity(10)
             .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.BOTTOM)
                     .show_legend(True).calcs(["mean", "max", "lastNotNull"]))
             .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)))
        if min0:
            p = p.min(0)
        if stack:
            p = p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
        if sla:
            p = p.thresholds(sla_thresholds(*sla)).thresholds_style(
                cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED))
        self.items.append(("panel", _targets(p, queries)))

    def stat(self, title: str, description: str, queries: Sequence[pb.Dataquery], unit: str = "short", *,
             w: int = 6, h: int = 5, thresholds: Sequence[float] = (), text_name: bool = False,
             colors: Sequence[tuple[str, str]] = (), up: bool = False, no_value: str = "",
             mappings: Sequence[dm.ValueMapping] = ()) -> None:
        """``up``: red below 1, green from 1 (a count of things reporting); ``no_value``: the text
        when the query returns nothing (Grafana's default "No data" says not why)."""
        p = (sb.Panel().id(self.ids()).title(title).description(description).datasource(DATASOURCE)
             .unit(unit).span(w).height(h).graph_mode(cm.BigValueGraphMode.AREA)
             .color_mode(cm.BigValueColorMode.BACKGROUND if (thresholds or colors or up)
                         else cm.BigValueColorMode.VALUE)
             .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
        if thresholds:
            p = p.thresholds(sla_thresholds(*thresholds))
        if up:
            p = p.thresholds(up_thresholds())
        if no_value:
            p = p.no_value(no_value)
        if mappings:
            p = p.mappings(list(mappings))
        if text_name:
            p = p.text_mode(cm.BigValueTextMode.NAME).graph_mode(cm.BigValueGraphMode.NONE)
        for regex, color in colors:
            p = p.override_by_regexp(regex, [dm.DynamicConfigValue(id_val="color", value={"mode": "fixed",
                                                                                             "fixedColor": color})])
        self.items.append(("panel", _targets(p, queries)))


def dashboard(uid: str, title: str, description: str, build_panels, *, pools: str = ".*",
              annotations: Sequence[tuple[db.AnnotationQuery, dict]] = ()) -> dict:
    """The dashboard as a JSON-ready dict (what Grafana provisioning reads)."""
    panels = Panels(Ids(), [])
    build_panels(panels)
    d = (db.Dashboard(title).uid(uid).description(description).tags(TAGS).editable()
         .tooltip(dm.DashboardCursorSync.CROSSHAIR).time("now-1h", "now").refresh("30s").timezone("browser")
         .variables(variables(pools))
         .link(db.DashboardLink("sla-guard").type(dm.DashboardLinkType.DASHBOARDS).tags(["sla-guard"])
               .as_dropdown(True).include_vars(True).keep_time(True)))
    d = d.annotation(db.AnnotationQuery().name("Annotations & Alerts").built_in(1).enable(True).hide(True)
                     .icon_color("rgba(0, 211, 255, 1)").type("dashboard")
                     .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --")))
    for a, _ in annotations:
        d = d.annotation(a)
    for kind, item in panels.items:
        d = d.with_row(item) if kind == "row" else d.with_panel(item)
    out = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    extras = {a.build().name: extra for a, extra in annotations}
    for a in out.get("annotations", {}).get("list", []):
        a.update(extras.get(a.get("name"), {}))
    return out


def prom_annotation(name: str, expr: str, color: str, title: str, text: str, tags: str
                    ) -> tuple[db.AnnotationQuery, dict]:
    """A Prometheus annotation; the options Grafana reads next to ``expr`` have no SDK fields, so
    they travel as extras merged into the JSON."""
    a = db.AnnotationQuery().name(name).datasource(DATASOURCE).enable(True).icon_color(color).expr(expr)
    return a, {"step": "60s", "titleFormat": title, "textFormat": text, "tagKeys": tags, "useValueForTime": False}


def slo_thresholds(config: GuardConfig, indicator: Indicator) -> list[float]:
    """SLA lines for an indicator: thresholds of its mean and percentile objectives (any SLO set)."""
    out: set[float] = set()
    for s in config.slos:
        for o in s.objectives:
            if o.indicator is indicator and o.objective in (Objective.MEAN, Objective.PERCENTILE):
                out.add(o.threshold_s)
    return sorted(out)


def error_ratio_thresholds(config: GuardConfig) -> list[float]:
    """Error-ratio lines of the availability objectives (any SLO set; client sets only): 1 - target,
    the share of failed requests the objective allows, as the burn-rate rules count its budget."""
    return sorted({round(1 - (o.target or 0), 10) for s in config.slos for o in s.objectives
                   if o.indicator is Indicator.AVAILABILITY})


def mean_slo(config: GuardConfig, indicator: Indicator) -> SLO | None:
    for s in config.slos:
        for o in s.objectives:
            if o.indicator is indicator and o.objective is Objective.MEAN:
                return o
    return None
