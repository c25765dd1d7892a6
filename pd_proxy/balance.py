"""Engine choice within one pool: round-robin, or least-loaded by this proxy's own in-flight count.

The proxy knows exactly how many of its requests each engine is serving (a prefill engine from
request sent to answer, a decode engine until the stream is closed), which is the load signal a
single proxy can have without scraping the engines. Ties are broken in round-robin order, so an
idle pool is still spread evenly.

Passive health: an engine that refused a connection, broke one, gave no answer before the leg's
deadline or answered 503 (vLLM's admission control: "try again on a different instance") is left
out for ``EJECT_S``, doubled per consecutive failure up to ``EJECT_MAX_S``; then one request at a
time tries it again (a hung engine costs one request per deadline, not its share), and any other
answer brings it back. Without this a dead engine kept its share of requests (each a 502).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from pd_proxy.config import display_url

log = logging.getLogger("pd_proxy")

EJECT_S = 1.0
EJECT_MAX_S = 10.0


class Lease:
    """One request's hold on an engine; ``release()`` is idempotent, so every exit path may call it."""

    __slots__ = ("_pool", "url")

    def __init__(self, pool: EnginePool, url: str) -> None:
        self._pool: EnginePool | None = pool
        self.url = url

    def release(self) -> None:
        if self._pool is not None:
            self._pool._in_flight[self.url] -= 1
            if self._pool._probing.get(self.url) is self:
                del self._pool._probing[self.url]
            self._pool = None


class EnginePool:
    """The engines of one pool (prefill or decode). Used from one event loop only, so no lock."""

    def __init__(
        self,
        urls: tuple[str, ...] | list[str],
        policy: str = "round-robin",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("a pool needs at least one engine")
        self.urls = tuple(dict.fromkeys(urls))  # a URL given twice is one engine
        self.policy = policy
        self._clock = clock
        self._next = 0
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._failures = dict.fromkeys(self.urls, 0)  # consecutive
        self._out_until = dict.fromkeys(self.urls, 0.0)
        self._probing: dict[str, Lease] = {}  # the one call trying each engine that failed before

    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def ejected(self) -> dict[str, float]:
        """The engines left out now, with the seconds until the next request may try them again."""
        now = self._clock()
        return {u: round(t - now, 3) for u, t in self._out_until.items() if t > now}

    def acquire(self, tried: Collection[str] = ()) -> Lease:
        """An engine not in ``tried``, preferring those not left out; when every one is left out (the whole
        pool down), one of them anyway: the request fails with that engine's own error, not the proxy's."""
        n = len(self.urls)
        order = [self.urls[(self._next + i) % n] for i in range(n)]
        order = [u for u in order if u not in tried] or order
        now = self._clock()
        order = [u for u in order if self._usable(u, now)] or order
        # least-loaded: min keeps the first of equals, i.e. round-robin among the least loaded
        url = min(order, key=self._in_flight.__getitem__) if self.policy == "least-loaded" else order[0]
        self._next = (self.urls.index(url) + 1) % n
        self._in_flight[url] += 1
        lease = Lease(self, url)
        if self._failures[url] and url not in self._probing:
            self._probing[url] = lease
        return lease

    def another(self, tried: Collection[str]) -> bool:
        """Is there an engine not in ``tried`` and not left out, to move a failed call to?"""
        now = self._clock()
        return any(u not in tried and self._usable(u, now) for u in self.urls)

    def _usable(self, url: str, now: float) -> bool:
        """Not left out, and not an engine that failed before while one call is already trying it again."""
        return self._out_until[url] <= now and url not in self._probing

    def failed(self, url: str, why: str) -> None:
        """The engine did not serve a call (see the module doc): left out for a while."""
        now = self._clock()
        if self._out_until[url] > now:  # already out: the calls of one outage count once
            return
        self._failures[url] += 1
        out_s = min(EJECT_S * 2 ** min(self._failures[url] - 1, 16), EJECT_MAX_S)
        self._out_until[url] = now + out_s
        log.warning(
            "engine %s left out for %g s (%s; %d failure(s) in a row)",
            display_url(url),
            out_s,
            why,
            self._failures[url],
        )

    def answered(self, url: str) -> None:
        """The engine answered (anything but 503): it is up."""
        if self._failures[url]:
            log.info("engine %s answers again", display_url(url))
        self._failures[url] = 0
        self._out_until[url] = 0.0
        self._probing.pop(url, None)
