"""Subcommands of `sla-guard`, one module each."""

from __future__ import annotations

import argparse
import math

COUNT = {"above": False, "integer": True}  # a count of replicas: an integer >= the bound


def number(low: float, *, above: bool = True, integer: bool = False):
    """An argparse type: a finite number over ``low`` (at least ``low`` with ``above=False``).
    (replay's --speed inf, --scrape-interval 0 or -1 and --drain-s -1000 used to crash, hang or print
    an empty result with exit 0.)"""
    def parse(text: str):
        try:
            v = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if integer else 'a number'}") from None
        if not math.isfinite(v) or (v <= low if above else v < low):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number {'>' if above else '>='} {low:g}")
        return v
    return parse
