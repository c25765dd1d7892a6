"""`sla-guard validate-config FILE`: exit 0 and a summary if the file is usable, 2 with the
field path, bad value and fix otherwise."""

from __future__ import annotations

import argparse
import sys

from sla_guard.config import ConfigError, GuardConfig, ScrapeSource, load_config


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("validate-config", help="check a configuration file and exit")
    p.add_argument("file")
    return p


def unserved_pools(cfg: GuardConfig) -> list[str]:
    """Notes for SLO sets whose pool no listed scrape target serves: their objectives would wait
    for data for ever (e.g. an availability set on ``pool: client`` with no proxy or router among
    the targets). Not judged with a ``targets_file`` (read at run time) or a target whose page
    names its own pools (``honor_labels``)."""
    src = cfg.source
    if not isinstance(src, ScrapeSource) or src.targets_file is not None \
            or any(t.honor_labels for t in src.targets):
        return []
    served = {t.pool for t in src.targets}
    return [f"note: slos[{i}] is for pool {s.pool!r} but no target has pool: {s.pool}; its objectives stay "
            f"unknown until one does (add its /metrics under source.targets"
            f"{', e.g. the sla-guard-proxy or a router with adapter:' if s.pool == 'client' else ''})"
            for i, s in enumerate(cfg.slos) if s.pool != "*" and s.pool not in served]


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    n_slo = sum(len(s.objectives) for s in cfg.slos)
    print(f"ok: source={cfg.source.mode}, {n_slo} objectives in {len(cfg.slos)} SLO sets, "
          f"evaluation every {cfg.evaluation_interval_s:g}s")
    # declared extra buckets only help if the engines really were started with them
    for ind, env in (("ttft", "SLA_GUARD_TTFT_SLO_S"), ("tpot", "SLA_GUARD_TPOT_SLO_S")):
        extra = getattr(cfg.engine_buckets, ind)
        if extra:
            print(f"engine_buckets.{ind}: start every engine with {env}={','.join(f'{b:g}' for b in extra)}")
    if cfg.source.mode == "scrape":
        for note in unserved_pools(cfg):
            print(note)
        r = cfg.retention
        # the value matrix dominates the embedded store: 8 bytes per series per slot
        worst = r.max_series * r.slots * 8 / 2**20
        span = r.slots * cfg.source.interval_s
        print(f"store: up to {r.max_series} series x {r.slots} samples ({span / 3600:g} h at a "
              f"{cfg.source.interval_s:g}s scrape interval) = at most {worst:,.0f} MiB of samples; "
              f"lower retention.max_series or retention.slots to bound it")
    return 0
