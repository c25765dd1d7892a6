"""`sla-guard` command line. Each subcommand lives in ``sla_guard/commands/<name>.py`` with
``add_parser(subparsers)`` and ``run(args) -> int``; this module only dispatches."""

from __future__ import annotations

import argparse
import os
import select
import sys
from types import ModuleType

from sla_guard.commands import analyze, check, demo, generate, replay, serve, validate_config

# Order is the order of `sla-guard --help`.
COMMANDS: tuple[ModuleType, ...] = (demo, serve, check, validate_config, replay, analyze, generate)
# What `sla-guard --help` opens with (the module docstring above is for developers)
DESCRIPTION = (
    "Observability and SLA guard for prefill/decode-disaggregated vLLM deployments: per-pool SLOs, "
    "leak and drift detection, P/D replica advice."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sla-guard", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


# the exit status of a process that SIGPIPE ended (128 + 13), what the shell reports for `yes | head -1`
EXIT_BROKEN_PIPE = 141


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it (poll reports an error on a
    write end with no reader); a BrokenPipeError from anything else (a socket) is not hidden."""
    if not hasattr(select, "poll"):
        return True
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from exporters.redact import install_log_redaction

    install_log_redaction(getattr(args, "log_level", None))  # no credentials in any log line
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # here, not at exit: a failed flush at exit is a message and exit status 120
    except BrokenPipeError:
        # the reader went away (`sla-guard check | head -1`): stop quietly, as a SIGPIPE'd tool does,
        # instead of a traceback; Python's recipe: point stdout at devnull so the exit flush is silent
        if not _stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
