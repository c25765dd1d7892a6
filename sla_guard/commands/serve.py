"""`sla-guard serve --config FILE`: the guard as a service: the evaluation loop and the HTTP API
(uvicorn) in one asyncio process, until SIGINT/SIGTERM.

The guard and its parts (SLOs, detectors, the scaling advisor) come from the composition root,
``sla_guard.compose.compose``, with the routers of those parts (``/v1/findings``,
``/v1/recommendations``, ...), mounted here behind the API's bearer auth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import sys
import threading
import time

from sla_guard.config import ConfigError, TokenFile, load_config, split_listen

log = logging.getLogger("sla_guard.serve")

# after SIGTERM: how long the guard loop may take to finish its round before the process exits
SHUTDOWN_GRACE_S = 5.0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run the guard: evaluation loop + HTTP API")
    p.add_argument("--config", required=True, help="guard configuration (YAML)")
    p.add_argument("--listen", help="HOST:PORT, overrides api.listen")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"api.listen: {listen!r} is not HOST:PORT (e.g. 127.0.0.1:8080)")
    return host.strip("[]"), int(port)


UVICORN_STARTUP_FAILURE = 3  # uvicorn.server: sys.exit(3) when it cannot bind


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # a SIGTERM before the server is up (a pod deleted as it starts) is remembered and honoured once it
    # is, as a clean stop: the default action killed the process (-15) before atexit could run
    early_stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: early_stop.set())
    try:
        cfg = load_config(args.config)  # every problem of the file is a ConfigError, never a traceback
        try:
            host, port = split_listen(args.listen or cfg.api.listen)
        except ValueError as err:  # only --listen can still be wrong: api.listen was validated
            raise ConfigError(f"{'--listen' if args.listen else 'api.listen'}: {err}") from None
        # ConfigError if the file went away since load_config read it; a token file is followed, so a
        # rotated Secret needs no restart
        token = TokenFile(cfg.api.token_file) if cfg.api.token_file is not None else cfg.api.token()
        if token is None and not _loopback(host):
            raise ConfigError(f"api.listen: {host} is not a loopback address and no API token is set; "
                              f"set api.token_file or ${cfg.api.token_env or 'SLA_GUARD_TOKEN'}")
        if token is None and cfg.api.token_env and "token_env" in cfg.api.model_fields_set:
            # a variable named in the config is meant to hold the token: unset, /v1 would be open
            # without a word (the default $SLA_GUARD_TOKEN unset on loopback is the documented dev mode)
            raise ConfigError(f"api.token_env: ${cfg.api.token_env} is not set or empty; export it, or remove "
                              f"api.token_env to serve /v1 without a token on loopback")
        if token is None and cfg.api.token_env and cfg.api.token_env in os.environ:
            # exported but blank (a Secret with an empty key): someone meant to set a token, and reading
            # it as unset opened /v1 to every client on loopback; only an unset default variable is dev mode
            raise ConfigError(f"api.token_env: ${cfg.api.token_env} is set but empty; put the token in it, or "
                              f"unset it to serve /v1 without a token on loopback")
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2

    import uvicorn

    from sla_guard.api import create_app, server_config
    from sla_guard.compose import compose
    from sla_guard.state import StateUnavailable, open_state

    try:  # locked, read-only, full: serve with persistence off and retry (no crash loop over the file)
        state = open_state(cfg, retry=True)
    except StateUnavailable as err:  # newer schema, another program's file, not a file path: the config's
        print(f"state.path: {err}", file=sys.stderr)
        return 2
    if args.listen:  # the address alerts link back to (alertmanager.external_url unset)
        cfg = cfg.model_copy(update={"api": cfg.api.model_copy(update={"listen": args.listen})})
    root = compose(cfg, state=state)
    guard = root.guard
    app = create_app(guard, token=token, extra_routers=root.routers, max_body_bytes=cfg.api.max_body_bytes)
    class _Server(uvicorn.Server):
        # uvicorn re-raises SIGTERM/SIGINT after its shutdown; we stop the guard loop first and
        # exit 0, so the signals are ours
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    server = _Server(server_config(app, host, port))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        if early_stop.is_set():
            server.should_exit = True
        loop_task = asyncio.create_task(guard.run(stop))
        log.info("sla-guard starting on http://%s:%d (source=%s, %d evaluators)", host, port, guard.source.mode,
                 len(guard.evaluators))
        try:
            await server.serve()
        finally:
            stop.set()
            try:
                await asyncio.wait_for(loop_task, SHUTDOWN_GRACE_S)
            except TimeoutError:
                log.warning("guard loop did not stop within %gs; exiting anyway", SHUTDOWN_GRACE_S)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(main())
    except SystemExit as stop:  # uvicorn's startup failure (3): the address, which is the config's
        if stop.code != UVICORN_STARTUP_FAILURE:
            raise
        print(f"{'--listen' if args.listen else 'api.listen'}: cannot listen on {host}:{port} (see the error "
              f"above: in use, or not an address of this host); choose another", file=sys.stderr)
        return 2
    # a tick or query thread still blocked on a dead peer must not keep the process alive; but the
    # tick thread and the API's worker threads are still winding down here even when idle, so they
    # get the grace to finish (a tick its state save): os._exit skips atexit, where the leader's
    # Lease is released
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    if stuck := [t.name for t in others if t.is_alive()]:
        log.warning("exiting with %s still running after %gs (abandoned)", ", ".join(stuck), SHUTDOWN_GRACE_S)
        logging.shutdown()
        os._exit(0)
    return 0
