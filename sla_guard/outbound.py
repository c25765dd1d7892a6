"""Calls the guard makes to other services (Alertmanager, the scaling webhook, the Kubernetes API)
complete within a total deadline.

A client's timeout bounds each read, not the request: a peer that trickled its answer a byte at
a time held the call, and the thread that made it (the alert publisher, the guard's tick, the
leader elector), for as long as it trickled. ``post_json`` runs the whole request (connect,
headers, body) under ``asyncio.timeout``, which cancels it and closes its connection at the
deadline, and a slow name lookup left behind does not hold the caller (``run_bounded``).
``call_within`` bounds a blocking client's call (the ``kubernetes`` client) the only way it can be:
the caller stops waiting, and the call ends on its own timeouts in a daemon thread. (Prometheus
mode bounds its many queries on its own thread pool, ``ingest.prometheus.PrometheusView._get``.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from exporters.page_read import run_bounded

log = logging.getLogger(__name__)

T = TypeVar("T")


def post_json(url: str, body: object, *, timeout_s: float, headers: dict[str, str] | None = None,
              auth: httpx.Auth | tuple[str, str] | None = None) -> httpx.Response:
    """POST ``body`` as JSON; the response, or ``TimeoutError`` once ``timeout_s`` has passed
    (httpx's own errors otherwise). Each call opens its own connection: pushes are rare."""

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers, auth=auth) as client:
            async with asyncio.timeout(timeout_s):
                return await client.post(url, json=body)

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: a worker thread without an event loop
        return run_bounded(post())
    with concurrent.futures.ThreadPoolExecutor(1) as ex:  # called on a loop's thread: not on that loop
        return ex.submit(run_bounded, post()).result()


def call_within(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()``'s result, or ``TimeoutError`` once ``timeout_s`` has passed. For blocking clients
    (the ``kubernetes`` client) whose own timeout bounds each socket read, not the request: an API
    server trickling its answer held the call, and the guard's tick or the elector, for as long as
    it trickled. The call left behind runs on in a daemon thread until its own timeouts end it."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:  # handed to the caller
            out["error"] = err

    th = threading.Thread(target=run, name="sla-guard-bounded-call", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        raise TimeoutError(f"no complete answer within {timeout_s:g}s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def kube_api_client(kubeconfig: str | None = None) -> Any:
    """A ``kubernetes`` ApiClient from ``kubeconfig``, else the pod's service account, with no
    urllib3 retries inside a call: a retry left running after ``call_within``'s deadline would
    make a hung call take (retries + 1) x its timeout, and could patch after this guard lost the
    leadership. Callers retry on their own schedule (the next tick, the election loop)."""
    from kubernetes import client, config  # optional extra: sla-guard[kubernetes]

    conf = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=conf)
    else:
        config.load_incluster_config(client_configuration=conf)
    conf.retries = 0
    return client.ApiClient(conf)


def env_value(field: str, var: str | None, without: str) -> str | None:
    """``$var`` for a header sent to another service (a bearer token, a ``headers_env`` value),
    surrounding whitespace dropped: a Secret written with ``echo`` ends in a newline, and httpx
    refused the header with an error quoting it, token included, into the log and /v1/targets at
    every call. A value that is still not one line of printable ASCII, or an unset one, is not
    sent; the warning names the field and the variable, never the value (``without``: what the
    guard does instead, e.g. "querying Prometheus without a bearer token")."""
    if not var:
        return None
    value = os.environ.get(var, "").strip()
    if not value:
        log.warning("%s: $%s is not set or empty; %s", field, var, without)
        return None
    if not all(" " <= ch <= "~" for ch in value):
        log.warning("%s: $%s holds a line break, a control or a non-ASCII character, which no HTTP header can "
                    "carry; %s: set it to the value alone", field, var, without)
        return None
    return value
