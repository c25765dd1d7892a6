"""Prometheus text-exposition parsing, fast path plus the reference parser as the fallback.

prometheus_client's parser costs ~17 us per sample (measured on a contract exposition), which
is ~10 ms for a 50 KB vLLM page: too slow for a guard scraping hundreds of engines. The fast
path here handles the lines every real exporter writes (``name{l="v",...} value [ts]``, with
escapes) in one regular expression per line, and hands the whole text to
``prometheus_client.parser`` when it sees anything else, so odd-but-valid input still parses.
A malformed exposition fails as a whole (as a Prometheus scrape does): ``ExpositionError``.

A top-level module (not in ``sla_guard.ingest``): the store parses what it stores, and the
ingest package builds stores, so the parser sits below both.
"""

from __future__ import annotations

import collections
import re
from typing import Protocol

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+(-?[0-9][0-9.eE+-]*))?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_ESC = re.compile(r"\\(.)")
_UNESC = {"\\": "\\", '"': '"', "n": "\n"}

Sample = tuple[str, dict[str, str], float]


class ExpositionError(ValueError):
    """The exposition cannot be parsed; the message says which line and why."""


class _Fallback(Exception):
    pass


class SampleOrder:
    """One target's exposition timestamps: the last one of each series that carried one, and the
    names of the samples a page left out because theirs went backwards. Prometheus drops such a
    sample ("out of order"); stamped with the scrape's time instead, a cache serving an older page
    made every counter of it drop and rise again: a reset each time, counted twice or more."""

    __slots__ = ("dropped", "last", "limit")

    def __init__(self, limit: int = 200_000) -> None:
        self.last: dict[str, float] = {}
        self.dropped: set[str] = set()
        self.limit = limit

    def accept(self, key: str, name: str, ts_ms: float, problems: collections.Counter | None) -> bool:
        last = self.last.get(key)
        if last is not None and ts_ms < last:
            if problems is not None:
                problems["out_of_order"] += 1
            self.dropped.add(name)
            return False
        if last is None and len(self.last) >= self.limit:
            self.last.clear()  # bounded: a label bomb with timestamps forgets, it does not grow
        self.last[key] = ts_ms
        return True


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos, n = 0, len(text)
    while pos < n:
        m = _LABEL.match(text, pos)
        if m is None:
            if text[pos:].strip() in ("", ","):
                break
            raise _Fallback
        name, value = m.group(1), m.group(2)
        if "\\" in value:
            value = _ESC.sub(lambda e: _UNESC.get(e.group(1), "\\" + e.group(1)), value)
        if name in out:
            raise ExpositionError(f"label {name!r} repeated in {{{text[:80]}}}")
        out[name] = value
        pos = m.end()
    return out


# Label text -> parsed labels. The same pages are scraped every few seconds with the same label
# sets, so parsing each distinct text once removes most of the per-sample cost. Bounded: cleared
# when full (a label bomb cannot grow it without limit). Cached dicts are shared: never mutate.
_LABEL_CACHE: dict[str, dict[str, str]] = {}
_LABEL_CACHE_MAX = 50_000


def _cached_labels(text: str) -> dict[str, str]:
    got = _LABEL_CACHE.get(text)
    if got is None:
        got = _labels(text)
        if len(_LABEL_CACHE) >= _LABEL_CACHE_MAX:
            _LABEL_CACHE.clear()
        _LABEL_CACHE[text] = got
    return got


def _lines(text: str) -> list[str]:
    """The page's lines; CRLF line ends (a page served from Windows, or a proxy that rewrote it)
    read as the reference parser reads them, not as lines that cannot be parsed."""
    if "\r\n" in text:
        text = text.replace("\r\n", "\n")
    return text.split("\n")


def _fast(text: str, drop_created: bool, oldest_s: float | None = None,
          problems: collections.Counter | None = None, order: SampleOrder | None = None) -> list[Sample]:
    """The regular-expression parse (``_parse_lines``) with labels parsed, each distinct label
    text once; _Fallback for anything the reference parser must read (OpenMetrics exemplars,
    odd label text)."""
    raw = _parse_lines(enumerate(_lines(text), 1), drop_created, oldest_s, problems, order)
    if raw is None:
        raise _Fallback
    return [(name, _cached_labels(ltext) if ltext else {}, value) for _, name, ltext, value in raw]


def _reference(text: str, drop_created: bool, oldest_s: float | None = None,
               problems: collections.Counter | None = None, order: SampleOrder | None = None) -> list[Sample]:
    out: list[Sample] = []
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if drop_created and s.name.endswith("_created"):
                    continue
                if _stale(s.timestamp, oldest_s, problems):
                    continue
                if order is not None and s.timestamp is not None and not order.accept(
                        f"{s.name}{sorted(s.labels.items())}", s.name, float(s.timestamp) * 1000, problems):
                    continue
                out.append((s.name, dict(s.labels), float(s.value)))
    except Exception as err:  # the reference parser raises ValueError, TypeError, IndexError...
        raise ExpositionError(f"malformed exposition: {err}") from None
    return out


class KnownTexts(Protocol):
    """Hashes of series texts a target served before (the store's scrape cache)."""

    def __len__(self) -> int: ...

    def hits(self, hashes: np.ndarray) -> np.ndarray:
        """Boolean array: which of ``hashes`` are known."""
        ...


