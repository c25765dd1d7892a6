"""The proxy under uvicorn in a background thread, on a port the OS picks: how tests (and anything
embedding the proxy) run it without a subprocess."""

from __future__ import annotations

import threading
import time

import uvicorn

from exporters.request_deadline import request_timeout_protocol
from pd_proxy.app import build_app
from pd_proxy.config import ProxyConfig
from pd_proxy.metrics import ClientMetrics


class ProxyThread:
    def __init__(self, config: ProxyConfig, host: str = "127.0.0.1", port: int = 0,
                 metrics: ClientMetrics | None = None) -> None:
        self.app = build_app(config, metrics)
        # the request deadline as the CLI has it (cli.main)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="on",
                                                    http=request_timeout_protocol(config.request_timeout_s)))
        self.host = host
        self.port = port
        self.thread = threading.Thread(target=self.server.run, name="sla-guard-proxy", daemon=True)

    @property
    def proxy(self):
        return self.app.state.proxy

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> ProxyThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"sla-guard-proxy did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
