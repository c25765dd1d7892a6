"""Engine choice within one pool: round-robin, or least-loaded by this proxy's own in-flight count.

The proxy knows exactly how many of its requests each engine is serving (a prefill engine from
request sent to answer, a decode engine until the stream is closed), which is the load signal a
single proxy can have without scraping the engines. Ties are broken in round-robin order, so an
idle pool is still spread evenly.
"""

from __future__ import annotations


class Lease:
    """One request's hold on an engine; ``release()`` is idempotent, so every exit path may call it."""

    __slots__ = ("_pool", "url")

    def __init__(self, pool: EnginePool, url: str) -> None:
        self._pool: EnginePool | None = pool
        self.url = url

    def release(self) -> None:
        if self._pool is not None:
            self._pool._in_flight[self.url] -= 1
            self._pool = None


class EnginePool:
    """The engines of one pool (prefill or decode). Used from one event loop only, so no lock."""

    def __init__(self, urls: tuple[str, ...] | list[str], policy: str = "round-robin") -> None:
        if not urls:
            raise ValueError("a pool needs at least one engine")
        self.urls = tuple(dict.fromkeys(urls))  # a URL given twice is one engine
        self.policy = policy
        self._next = 0
        self._in_flight = dict.fromkeys(self.urls, 0)

    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def acquire(self) -> Lease:
        n = len(self.urls)
        order = [self.urls[(self._next + i) % n] for i in range(n)]
        # least-loaded: min keeps the first of equals, i.e. round-robin among the least loaded
        url = min(order, key=self._in_flight.__getitem__) if self.policy == "least-loaded" else order[0]
        self._next = (self.urls.index(url) + 1) % n
        self._in_flight[url] += 1
        return Lease(self, url)