def parse_raw(text: str, *, drop_created: bool = True, known: KnownTexts | None = None,
              oldest_s: float | None = None, problems: collections.Counter | None = None,
              order: SampleOrder | None = None) -> list[tuple[str, str | None, str | None, float]] | None:
    """Fast path only: ``(series_text, name, label_text, value)`` per sample, where
    ``series_text`` is the line up to the value (``name{labels}``): a key that identifies the
    series within one target without parsing its labels -- the store keeps a per-target cache
    on it, as Prometheus's scrape cache does. None if the text needs the reference parser.

    ``known``: hashes of series texts this target served before (the store's scrape cache). A
    line ``<known series text> <number>`` skips the regular expression -- it was validated when
    first seen -- and comes back as ``(series_text, None, None, value)``, ahead of the other
    lines; ``split_series_text`` recovers name and label text. After the first scrape nearly
    every line of a page is known, and the page costs a few comprehensions.

    ``oldest_s``: a sample whose own timestamp (the optional third field, in ms) is older is left
    out and counted in ``problems['stale_timestamp']``: an exporter that says its value is an hour
    old is not giving a current one (Prometheus would not find it within its lookback either). A
    line with a timestamp is never a known text (its key would hold the value), so the full parse
    sees it. ``order``: the target's ``SampleOrder``; a sample whose timestamp is older than its
    series' last one is left out and counted in ``problems['out_of_order']``."""
    all_lines = _lines(text)
    if not known:
        return _parse_lines(enumerate(all_lines, 1), drop_created, oldest_s, problems, order)
    lines = [line for line in all_lines if line and line[0] != "#"]
    parts = [line.rpartition(" ") for line in lines]
    hit = known.hits(np.fromiter((hash(p[0]) for p in parts), np.int64, len(parts))).tolist()
    try:
        fast = [(p[0], None, None, float(p[2])) for p, h in zip(parts, hit, strict=True) if h]
    except ValueError:  # a known series with a bad value: the full parse says which line
        return _parse_lines(enumerate(all_lines, 1), drop_created, oldest_s, problems, order)
    if len(fast) == len(lines):
        return fast
    rest = [(None, line) for line, p, h in zip(lines, parts, hit, strict=True)
            if not h and not (drop_created and p[0].partition("{")[0].endswith("_created"))]
    if not rest:
        return fast
    slow = _parse_lines(rest, drop_created, oldest_s, problems, order)
    return None if slow is None else fast + slow


def _stale(ts_s: float | None, oldest_s: float | None, problems: collections.Counter | None) -> bool:
    if ts_s is None or oldest_s is None or ts_s >= oldest_s:
        return False
    if problems is not None:
        problems["stale_timestamp"] += 1
    return True


def _parse_lines(numbered, drop_created: bool, oldest_s: float | None = None,
                 problems: collections.Counter | None = None, order: SampleOrder | None = None
                 ) -> list[tuple[str, str | None, str | None, float]] | None:
    """The regular-expression parse of ``(line number or None, line)`` pairs."""
    out: list[tuple[str, str | None, str | None, float]] = []
    append = out.append
    match = _LINE.fullmatch
    for lineno, line in numbered:
        if not line or line[0] == "#":
            continue
        m = match(line)
        if m is None:
            if not line.strip():
                continue
            if "#" in line or line[0] == "{":  # exemplar; a quoted UTF-8 name ({"a.b",x="1"}, Prometheus 3)
                return None
            raise ExpositionError(f"line {lineno or '?'}: cannot parse {line[:120]!r}")
        name = m.group(1)
        if drop_created and name.endswith("_created"):
            continue
        if m.group(4) is not None:
            try:  # the pattern admits "1.2.3" or "1e1e": a ValueError here escaped every caller
                ts_ms = float(m.group(4))
            except ValueError:
                raise ExpositionError(f"line {lineno or '?'}: timestamp {m.group(4)[:40]!r} is not a number") from None
            if _stale(ts_ms / 1000.0, oldest_s, problems):
                continue
        vtext = m.group(3)
        try:
            value = float(vtext)
        except ValueError:
            raise ExpositionError(f"line {lineno or '?'}: value {vtext!r} is not a number") from None
        key = line[:m.end(2) + 1] if m.group(2) is not None else name
        if m.group(4) is not None and order is not None and not order.accept(key, name, ts_ms, problems):
            continue
        append((key, name, m.group(2), value))
    return out


def split_series_text(text: str) -> tuple[str, str | None]:
    """``name{labels}`` -> (name, label text); ``name`` -> (name, None)."""
    name, brace, rest = text.partition("{")
    return (name, rest[:-1]) if brace else (name, None)


def labels_of(text: str | None) -> dict[str, str]:
    """Parsed label text; a set the fast path cannot read goes to the reference parser."""
    if not text:
        return {}
    try:
        return _labels(text)  # called once per new series: caching would only cost memory
    except _Fallback:
        samples = _reference(f"x{{{text}}} 0\n", False)
        return dict(samples[0][1])


def parse_exposition(text: str, *, drop_created: bool = True, oldest_s: float | None = None,
                     order: SampleOrder | None = None) -> tuple[list[Sample], collections.Counter]:
    """Samples of a text exposition as ``(name, labels, value)`` (labels dicts may be shared:
    read them, do not mutate them), plus a Counter of non-fatal problems (``stale_timestamp``:
    samples older than ``oldest_s`` by their own timestamp, left out as ``parse_raw`` does).
    ``_created`` samples (creation timestamps that prometheus_client exports as separate gauges)
    are dropped by default: they double the series count and no evaluator reads them. ``order`` as
    in ``parse_raw``."""
    problems: collections.Counter = collections.Counter()
    try:
        samples = _fast(text, drop_created, oldest_s, problems, order)
    except _Fallback:
        problems.clear()
        samples = _reference(text, drop_created, oldest_s, problems, order)
    return samples, problems
