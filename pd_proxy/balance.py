"""Engine choice within one pool: round-robin, or least-loaded by this proxy's own in-flight count.

The proxy knows exactly how many of its requests each engine is serving (a prefill engine from
request sent to answer, a decode engine until the stream is closed), which is the load signal a
single proxy can have without scraping the engines. Ties are broken in round-robin order, so an
idle pool is still spread evenly.

Passive health: an engine that refused a connection, broke one, gave no answer before the leg's
deadline or answered 503 (vLLM's admission control: "try again on a different instance") is left
out for ``EJECT_S``, doubled per consecutive failure up to ``EJECT_MAX_S``; then one request at a
time tries it again (a hung engine costs one request per deadline, not its share), and any answer
under 500 brings it back (a 5xx or a stream that opens with an error event, as vLLM's answers once its
engine core is dead, neither brings it back nor leaves it out). Without this a dead engine kept its
share of requests (each a 502).

Active health (optional, ``Proxy`` probes each engine's ``/health``): a failed probe leaves the engine out
as a failed call does, and holds it out until a probe answers 200 again, so an engine a probe finds dead or
hung stops getting requests before one of them waits out its deadline. A 200 only lifts that hold: it never ends a
time out, nor resets the failures in a row. vLLM's /health answers 200 while its API server runs and the engine
core is not dead, which a stalled engine still does, so whatever real traffic saw stands until a real request
is answered again (the passive rule above).

Readiness (``service``, the proxy's ``GET /readyz``): is there an engine a request could use? With probes on, the probe
decides (held: no; a 200: yes; not probed yet: unknown, so no), because a time out is a per-request judgement that a
blip (one failed call), an overload (503s) or a stall every proxy replica sees alike can set: counted, readiness would
flap with each, on every replica at once. Without a probe verdict (probes off, or a /health that says nothing), a
single failure's time out still counts as in service; an engine that failed again on its next try
(``READY_FAILURES`` in a row) is out of service until its time out is over, when the next request may try it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from pd_proxy.config import display_url

log = logging.getLogger("pd_proxy")

EJECT_S = 1.0
EJECT_MAX_S = 10.0
READY_FAILURES = 2  # failures in a row before a time out counts against readiness (without a probe verdict)


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
        self._held: set[str] = set()  # engines whose last /health probe failed: out until one answers 200
        self._health: dict[str, tuple[str, str, float]] = {}  # each engine's last probe: state, detail, when

    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def ejected(self) -> dict[str, float]:
        """The engines left out now, with the seconds until the next request may try them again (0 for one held
        out until its /health answers 200)."""
        now = self._clock()
        return {u: round(max(t - now, 0.0), 3) for u, t in self._out_until.items() if t > now or u in self._held}

    def probes(self) -> dict[str, dict[str, object]]:
        """The last /health probe of each engine probed: state (up, down, unknown), detail, seconds ago."""
        now = self._clock()
        return {
            u: {"state": state, "detail": detail, "age_s": round(now - at, 3)}
            for u, (state, detail, at) in self._health.items()
        }

    def service(self, probed: bool) -> dict[str, tuple[bool, str]]:
        """Each engine: in service (could a request use it?) and why; ``probed``: are /health probes on
        (see the module doc)."""
        now = self._clock()
        out: dict[str, tuple[bool, str]] = {}
        for u in self.urls:
            state, detail, _ = self._health.get(u, ("", "", 0.0))
            failures, left = self._failures[u], self._out_until[u] - now
            if u in self._held:
                out[u] = (False, f"held until /health answers 200 ({detail})")
            elif state == "up":
                out[u] = (True, "/health answers 200")
            elif probed and not state:
                out[u] = (False, "not probed yet")
            elif not failures:
                out[u] = (True, "no failure")
            else:
                row = f"{failures} failure{'s' * (failures > 1)} in a row"
                if left <= 0:
                    out[u] = (True, f"{row}, time out over: the next request tries it")
                elif failures < READY_FAILURES:
                    out[u] = (True, f"left out {left:.3g} s more after {row}: a blip, not counted")
                else:
                    out[u] = (False, f"left out {left:.3g} s more after {row}")
        return out

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
        return self._out_until[url] <= now and url not in self._probing and url not in self._held

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
        """The engine answered (under 500): it is up. Real traffic outranks a failed /health probe too."""
        if self._failures[url]:
            log.info("engine %s answers again", display_url(url))
        self._failures[url] = 0
        self._out_until[url] = 0.0
        self._probing.pop(url, None)
        self._held.discard(url)

    def probe_failed(self, url: str, why: str) -> None:
        """/health refused, broke, timed out or answered 5xx: left out as a failed call, and held out until a 200."""
        self._probed(url, "down", why)
        self._held.add(url)
        self.failed(url, f"/health: {why}")

    def probe_ok(self, url: str) -> None:
        """/health answered 200: the hold goes; a time out real traffic earned runs on (see the module doc)."""
        if url in self._held:
            log.info("engine %s: /health answers 200 again", display_url(url))
        self._probed(url, "up", "200")
        self._held.discard(url)

    def probe_unknown(self, url: str, why: str) -> None:
        """/health answered what tells neither (404: not served there, 401): no verdict, nothing changes."""
        if self._health.get(url, ("",))[0] != "unknown":
            log.warning("engine %s: /health %s, which says neither up nor down", display_url(url), why)
        self._probed(url, "unknown", why)

    def _probed(self, url: str, state: str, detail: str) -> None:
        self._health[url] = (state, detail, self._clock())
