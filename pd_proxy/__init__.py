"""sla-guard-proxy: a prefill/decode proxy for vLLM that measures what the client sees.

Engine hooks see each half of a P/D request separately (prefill's TTFT ends at its one token,
decode's starts at its own arrival), so neither says what a client waited for. This proxy sits
where the client does: it routes each OpenAI request to a prefill engine, hands the KV-transfer
parameters to a decode engine, streams the answer back, and publishes the client scope of the
metric contract (``exporters.contract``: client TTFT, TPOT, e2e, outcome, in-flight and the TTFT
stages) on its own ``/metrics``. Like ``engine_hooks`` it is a data source: it imports only
``exporters``.

Modules: ``config`` (what an operator sets), ``balance`` (engine choice), ``legs`` (request
rewriting and SSE handling, pure), ``metrics`` (the client-scope instruments), ``app`` (the
FastAPI app), ``runner`` (uvicorn in a thread, for tests and embedding), ``cli`` (the console
script).
"""

from pd_proxy.app import build_app
from pd_proxy.config import ProxyConfig
from pd_proxy.runner import ProxyThread

__all__ = ["ProxyConfig", "ProxyThread", "build_app"]
