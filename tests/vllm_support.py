"""Helpers to run REAL CPU vLLM (the .venv-vllm venv) from tests.

Nothing here imports vLLM: tests run in the project venv (.venv) and drive vLLM as a
subprocess, exactly as an operator would (``python -m vllm.entrypoints.openai.api_server``).
The tiny model (Llama, 2 layers, random weights via ``--load-format dummy``) and its byte-level
BPE tokenizer are built at test time; building the tokenizer needs the ``tokenizers`` package,
which lives in .venv-vllm, so ``build_tiny_model`` runs this file as a script there.

Facts used (vLLM's CPU installation guide,
https://docs.vllm.ai/en/latest/getting_started/installation/cpu.html, and trials here): float32 (bf16
crashes with SIGILL here),
head_dim 32, ``--enforce-eager``, ready after ~30 s, ~1.7 GB RSS per engine.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("SLA_GUARD_VLLM_VENV", REPO / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = float(os.environ.get("SLA_GUARD_VLLM_STARTUP_S", "240"))


def vllm_unavailable_reason() -> str | None:
    """Why real-vLLM tests cannot run here, or None when they can."""
    if os.environ.get("SLA_GUARD_SKIP_VLLM") == "1":
        return "SLA_GUARD_SKIP_VLLM=1"
    if not VLLM_PYTHON.exists():
        return f"no vLLM venv at {VLLM_VENV} (create it with scripts/setup.sh --full)"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- tiny model ----------------------------------------------------------------------------------
_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "prefill and decode pools serve one model with separate engines",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "time to first token and time per output token are the two latency targets",
    "0 1 2 3 4 5 6 7 8 9 hello world, metrics; logs: traces!",
]


def _write_tokenizer(out: Path) -> None:
    """Runs inside .venv-vllm (needs ``tokenizers``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_CONFIG["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 4096,
    }))


def build_tiny_model(out: Path, python: Path = VLLM_PYTHON) -> Path:
    """Create the model directory (config, generation config, tokenizer) at ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_CONFIG))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    subprocess.run([str(python), __file__, "build-tokenizer", str(out)], check=True, timeout=120,
                   capture_output=True)
    return out


def install_test_plugin(src: Path, dest: Path, python: Path = VLLM_PYTHON) -> Path:
    """pip-install a test-only plugin (tests/plugins/*) with --no-deps into ``dest``/site, a private
    directory for one server's PYTHONPATH: never into the shared vLLM venv."""
    import shutil

    copy, target = dest / "src", dest / "site"
    shutil.copytree(src, copy)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(copy)], check=True, capture_output=True, timeout=300)
    return target


def example_connector_args(role: str, storage: Path) -> list[str]:
    """``--kv-transfer-config`` for vLLM's ExampleConnector (KV through files in ``storage``): the
    P/D pair that runs on CPU, ``role`` kv_producer (prefill) or kv_consumer (decode)."""
    cfg = {"kv_connector": "ExampleConnector", "kv_role": role,
           "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ["--kv-transfer-config", json.dumps(cfg)]


# --- servers -------------------------------------------------------------------------------------
def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a CPU vLLM server: offline, small KV cache, our hooks' sampler fast."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PROMETHEUS_MULTIPROC"))}
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
        "SLA_GUARD_SAMPLE_INTERVAL_S": "1",
    })
    env.pop("SLA_GUARD_RUN_DIR", None)
    env.update(extra or {})
    return env


@dataclass
class VllmServer:
    """One running ``vllm.entrypoints.openai.api_server`` in its own process group."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return self.base_url + "/metrics"

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left (workers included)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def start_server(model_dir: Path, *, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_dir: Path | None = None, python: Path = VLLM_PYTHON, wait: bool = True,
                 cli: bool = False) -> VllmServer:
    """``cli=True`` launches through ``vllm serve`` (needed for ``--api-server-count`` > 1)."""
    port = free_port()
    entry = (["-m", "vllm.entrypoints.cli.main", "serve", str(model_dir)] if cli else
             ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)])
    args = [str(python), *entry,
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--load-format", "dummy", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--max-num-seqs", "16", *extra_args]
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="vllm-log-"))
    log_path = log_dir / f"vllm-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, env=base_env(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(log_dir))
    server = VllmServer(proc, port, log_path, args)
    if wait:
        try:
            wait_healthy(server)
        except BaseException:
            server.stop()
            raise
    return server


def wait_healthy(server: VllmServer, timeout: float = STARTUP_TIMEOUT_S) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM not healthy after {timeout:.0f} s:\n{server.log_tail()}")


def complete(base_url: str, prompt: str, max_tokens: int = 16, **extra) -> dict:
    """One non-streaming completion; ``ignore_eos`` so random weights generate max_tokens."""
    import httpx

    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def stream_token_gaps(base_url: str, prompt: str, max_tokens: int) -> list[float]:
    """One streamed completion; the gaps between consecutive token chunks (seconds), as the
    client reads them (chunks read together from one network buffer have gaps near 0)."""
    import httpx

    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


@contextlib.contextmanager
def background_load(server: VllmServer, clients: int = 4, max_tokens: int = 64):
    """Keep ``clients`` completions in flight until the block ends; yields the list of errors seen
    (a client that fails waits 0.5 s and goes on, so a test can judge the errors at the end)."""
    import threading

    stop = threading.Event()
    errors: list[str] = []

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                complete(server.base_url, f"request {i} " + "a b c d " * 20, max_tokens=max_tokens)
            except Exception as err:
                errors.append(repr(err))
                time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for th in threads:
        th.start()
    try:
        yield errors
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=130)


def scrape(metrics_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse an exposition into {(sample name, sorted labels): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def select(samples: Mapping, name: str, **labels: str) -> dict[tuple, float]:
    """Samples of ``name`` whose labels include ``labels``."""
    return {k: v for k, v in samples.items()
            if k[0] == name and all(dict(k[1]).get(a) == b for a, b in labels.items())}


def total(samples: Mapping, name: str, **labels: str) -> float:
    return sum(select(samples, name, **labels).values())


if __name__ == "__main__":  # pragma: no cover - run inside .venv-vllm by build_tiny_model
    if len(sys.argv) == 3 and sys.argv[1] == "build-tokenizer":
        _write_tokenizer(Path(sys.argv[2]))
    else:
        sys.exit("usage: vllm_support.py build-tokenizer DIR")
