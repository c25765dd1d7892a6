#!/usr/bin/env bash
# One-shot, idempotent set-up on a fresh machine.
#   scripts/setup.sh            project venv (.venv) with the guard, exporters, dashboards and test tools
#   scripts/setup.sh --full     also Debian prometheus/alertmanager and the CPU vLLM venv (.venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=${SETUP_LOG:-/tmp/sla-guard-setup.log}
# Run quietly; on failure show the end of the log (pip's "Location ... is ignored" noise stays out of CI output).
quiet() { if ! "$@" >>"$LOG" 2>&1; then grep -v "is ignored" "$LOG" | tail -40 >&2; return 1; fi; }
PY=${PYTHON:-python3}
full=0; [[ "${1:-}" == "--full" ]] && full=1

if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
if [[ ! -f .venv/.installed ]] || [[ pyproject.toml -nt .venv/.installed ]]; then
  quiet .venv/bin/pip install -q --upgrade pip
  quiet .venv/bin/pip install -q -e ".[otel,dashboards,report,kubernetes,dev]"
  .venv/bin/python -c "import sla_guard, exporters, engine_hooks, prometheus_client, fastapi" 
  touch .venv/.installed
fi

if [[ $full == 1 ]]; then
  if ! command -v prometheus >/dev/null || ! command -v prometheus-alertmanager >/dev/null; then
    SUDO=""; [[ $(id -u) != 0 ]] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager >/dev/null
  fi
  scripts/setup_vllm.sh
fi
