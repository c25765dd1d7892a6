"""A minimal prefill/decode proxy for tests: the request path vLLM's P/D examples use.

POST /v1/completions: (1) to the prefill server with max_tokens=1 and
``kv_transfer_params={"do_remote_decode": true}``; (2) to the decode server with the original
body plus the ``kv_transfer_params`` prefill returned (if any). The decode answer goes back to the
client. Both hops reuse the client's X-Request-Id so the two halves can be joined.
Runs uvicorn in a thread on a free 127.0.0.1 port.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def make_app(prefill_url: str, decode_url: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=120)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        rid = request.headers.get("x-request-id") or str(uuid.uuid4())
        headers = {"X-Request-Id": rid}
        p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        p = await client.post(prefill_url + "/v1/completions", json=p_body, headers=headers)
        if p.status_code != 200:
            return JSONResponse(p.json(), status_code=p.status_code)
        d_body = dict(body)
        kv = p.json().get("kv_transfer_params")
        if kv:
            d_body["kv_transfer_params"] = kv
        d = await client.post(decode_url + "/v1/completions", json=d_body, headers=headers)
        return JSONResponse(d.json(), status_code=d.status_code)

    return app


class PdProxy:
    def __init__(self, prefill_url: str, decode_url: str, port: int) -> None:
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(make_app(prefill_url, decode_url), host="127.0.0.1",
                                                    port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> PdProxy:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("P/D proxy did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
