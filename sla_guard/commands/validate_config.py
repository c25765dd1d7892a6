"""`sla-guard validate-config FILE`: exit 0 and a summary if the file is usable, 2 with the
field path, bad value and fix otherwise."""

from __future__ import annotations

import argparse
import sys

from sla_guard.config import ConfigError, load_config


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("validate-config", help="check a configuration file and exit")
    p.add_argument("file")
    return p


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
        r = cfg.retention
        # the value matrix dominates the embedded store: 8 bytes per series per slot
        worst = r.max_series * r.slots * 8 / 2**20
        span = r.slots * cfg.source.interval_s
        print(f"store: up to {r.max_series} series x {r.slots} samples ({span / 3600:g} h at a "
              f"{cfg.source.interval_s:g}s scrape interval) = at most {worst:,.0f} MiB of samples; "
              f"lower retention.max_series or retention.slots to bound it")
    return 0
