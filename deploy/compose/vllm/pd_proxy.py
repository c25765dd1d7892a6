"""A minimal P/D proxy for vLLM's NixlConnector (the `vllm` profile of docker-compose.yml).

Each OpenAI completion / chat request goes first to a prefill engine with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; the prefill response's ``kv_transfer_params``
(engine id, block ids, host, port) are then passed to a decode engine, which pulls the KV cache
over NIXL and generates the answer, streamed back unchanged. Engines are picked round-robin.

    python pd_proxy.py --listen 0.0.0.0:8000 --prefill http://p0:8000 --decode http://d0:8000
"""

from __future__ import annotations

import argparse
import itertools
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_request(body: dict) -> dict:
    """The prefill leg: one token, no streaming, ask the engine to keep the KV for a remote decode."""
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_request(body: dict, prefill_response: dict) -> dict:
    return {**body, "kv_transfer_params": prefill_response.get("kv_transfer_params")}


def build_app(prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> FastAPI:
    app = FastAPI(title="sla-guard P/D proxy")
    next_prefill, next_decode = itertools.cycle(prefill), itertools.cycle(decode)
    client = httpx.AsyncClient(timeout=timeout_s)

    async def relay(path: str, request: Request):
        body = await request.json()
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or str(uuid.uuid4())}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        p = await client.post(f"{next(next_prefill)}{path}", json=prefill_request(body), headers=headers)
        if p.status_code != 200:
            return JSONResponse(p.json() if p.headers.get("content-type", "").startswith("application/json")
                                else {"error": p.text}, status_code=p.status_code)
        dec = decode_request(body, p.json())
        target = f"{next(next_decode)}{path}"
        if not body.get("stream"):
            d = await client.post(target, json=dec, headers=headers)
            return JSONResponse(d.json(), status_code=d.status_code)
        req = client.build_request("POST", target, json=dec, headers=headers)
        resp = await client.send(req, stream=True)

        async def chunks():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(chunks(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "text/event-stream"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await relay("/v1/chat/completions", request)

    @app.get("/health")
    async def health():
        return {"prefill": prefill, "decode": decode}

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:8000")
    p.add_argument("--prefill", action="append", required=True, help="prefill engine base URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="decode engine base URL (repeatable)")
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    uvicorn.run(build_app(args.prefill, args.decode), host=host, port=int(port), log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
