"""Reading a /metrics page whole, within a size bound: the guard's scraper and the sidecar both
stream the body and give up past the limit, so an endless or huge page can grow neither."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


class PageTooLarge(Exception):
    """The page is over the size limit (declared in Content-Length, or counted while streaming)."""


class PageNotText(Exception):
    """The page is not UTF-8 text."""


# what a scrape asks for: a gzip page is inflated here, within the limit (httpx inflates each
# 64 KiB compressed chunk whole, up to ~67 MB of zeros, before the limit saw a byte)
ACCEPT_ENCODING = "gzip"


def _inflater(resp: httpx.Response):
    enc = resp.headers.get("content-encoding", "").strip().lower()
    if enc in ("", "identity"):
        return None
    if enc in ("gzip", "x-gzip"):
        return zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
    if enc == "deflate":
        return zlib.decompressobj()
    raise PageNotText(f"content-encoding {enc!r} not supported (asked for {ACCEPT_ENCODING})")


async def read_page(resp: httpx.Response, limit: int) -> str:
    """The whole body of a streamed response as text; PageTooLarge past ``limit`` bytes, counted
    after decompression and never inflated or buffered beyond it; PageNotText if it is not UTF-8
    (or not a valid gzip stream). The caller bounds the total time."""
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PageTooLarge(f"Content-Length {declared} > {limit} bytes")
    inflate = _inflater(resp)
    chunks, size = [], 0
    try:
        async for raw in resp.aiter_raw():
            data = raw
            while data:
                if inflate is None:
                    out, data = data, b""
                else:  # at most one byte past the limit per call; the rest waits in unconsumed_tail
                    out = inflate.decompress(data, limit - size + 1)
                    data = inflate.unconsumed_tail
                size += len(out)
                if size > limit:
                    raise PageTooLarge(f"body over {limit} bytes")
                chunks.append(out)
        if inflate is not None:
            chunks.append(inflate.flush())
    except zlib.error as err:
        raise PageNotText(f"not a valid {resp.headers.get('content-encoding')} stream: {err}") from None
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as err:
        raise PageNotText(f"not UTF-8: {err}") from None


def run_bounded(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` without its final wait for the default executor: httpx resolves host names there
    (getaddrinfo in a thread), so a slow DNS held every sidecar scrape (and every push of
    ``sla_guard.outbound``) until the lookup ended, long after the request's deadline had passed.
    The abandoned lookup thread ends on its own."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            left = asyncio.all_tasks(loop)  # as asyncio.run: cancel what the coroutine left behind
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()  # shuts the default executor down without waiting for it
