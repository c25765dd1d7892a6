"""A request deadline for uvicorn's HTTP/1.1 server, shared by the guard's API and the P/D proxy.

uvicorn waits forever for a request's headers and body: a slowloris client (headers never finished,
a body promised and dripped or never sent) holds its connection, and the coroutine reading it, for
good, and enough of them exhaust the server's file descriptors.
"""

from __future__ import annotations

import asyncio


def request_timeout_protocol(timeout_s: float):
    """uvicorn's h11 protocol plus a request deadline: a connection must deliver a complete
    request (headers and body) within ``timeout_s`` of opening, or of its previous response,
    else it is closed. A response being sent (a long stream included) is never cut."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class RequestTimeoutH11(H11Protocol):
        _request_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
            self._request_timer = self.loop.call_later(timeout_s, self._request_timeout)

        def _request_timeout(self) -> None:
            self._request_timer = None
            if self.transport.is_closing():
                return
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and (
                self.cycle is None or self.cycle.response_complete or self.conn.their_state is h11.SEND_BODY
            ):
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
            super().connection_lost(exc)

    return RequestTimeoutH11
