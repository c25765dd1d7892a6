"""Shared pytest fixtures, above all for tests against REAL CPU vLLM.

Fixture API (session-scoped; other test modules reuse these, do not start engines yourself):

``vllm_venv_python`` -> pathlib.Path
    The .venv-vllm interpreter. Calls ``pytest.skip`` with the reason when .venv-vllm is
    missing or SLA_GUARD_SKIP_VLLM=1, so every test that (indirectly) uses it skips cleanly.

``tiny_model_dir`` -> pathlib.Path
    A tiny Llama model directory (config + byte-level BPE tokenizer, built at test time;
    weights are random through ``--load-format dummy``). Served as model name ``"tiny"``
    (``tests.vllm_support.MODEL_NAME``).

``vllm_server_factory`` -> callable ``(extra_args=(), env=None, wait=True, cli=False) -> VllmServer``
    Starts ``python -m vllm.entrypoints.openai.api_server`` on a free 127.0.0.1 port with the
    CPU settings of tests/vllm_support.py and waits for /health. The returned object
    has ``.base_url``, ``.metrics_url``, ``.pid`` (API-server PID, leader of its own process
    group), ``.proc`` (Popen), ``.log_tail()`` and ``.stop()`` (kills the whole process group).
    ``cli=True`` launches via ``vllm serve`` instead (needed for ``--api-server-count`` > 1).
    Every server it started is stopped at session end, also on failure. Each engine costs
    ~30 s and ~1.7 GB RSS on a 2-core machine: stop servers you no longer need.

``vllm_spec_engine`` -> VllmServer
    ONE shared engine with ngram speculative decoding (3 speculative tokens), no KV connector,
    hence pool="mixed". Shared by all tests in the session: assert on deltas, not absolutes.

Helpers for talking to a server live in ``tests/vllm_support.py``: ``complete(base_url,
prompt, max_tokens)``, ``scrape(metrics_url)`` -> {(name, labels): value}, ``select``, ``total``.
Mark real-vLLM tests ``@pytest.mark.vllm`` (and ``slow`` when they start their own engine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_support as vs

SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


@pytest.fixture(scope="session")
def vllm_venv_python() -> Path:
    reason = vs.vllm_unavailable_reason()
    if reason:
        pytest.skip(f"real vLLM tests skipped: {reason}")
    return vs.VLLM_PYTHON


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_venv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vs.build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", vllm_venv_python)


@pytest.fixture(scope="session")
def vllm_server_factory(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    started: list[vs.VllmServer] = []
    log_dir = tmp_path_factory.mktemp("vllm-logs")

    def start(extra_args=(), env=None, wait: bool = True, cli: bool = False) -> vs.VllmServer:
        server = vs.start_server(tiny_model_dir, extra_args=list(extra_args), env=env, log_dir=log_dir,
                                 wait=False, cli=cli)
        started.append(server)
        if wait:
            vs.wait_healthy(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="session")
def vllm_spec_engine(vllm_server_factory):
    server = vllm_server_factory(["--speculative-config", json.dumps(SPEC_CONFIG)])
    yield server
    server.stop()
