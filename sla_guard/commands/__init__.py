"""Subcommands of `sla-guard`, one module each."""
