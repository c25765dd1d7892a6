"""`sla-guard` command line. Each subcommand lives in ``sla_guard/commands/<name>.py`` with
``add_parser(subparsers)`` and ``run(args) -> int``; this module only dispatches."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from sla_guard.commands import analyze, check, demo, generate, replay, serve, validate_config

# Order is the order of `sla-guard --help`.
COMMANDS: tuple[ModuleType, ...] = (demo, serve, check, validate_config, replay, analyze, generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sla-guard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from sla_guard.redact import install_log_redaction

    install_log_redaction(getattr(args, "log_level", None))  # no credentials in any log line
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
