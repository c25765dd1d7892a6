# Everything a fresh clone needs; each target sets up what it uses (idempotent).
.PHONY: setup setup-full demo test test-fast lint generate bench

setup:
	scripts/setup.sh

setup-full:
	scripts/setup.sh --full

demo: setup
	.venv/bin/sla-guard demo

# Full suite: real vLLM (CPU), real Prometheus/Alertmanager, promtool.
test: setup-full
	.venv/bin/ruff check .
	.venv/bin/pytest -q -ra

# Without the real-vLLM tests (they are skipped with the reason printed).
test-fast: setup
	SLA_GUARD_SKIP_VLLM=1 .venv/bin/pytest -q -ra

lint: setup
	.venv/bin/ruff check .

# Regenerate committed artefacts from the contract and the SLO spec.
generate: setup
	.venv/bin/python -m exporters.docs
	.venv/bin/sla-guard generate

bench: setup-full
	for b in bench/bench_*.py; do .venv/bin/python $$b || exit 1; done
	.venv/bin/python bench/detectors/run.py
	.venv/bin/python bench/detectors/tpot.py
	.venv/bin/python bench/detectors/prefix.py
