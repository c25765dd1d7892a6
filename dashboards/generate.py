"""Render every dashboard to ``dashboards/json/<uid>.json`` (pure: config -> {file name: JSON text})."""

from __future__ import annotations

import json
from pathlib import Path

from dashboards import decode, guard, host_memory, kv_transfer, pd_overview, prefill
from sla_guard.config import GuardConfig

JSON_DIR = Path(__file__).parent / "json"
BOARDS = (pd_overview, decode, prefill, kv_transfer, host_memory, guard)


def render_dashboards(config: GuardConfig | None = None) -> dict[str, str]:
    config = config or GuardConfig()
    out = {}
    for module in BOARDS:
        board = module.build(config)
        out[f"{board['uid']}.json"] = json.dumps(board, indent=2, sort_keys=True) + "\n"
    return out
