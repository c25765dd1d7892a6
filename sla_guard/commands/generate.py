"""`sla-guard generate [--check]`: regenerate the Grafana dashboards and Prometheus rules from the
metric contract and the SLO spec (the defaults, or ``--config``). ``--check`` writes nothing and
exits 1 if a committed file differs, so CI catches a contract or SLO change without regeneration."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sla_guard.config import ConfigError, GuardConfig, load_config

RULES_DIR, JSON_DIR, DOC_PATH = Path("alerts/rules"), Path("dashboards/json"), Path("docs/dashboards.md")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="regenerate dashboards/json and alerts/rules from the contract and SLOs")
    p.add_argument("--config", help="guard configuration whose SLO spec to use (default: built-in SLOs)")
    p.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    p.add_argument("--rules-dir", type=Path, help="where rule files go (default: ./alerts/rules)")
    p.add_argument("--dashboards-dir", type=Path, help="where dashboard JSON goes (default: ./dashboards/json)")
    return p


def run(args: argparse.Namespace) -> int:
    from alerts.generate import diff, render_rules, write
    from alerts.slo_rules import GenerationError

    try:
        from dashboards.docs import render_doc
        from dashboards.generate import render_dashboards
    except ImportError as err:  # the Grafana SDK is an extra: a pip install without it got a traceback
        print(f"sla-guard generate: the dashboards need the Grafana Foundation SDK ({err}); "
              f"pip install 'sla-guard[dashboards]'", file=sys.stderr)
        return 2

    # relative to the working directory, as the README reads: from a checkout's root these are the
    # committed files; from a pip install they were the package's own folders in site-packages
    rules_dir, boards_dir, doc = args.rules_dir or RULES_DIR, args.dashboards_dir or JSON_DIR, DOC_PATH

    try:
        config = load_config(args.config) if args.config else GuardConfig()
        boards = render_dashboards(config)
        outputs = [(render_rules(config), rules_dir, "*.yaml"), (boards, boards_dir, "*.json")]
        if args.dashboards_dir is None and args.config is None and doc.exists():
            # a checkout's committed doc describes the default dashboards
            outputs.append(({doc.name: render_doc(boards)}, doc.parent, doc.name))
    except (ConfigError, GenerationError) as err:
        print(err, file=sys.stderr)
        return 2
    if args.check:
        problems = [p for files, out, pattern in outputs for p in diff(files, out, pattern)]
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run `sla-guard generate` (or `make generate`) and commit the result", file=sys.stderr)
            return 1
        print(f"ok: {sum(len(f) for f, _, _ in outputs)} generated files up to date")
        return 0
    for files, out, _ in outputs:
        try:  # an output directory that is a file, or read-only, was a traceback
            written = write(files, out)
        except OSError as err:
            flag = {rules_dir: "--rules-dir ", boards_dir: "--dashboards-dir "}
            print(f"{flag.get(out, '')}{out}: cannot write there: {err.strerror or err} "
                  f"({getattr(err, 'filename', None) or out}); name a writable directory", file=sys.stderr)
            return 2
        for path in written:
            print(f"wrote {path}")
    return 0
