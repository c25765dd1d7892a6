"""The embedded time-series store: numpy ring buffers, bounded in time, samples and series.

Layout (why it looks like this): every sample of one scrape of one target shares the scrape's
timestamp, so timestamps are kept once per *group* (one target, or one simulated engine) in a
ring of ``slots`` per group, and values once per *sample name* in a 2-D matrix
``rows (series) x slots``. A window query over thousands of engines is then a handful of
vectorised numpy operations on one matrix instead of a Python loop per series, which is what
keeps a 1,000-engine evaluation tick under 100 ms. NaN in a cell means "no sample".

Bounds: ``slots`` samples per series (the ring), ``retention_s`` (older samples are invisible
and their series are collected), ``max_series`` in total and per group, ``max_labels`` per
series; what breaks a bound is dropped and counted in ``IngestResult.errors`` (never raised).

Producers call ``ingest_text`` (an exposition, as scraped) or ``append`` (one sample, e.g. the
simulator's offline replay at simulated time). Consumers use the ``MetricsView`` methods
(``instant``, ``increase``, ``range``, ``histogram_quantile``), which give what PromQL gives on
the same samples (see sla_guard/promql.py).
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from sla_guard import promql
from sla_guard.exposition import (
    ExpositionError,
    SampleOrder,
    labels_of,
    parse_exposition,
    parse_raw,
    split_series_text,
)
from sla_guard.model import Labels, Series

# Label names that identify a group when ``append`` is called without one.
_GROUP_LABELS = ("instance", "model", "pool", "engine")


class _TextIndex:
    """One group's scrape cache: hash(series text) -> family id << 32 | row. Two sorted int64
    arrays (16 bytes a series; a dict of Python ints costs ~100, i.e. ~25 MiB at 1,000 engines)
    plus a dict of recent additions merged in at the end of each scrape. Page lookups are
    batched (``hits``); single lookups (``get``) happen only for new or changed pages."""

    __slots__ = ("keys", "recent", "vals")

    def __init__(self) -> None:
        self.keys = np.empty(0, np.int64)
        self.vals = np.empty(0, np.int64)  # -1: removed
        self.recent: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.keys) + len(self.recent)

    def _find(self, h: int) -> int:
        i = int(np.searchsorted(self.keys, h))
        return i if i < len(self.keys) and self.keys[i] == h and self.vals[i] >= 0 else -1

    def get(self, h: int) -> int | None:
        v = self.recent.get(h)
        if v is not None:
            return v
        i = self._find(h)
        return int(self.vals[i]) if i >= 0 else None

    def __setitem__(self, h: int, packed: int) -> None:
        self.recent[h] = packed

    def pop(self, h: int) -> None:
        if self.recent.pop(h, None) is None and (i := self._find(h)) >= 0:
            self.vals[i] = -1

    def clear(self) -> None:
        self.__init__()

    def hits(self, hashes: np.ndarray) -> np.ndarray:
        n = len(self.keys)
        if n:
            idx = np.minimum(np.searchsorted(self.keys, hashes), n - 1)
            out = (self.keys[idx] == hashes) & (self.vals[idx] >= 0)
        else:
            out = np.zeros(len(hashes), bool)
        if self.recent:
            out |= np.fromiter((h in self.recent for h in hashes.tolist()), bool, len(hashes))
        return out

    def merge(self) -> None:
        """Fold recent additions into the sorted arrays and drop removed entries."""
        live = self.vals >= 0
        keys = np.concatenate([self.keys[live], np.fromiter(self.recent, np.int64, len(self.recent))])
        vals = np.concatenate([self.vals[live], np.fromiter(self.recent.values(), np.int64, len(self.recent))])
        order = np.argsort(keys, kind="stable")
        self.keys, self.vals, self.recent = keys[order], vals[order], {}


def _stage(writes: dict, nans: list, fam: _Family, row: int, value: float, pos: int, res: IngestResult) -> None:
    """Stage one sample of a scrape for ``_commit_scrape``: grouped by family (one column write
    each) with its position in the page. A NaN cannot be stored (NaN cells mean "no sample"):
    it is remembered instead, so windows containing it give NaN as in PromQL, never a value
    from fewer samples. NaN and +-Inf also name their series in ``res.limited`` (``non_finite``):
    the scraper refuses a page with one in the SLOs' histograms, whose sums then read a finite
    number without that engine (+Inf - +Inf is NaN, which a sum skips) or stay NaN all period
    in the ledger."""
    if value != value:
        res.errors["nan"] += 1
        res.limited.setdefault(fam.name, "non_finite")
        nans.append((fam, row))
        return
    if value == math.inf or value == -math.inf:
        res.limited.setdefault(fam.name, "non_finite")
    w = writes.get(fam.name)
    if w is None:
        w = writes[fam.name] = (fam, [], [], [])
    w[1].append(row)
    w[2].append(value)
    w[3].append(pos)


@dataclass(slots=True)
class _Layout:
    """A group's page layout for ``_write_same_layout``, in a few flat arrays (per-family
    arrays would cost ~100 bytes of object header each, more than their data): the page's
    series-text hashes in order, then per family (``fids``, run ending at ``ends``) the rows
    written and the page positions they take their values from."""

    hashes: np.ndarray
    fids: np.ndarray
    ends: np.ndarray
    rows: np.ndarray
    pos: np.ndarray
    drops: dict[str, int]
    limited: dict[str, str]

    @classmethod
    def of(cls, hashes: np.ndarray, runs: list[tuple[int, list[int], list[int]]], drops: dict[str, int],
           limited: dict[str, str]) -> _Layout:
        return cls(hashes, np.array([f for f, _, _ in runs], np.int32),
                   np.cumsum([len(r) for _, r, _ in runs]).astype(np.int32),
                   np.concatenate([np.asarray(r, np.int32) for _, r, _ in runs]),
                   np.concatenate([np.asarray(p, np.int32) for _, _, p in runs]), drops, limited)


@dataclass(slots=True)
class IngestResult:
    """What one ingest stored and what it dropped, by error kind (``parse``, ``nan``,
    ``duplicate``, ``series_limit``, ``label_limit``, ``out_of_order``)."""

    samples: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)
    # names of the series a limit refused, or with a NaN / +-Inf value (``non_finite``) -> the
    # kind: the scraper fails a scrape that lost series the SLOs read, or carried such a value in
    # them, rather than judge a pool without them or on a broken count
    limited: dict[str, str] = field(default_factory=dict)
    # why the page did not parse (the line and what is wrong with it), for the scrape's error
    parse_error: str = ""

    def add(self, other: IngestResult) -> None:
        self.samples += other.samples
        self.errors.update(other.errors)
        for name, kind in other.limited.items():
            self.limited.setdefault(name, kind)


class _Family:
    """All series of one sample name: values[row, slot], the group of each row, label codes."""

    __slots__ = ("codes", "cut_t", "fid", "free", "gone_t", "group", "has_text", "last_k", "marked", "n", "name",
                 "nan_t", "qcache", "text_hash", "values", "version")

    def __init__(self, name: str, slots: int, fid: int, rows: int = 16, dtype=np.float64) -> None:
        self.name = name
        self.fid = fid
        self.values = np.full((rows, slots), np.nan, dtype=dtype)
        self.group = np.full(rows, -1, dtype=np.int32)
        self.last_k = np.zeros(rows, dtype=np.int64)  # group slot counter at last write
        self.nan_t = np.full(rows, -np.inf)  # time of the row's latest NaN sample
        # histogram buckets whose bucket set changed (``SeriesStore._bucket_changes``): samples
        # before ``cut_t`` are not comparable with the child's current buckets; a row missing
        # from its target's scrapes since ``gone_t`` while its siblings go on is a removed bound
        self.cut_t = np.full(rows, -np.inf)
        self.gone_t = np.full(rows, np.inf)
        self.marked = False  # some row has a cut_t or gone_t (queries skip the masks otherwise)
        # hash of the raw series text of rows created from a scrape (their scrape-cache key)
        self.text_hash = np.zeros(rows, dtype=np.int64)
        self.has_text = np.zeros(rows, dtype=bool)
        self.codes: dict[str, np.ndarray] = {}
        self.free: list[int] = []
        self.n = 0  # high-water mark of used rows
        self.version = 0  # bumped when a series is added or freed (invalidates qcache)
        self.qcache: dict = {}  # (matchers, by) -> (version, rows, keys, labels, extra)

    def grow(self) -> None:
        rows, slots = self.values.shape
        new = rows + max(16, rows // 4)  # x1.25: the value matrix is most of the memory
        values = np.full((new, slots), np.nan, dtype=self.values.dtype)
        values[:rows] = self.values
        self.values = values
        more = new - rows
        self.group = np.concatenate([self.group, np.full(more, -1, dtype=np.int32)])
        self.last_k = np.concatenate([self.last_k, np.zeros(more, dtype=np.int64)])
        self.nan_t = np.concatenate([self.nan_t, np.full(more, -np.inf)])
        self.cut_t = np.concatenate([self.cut_t, np.full(more, -np.inf)])
        self.gone_t = np.concatenate([self.gone_t, np.full(more, np.inf)])
        self.text_hash = np.concatenate([self.text_hash, np.zeros(more, dtype=np.int64)])
        self.has_text = np.concatenate([self.has_text, np.zeros(more, dtype=bool)])
        for k, arr in self.codes.items():
            self.codes[k] = np.concatenate([arr, np.zeros(more, dtype=np.int32)])

    def nbytes(self) -> int:
        return (self.values.nbytes + self.group.nbytes + self.last_k.nbytes + self.nan_t.nbytes
                + self.cut_t.nbytes + self.gone_t.nbytes
                + self.text_hash.nbytes + self.has_text.nbytes + sum(a.nbytes for a in self.codes.values()))


class SeriesStore:
    """In-memory store of recent samples; implements ``sla_guard.model.MetricsView``.

    Thread-safe: one lock around writes and reads (the scraper writes from the event loop while
    API handlers may read).
    """

    serves_long_windows = False  # bounded retention: the SLO evaluator keeps long windows in its ledger
    window_label = None
    last_error = None  # nothing between the store and its data to fail

    def __init__(self, *, retention_s: float = 26 * 3600, slots: int = 720, max_series: int = 200_000,
                 max_series_per_group: int | None = None, max_labels: int = 16, max_label_value_len: int = 2048,
                 lookback_s: float = 300.0, coarse_names: Iterable[str] = (), coarse_step_s: float = 60.0,
                 coarse_slots: int = 0, value_dtype=np.float64) -> None:
        """``coarse_*``: a second, downsampled tier for a few low-cardinality names (process
        RSS and the load gauges the leak detector and the advisor read over many hours): one
        sample per group every ``coarse_step_s`` kept in ``coarse_slots``. ``range`` serves
        from it what the main ring no longer holds; the other queries use the main ring. The
        coarse tier stores float32 (7 significant digits: bytes of RSS to ~1e-7, plenty for a
        trend); the main ring float64, so counters stay exact."""
        if slots < 2:
            raise ValueError("slots must be >= 2 (a rate needs two samples)")
        self.retention_s = float(retention_s)
        self.slots = int(slots)
        self.value_dtype = value_dtype
        self.max_series = int(max_series)
        self.max_series_per_group = int(max_series_per_group or max_series)
        self.max_labels = int(max_labels)
        self.max_label_value_len = int(max_label_value_len)
        self.lookback_s = float(lookback_s)
        self._lock = threading.RLock()
        self._families: dict[str, _Family] = {}
        self._index: dict[tuple[str, Labels], tuple[_Family, int]] = {}
        self._vocab: dict[str, int] = {"": 0}
        self._words: list[str] = [""]
        # groups
        self._gid: dict[tuple, int] = {}
        self._gkeys: list[tuple] = []
        cap = 16
        self._gtimes = np.full((cap, self.slots), np.nan)
        self._gstale = np.zeros((cap, self.slots), dtype=bool)
        self._gcount = np.zeros(cap, dtype=np.int64)
        self._glast = np.full(cap, -np.inf)
        self._gkeep = np.full(cap, np.inf)  # retired groups: freed keep_s after their last sample
        self._gfree: list[int] = []  # ids of retired groups with no series left, for reuse
        self._grows: list[dict[str, list[int]]] = []
        # per group scrape cache: hash(series text) -> family id << 32 | row. Hash keys and packed
        # ints keep it ~120 bytes per series (strings and tuples would be ~280); a 64-bit hash
        # collision inside one target is ~n^2/2^64, i.e. never in practice.
        self._gtext: list[_TextIndex] = []
        # per group page layout: when a scrape's series texts (by hash) come in the same order as
        # last time, values are written with one fancy-indexed assignment per family and no
        # per-sample lookups; (text hashes, [(family, rows, positions in the page)])
        self._glayout: list[_Layout | None] = []
        self._flist: list[_Family] = []
        self._gextra: list[tuple] = []
        self._gseries: list[int] = []
        self._gpartial: set[int] = set()  # groups whose last page lacked some of their series
        self._series = 0
        self._newest = -math.inf
        self._writes_since_gc = 0
        self._last_gc_t = -math.inf
        self._vocab_limit = 65_536
        self.coarse_names = frozenset(coarse_names)
        self.coarse_step_s = float(coarse_step_s)
        self._coarse: SeriesStore | None = None
        if self.coarse_names and coarse_slots >= 2:
            self._coarse = SeriesStore(retention_s=retention_s, slots=coarse_slots, max_series=max_series,
                                       max_series_per_group=max_series_per_group, max_labels=max_labels,
                                       max_label_value_len=max_label_value_len, lookback_s=lookback_s,
                                       value_dtype=np.float32)
        self._gcoarse: dict[int, tuple[int, float]] = {}  # group -> (coarse bucket, time forwarded)
        self._orders: dict[tuple, SampleOrder] = {}  # group key -> its exposition timestamps
        self.dropped = collections.Counter()  # lifetime drops by kind

    # ------------------------------------------------------------------ writing
    def ingest_text(self, exposition: str, t: float, extra_labels: Mapping[str, str] | None = None, *,
                    group: str | None = None, honor_labels: bool = True) -> IngestResult:
        """Parse a text exposition (Prometheus 0.0.4 / OpenMetrics text) and store every sample
        at time ``t``. ``extra_labels`` (e.g. instance, model, pool) are added where the sample
        lacks them. Where the sample has one with another value: with ``honor_labels`` the
        sample's wins (Prometheus's ``honor_labels: true``); without, the target's wins and the
        sample's is kept as ``exported_<name>`` (``honor_labels: false``: an engine cannot speak
        for another target's model or pool). The group defaults to the sorted ``extra_labels``.
        A parse failure stores nothing and is reported as ``errors['parse']``. A sample whose own
        timestamp is older than its series' last one is left out (``out_of_order``, its name in
        ``limited``), as Prometheus drops it."""
        oldest = t - self.lookback_s  # a sample its exporter stamped older than this is no current value
        stale: collections.Counter = collections.Counter()
        order = self._order(group, extra_labels)
        order.dropped.clear()
        try:
            raw = parse_raw(exposition, known=self._known_texts(group, extra_labels, honor_labels),
                            oldest_s=oldest, problems=stale, order=order)
            if raw is not None:
                res = self._ingest_raw(raw, t, extra_labels, group, honor_labels,
                                       created=lambda: _created_times(exposition, extra_labels, honor_labels))
                if stale:
                    res.errors.update(stale)
                    with self._lock:
                        self.dropped.update(stale)
                return _out_of_order(res, order)
            samples, parse_errors = parse_exposition(exposition, oldest_s=oldest, order=order)
        except ExpositionError as err:
            res = IngestResult(parse_error=str(err))
            res.errors["parse"] += 1
            with self._lock:
                self.dropped["parse"] += 1
            return res
        res = self.ingest_samples(samples, t, extra_labels, group=group, honor_labels=honor_labels,
                                  created=lambda: _created_times(exposition, extra_labels, honor_labels))
        res.errors.update(parse_errors)
        with self._lock:
            self.dropped.update(parse_errors)
        return _out_of_order(res, order)

    def _order(self, group: str | None, extra_labels: Mapping[str, str] | None) -> SampleOrder:
        """The group's exposition timestamps (``SampleOrder``), kept while the group is."""
        gkey = (group,) if group is not None else tuple(sorted(dict(extra_labels or {}).items()))
        with self._lock:
            order = self._orders.get(gkey)
            if order is None:
                order = self._orders[gkey] = SampleOrder(self.max_series_per_group)
            return order

    def _known_texts(self, group: str | None, extra_labels: Mapping[str, str] | None,
                     honor_labels: bool) -> _TextIndex | None:
        """The group's scrape cache (series-text hash -> row) if it applies to these target
        labels, for ``parse_raw(known=...)``; None for a new group or changed labels."""
        extra = dict(extra_labels or {})
        gkey = (group,) if group is not None else tuple(sorted(extra.items()))
        gid = self._gid.get(gkey)
        if gid is None or self._gextra[gid] != (*sorted(extra.items()), honor_labels):
            return None
        return self._gtext[gid]

    def _ingest_raw(self, raw, t: float, extra_labels: Mapping[str, str] | None, group: str | None,
                    honor_labels: bool = True, created: _Created | None = None) -> IngestResult:
        """ingest_text's fast path: series found by their raw text in the group's cache."""
        extra = dict(extra_labels or {})
        gkey = (group,) if group is not None else tuple(sorted(extra.items()))
        res = IngestResult()
        t = round(float(t), 3)
        with self._lock:
            gid = self._group(gkey)
            # the cache maps raw series text to a row, so it holds only while the target labels
            # and the way they merge stay the same
            extra_t = (*sorted(extra.items()), honor_labels)
            if self._gextra[gid] != extra_t:
                self._gtext[gid].clear()
                self._glayout[gid] = None
                self._gextra[gid] = extra_t
            hashes = np.fromiter((hash(x[0]) for x in raw), np.int64, len(raw))
            vals = self._layout_values(gid, raw, hashes)
            # a layout covering every series of the group overwrites the whole new slot: no need
            # to blank it first (the blanking costs one assignment per family)
            whole = vals is not None and len(self._glayout[gid].rows) == self._gseries[gid]
            gid, slot = self._begin_scrape(gkey, t, res, blank=not whole)
            if slot is None:
                return res
            if vals is not None:
                self._write_same_layout(gid, slot, t, vals, res)
            else:
                self._write_by_lookup(gid, slot, t, raw, hashes, extra, honor_labels, res, created)
            if self._coarse is not None and self._coarse_due(gid, t):
                names = self.coarse_names
                fwd = [(x[0], *split_series_text(x[0]), x[3]) if x[1] is None else x for x in raw]
                fwd = [x for x in fwd if x[1] in names]
                if fwd:
                    self._coarse._ingest_raw(fwd, t, extra, repr(gkey), honor_labels)
        return res

    def _layout_values(self, gid: int, raw, hashes: np.ndarray) -> np.ndarray | None:
        """The page's values when the fast case applies: the page lists the same series in the
        same order as the group's last scrape, whose only drops (if any) depend on the text alone
        (duplicates, label limit) and are counted again; no NaN or +-Inf value. None otherwise."""
        lay = self._glayout[gid]
        if lay is None or len(lay.hashes) != len(hashes) or not np.array_equal(lay.hashes, hashes):
            return None
        vals = np.fromiter((x[3] for x in raw), np.float64, len(raw))
        return vals if np.isfinite(vals).all() else None

    def _write_same_layout(self, gid: int, slot: int, t: float, vals: np.ndarray, res: IngestResult) -> None:
        """Write a page by its group's layout (``_layout_values`` said it applies)."""
        lay = self._glayout[gid]
        k = self._gcount[gid]
        flist = self._flist
        ends = lay.ends.tolist()
        page = vals[lay.pos]  # one gather, in family order
        all_rows = lay.rows
        for fid, a, b in zip(lay.fids.tolist(), [0, *ends[:-1]], ends, strict=True):
            fam = flist[fid]
            if b - a == 1:  # most families have one series per target: scalar writes are 3x cheaper
                row = int(all_rows[a])
                fam.values[row, slot] = page[a]
                fam.last_k[row] = k
            else:
                rows = all_rows[a:b]
                fam.values[rows, slot] = page[a:b]
                fam.last_k[rows] = k
        res.samples += len(lay.rows)
        res.errors.update(lay.drops)
        res.limited.update(lay.limited)
        self.dropped.update(lay.drops)
        self._after_write(t)

    def _write_by_lookup(self, gid: int, slot: int, t: float, raw, hashes: np.ndarray, extra: dict,
                         honor_labels: bool, res: IngestResult, created: _Created | None = None) -> None:
        """Each sample found through the scrape cache (or created); remembers the page layout
        for ``_write_same_layout`` when every sample landed."""
        cache = self._gtext[gid]
        writes: dict[str, tuple[_Family, list[int], list[float], list[int]]] = {}
        seen: set[int] = set()
        nans: list[tuple[_Family, int]] = []
        born: list[tuple[_Family, int]] = []
        flist = self._flist
        volatile = False
        on_page = 0  # series of this page stored so far: what the per-target limit counts
        for i, (text, name, ltext, value) in enumerate(raw):
            h = int(hashes[i])
            if h in seen:
                res.errors["duplicate"] += 1
                continue
            seen.add(h)
            packed = cache.get(h)
            if packed is not None:
                loc = (flist[packed >> 32], packed & 0xFFFFFFFF)
            else:
                if name is None:  # parsed as known, evicted since
                    name, ltext = split_series_text(text)
                labels = labels_of(ltext)
                key = _series_key(name, labels, extra, honor_labels)
                loc = self._index.get(key)
                if loc is None:
                    loc = self._new_series(key, gid, res, text_hash=h, on_page=on_page)
                    if loc is None:
                        continue
                    born.append(loc)
                    cache[h] = (loc[0].fid << 32) | loc[1]
                elif loc[0].group[loc[1]] != gid:
                    res.errors["duplicate"] += 1  # the same series from another target
                    volatile = True  # depends on the other target, not on this page
                    continue
            on_page += 1
            _stage(writes, nans, *loc, value, i, res)
        self._commit_scrape(gid, slot, t, writes, nans, res)
        self._bucket_changes(gid, t, born, created, sum(len(w[1]) for w in writes.values()) + len(nans))
        self._evict_gone(gid, t, res)
        if cache.recent or (cache.vals < 0).any():
            cache.merge()
        # drops that the text alone decides recur identically; any other (NaN, series limit) may not
        replayable = not volatile and all(k in ("duplicate", "label_limit") for k in res.errors) \
            and "non_finite" not in res.limited.values()
        self._glayout[gid] = _Layout.of(hashes, [(fam.fid, rows, pos) for fam, rows, _, pos in writes.values()],
                                        dict(res.errors), dict(res.limited)) if replayable and writes else None

    def _begin_scrape(self, gkey: tuple, t: float, res: IngestResult, *, blank: bool = True
                      ) -> tuple[int, int | None]:
        """The group of a scrape and the slot its samples go to; None (counted) when ``t`` is
        older than the group's newest scrape. Caller holds the lock. ``blank``: see _open_slot."""
        gid = self._group(gkey)
        slot = self._open_slot(gid, t, stale=False, blank=blank)
        if slot is None:
            res.errors["out_of_order"] += 1
            self.dropped["out_of_order"] += 1
        return gid, slot

    def _commit_scrape(self, gid: int, slot: int, t: float, writes: dict, nans: list, res: IngestResult) -> None:
        """Write one scrape's staged values column-wise (one numpy assignment per family)."""
        k = self._gcount[gid]
        for fam, row in nans:
            fam.nan_t[row] = t
        for fam, rows, vals, _ in writes.values():
            fam.values[rows, slot] = vals
            fam.last_k[rows] = k
            res.samples += len(rows)
        self.dropped.update(res.errors)
        self._after_write(t)

    def ingest_samples(self, samples: Iterable[tuple[str, Mapping[str, str], float]], t: float,
                       extra_labels: Mapping[str, str] | None = None, *, group: str | None = None,
                       honor_labels: bool = True, created: _Created | None = None) -> IngestResult:
        """Store ``(name, labels, value)`` samples of one scrape at time ``t`` (one new slot of
        the group). Samples of a series repeated in the same call are duplicates: the first wins.
        ``extra_labels`` and ``honor_labels`` as in ``ingest_text``; ``created``: the page's
        ``_created`` samples by series key, asked for only when a series appears (see
        ``_bucket_changes``)."""
        extra = dict(extra_labels or {})
        gkey = (group,) if group is not None else tuple(sorted(extra.items()))
        res = IngestResult()
        t = round(float(t), 3)
        with self._lock:
            gid, slot = self._begin_scrape(gkey, t, res)
            if slot is None:
                return res
            writes: dict[str, tuple[_Family, list[int], list[float], list[int]]] = {}
            seen: set[tuple[str, Labels]] = set()
            nans: list[tuple[_Family, int]] = []
            born: list[tuple[_Family, int]] = []
            on_page = 0  # series of this page stored so far: what the per-target limit counts
            samples_l = samples if isinstance(samples, list) else list(samples)
            for name, labels, value in samples_l:
                key = _series_key(name, labels, extra, honor_labels)
                if key in seen:
                    res.errors["duplicate"] += 1
                    continue
                seen.add(key)
                loc = self._index.get(key)
                if loc is None:
                    loc = self._new_series(key, gid, res, on_page=on_page)
                    if loc is None:
                        continue
                    born.append(loc)
                on_page += 1
                _stage(writes, nans, *loc, value, 0, res)
            self._commit_scrape(gid, slot, t, writes, nans, res)
            self._bucket_changes(gid, t, born, created, sum(len(w[1]) for w in writes.values()) + len(nans))
            self._evict_gone(gid, t, res)
            if self._coarse is not None and self._coarse_due(gid, t):
                fwd = [x for x in samples_l if x[0] in self.coarse_names]
                if fwd:
                    self._coarse.ingest_samples(fwd, t, extra, group=repr(gkey), honor_labels=honor_labels)
        return res

    def _prev_good(self, gid: int) -> tuple[int, float] | None:
        """(slot, time) of the group's latest successful scrape before the current one, if the
        ring still holds one."""
        n = int(self._gcount[gid])
        for j in range(n - 2, max(n - self.slots, 0) - 1, -1):
            slot = j % self.slots
            if not self._gstale[gid, slot]:
                return slot, float(self._gtimes[gid, slot])
        return None

    def _bucket_changes(self, gid: int, t: float, born: list[tuple[_Family, int]], created: _Created | None,
                        written: int) -> None:
        """After a scrape that did not repeat the last page's layout: series that appeared in a
        target scraped before, and histogram buckets that appeared or vanished (an engine upgraded
        with another bucket set). Prometheus 2.x counts a new series only from its second sample,
        while the old buckets of the same histogram count the interval through their reset, and
        a bucket that vanished keeps its partial count in every window: the threshold bucket then
        holds fewer requests than +Inf and attainment reads far too low (5 % for an upgrade that
        added the 20 ms TPOT bucket, every request under it).

        - A new counter series starts from 0 at the previous scrape when that is known: its
          ``_created`` time is after that scrape (prometheus_client exports it), or an older
          bucket of its histogram dropped (the histogram restarted). Both count the interval.
        - Otherwise (and for the older buckets, whose earlier samples the new bound never saw) the
          child's buckets are compared only from the new one's first sample on: ``cut_t``.
        - A bucket missing from a scrape whose siblings are there is a removed bound: ``gone_t``;
          windows reaching past it leave it out (the bound reads as missing, not as a count).

        Only the bucket series of one histogram child (same labels but ``le``) are compared;
        ``_count`` and ``_sum`` stay exactly PromQL's. ``written``: series this page wrote (a
        page that wrote them all, after one that did too, and made none has nothing to do)."""
        born = [(fam, row) for fam, row in born if fam.name.endswith(_COUNTERS)]
        partial = written < self._gseries[gid]
        was_partial = gid in self._gpartial
        if partial:
            self._gpartial.add(gid)
        elif was_partial:
            self._gpartial.discard(gid)
        if not born and not partial and not was_partial:
            return
        prev = self._prev_good(gid)
        if prev is None:
            return  # the target's first scrape (or none left in the ring): nothing was missed
        pslot, tprev = prev
        k = self._gcount[gid]
        cslot = (k - 1) % self.slots
        new = {}
        for fam, row in born:
            new.setdefault(fam.name, []).append(row)
        times: dict[tuple[str, Labels], float] | None = None
        for name, rows in self._grows[gid].items():
            is_bucket = bool(rows) and name.endswith("_bucket")
            if not is_bucket and name not in new:
                continue
            fam = self._families[name]
            if is_bucket:
                arr = np.asarray(rows)
                now = (fam.last_k[arr] == k) | (fam.nan_t[arr] == t)
                before = ~np.isnan(fam.values[arr, pslot]) | (fam.nan_t[arr] == tprev)
                fam.gone_t[arr[now]] = np.inf  # a bound back: compared from now on (below)
                appeared = arr[now & ~before]
                for row in arr[before & ~now & np.isinf(fam.gone_t[arr])].tolist():
                    child = self._child(fam, arr, row)
                    if (fam.last_k[child] == k).any():  # its siblings are still served
                        fam.gone_t[row] = t
                        fam.marked = True
            else:
                arr = appeared = np.asarray(new[name])
            done: set[int] = set()
            for row in appeared.tolist():
                if row in done:
                    continue
                child = self._child(fam, arr, row) if is_bucket else np.array([row])
                fresh = np.isnan(fam.values[child, pslot]) & (fam.nan_t[child] != tprev)
                old = child[~fresh]
                fresh_rows = child[fresh & ((fam.last_k[child] == k) | (fam.nan_t[child] == t))]
                done.update(fresh_rows.tolist())
                if times is None:
                    times = created() if created is not None else {}
                ct = times.get(_created_key(name, self._row_labels(fam, row)))
                with np.errstate(invalid="ignore"):
                    restarted = bool((fam.values[old, cslot] < fam.values[old, pslot]).any())
                zero = (ct is not None and ct > tprev) or (is_bucket and restarted)
                if zero:
                    fam.values[fresh_rows, pslot] = 0.0
                if is_bucket and len(old):
                    fam.cut_t[child] = np.maximum(fam.cut_t[child], tprev if zero else t)
                    fam.marked = True

    @staticmethod
    def _child(fam: _Family, rows: np.ndarray, row: int) -> np.ndarray:
        """The rows among ``rows`` with the labels of ``row`` but ``le``: one histogram child."""
        m = np.ones(len(rows), dtype=bool)
        for lname, codes in fam.codes.items():
            if lname != "le":
                m &= codes[rows] == codes[row]
        return rows[m]

    def append(self, name: str, labels: Mapping[str, str], t: float, v: float, *, group: str | None = None,
               limited: bool = True) -> bool:
        """Store one sample. Samples of one group at the same ``t`` share a slot; a group's
        time must not go backwards (out-of-order samples are dropped and counted). The group
        defaults to the sample's (instance, model, pool, engine) labels, i.e. one engine.
        ``limited=False`` (the scraper's ``up``, one per target): a full store still takes it, so a
        target whose series no longer fit is seen, down, rather than missing from its pool.
        Returns False if the sample was dropped."""
        gkey = (group,) if group is not None else tuple((k, labels[k]) for k in _GROUP_LABELS if k in labels)
        t = round(float(t), 3)
        with self._lock:
            gid = self._group(gkey)
            slot = self._open_slot(gid, t, stale=False)
            if slot is None:
                self.dropped["out_of_order"] += 1
                return False
            key = (name, tuple(sorted(labels.items())))
            loc = self._index.get(key)
            if loc is None:
                res = IngestResult()
                loc = self._new_series(key, gid, res, limited=limited)
                self.dropped.update(res.errors)
                if loc is None:
                    return False
            fam, row = loc
            if v != v:
                self.dropped["nan"] += 1
                fam.nan_t[row] = t
                return False
            if fam.group[row] != gid:
                self.dropped["duplicate"] += 1  # same series written by two groups
                return False
            if fam.last_k[row] == self._gcount[gid] and not math.isnan(fam.values[row, slot]):
                self.dropped["duplicate"] += 1
                return False
            fam.values[row, slot] = v
            fam.last_k[row] = self._gcount[gid]
            self._after_write(t)
            if self._coarse is not None and name in self.coarse_names and self._coarse_due(gid, t):
                self._coarse.append(name, labels, t, v, group=repr(gkey))
            return True

    def mark_stale(self, group_key: Mapping[str, str] | str, t: float) -> None:
        """Prometheus's staleness marker: the target could not be scraped at ``t``, so none of
        its series has a current value from then on (``instant`` returns nothing for them). At
        the time of the group's last scrape it withdraws that scrape (the scraper judged it
        failed after storing part of it): its samples are removed, not left current."""
        gkey = (group_key,) if isinstance(group_key, str) else tuple(sorted(group_key.items()))
        t = round(float(t), 3)
        with self._lock:
            gid = self._gid.get(gkey)
            if gid is None or self._gcount[gid] == 0:
                return
            cur = (self._gcount[gid] - 1) % self.slots
            if self._gstale[gid, cur]:
                return  # one marker per outage, like Prometheus
            if t == self._glast[gid]:
                for name, rows in self._grows[gid].items():
                    if rows:
                        fam = self._families[name]
                        fam.values[rows, cur] = np.nan
                        nt = fam.nan_t[rows]  # its NaN samples are withdrawn too
                        fam.nan_t[rows] = np.where(nt == t, -np.inf, nt)
                self._gstale[gid, cur] = True
                return
            self._open_slot(gid, t, stale=True)

    def retire(self, group: str, t: float, keep_s: float) -> None:
        """The group's producer is gone (a target removed from discovery): a staleness marker at
        ``t``, as Prometheus writes for a removed target, and its series freed once its last
        sample is ``keep_s`` old, when no window reads them any more. Left to the ring and
        retention (26 h), every pod replaced under a new name held its series that long and a
        churning deployment filled ``max_series``. A group that is written again stays."""
        with self._lock:
            gid = self._gid.get((group,))
            if gid is None:
                return
            self.mark_stale(group, t)
            self._gkeep[gid] = float(keep_s)
        if self._coarse is not None:
            self._coarse.retire(repr((group,)), t, keep_s)

    def _coarse_due(self, gid: int, t: float) -> bool:
        """True if samples of this group at ``t`` go to the coarse tier: the first scrape in
        each coarse step (and further samples stamped with that same time)."""
        b = int(t // self.coarse_step_s)
        last = self._gcoarse.get(gid)
        if last is not None and (last[0] == b and last[1] != t):
            return False
        self._gcoarse[gid] = (b, t)
        return True

    def _group(self, gkey: tuple) -> int:
        gid = self._gid.get(gkey)
        if gid is not None:
            return gid
        if self._gfree:  # a retired group's id: its arrays back to new
            gid = self._gfree.pop()
            self._gid[gkey] = gid
            self._gkeys[gid] = gkey
            self._gtimes[gid] = np.nan
            self._gstale[gid] = False
            self._gcount[gid], self._glast[gid], self._gkeep[gid] = 0, -np.inf, np.inf
            self._grows[gid], self._gtext[gid], self._glayout[gid], self._gextra[gid] = {}, _TextIndex(), None, ()
            self._gcoarse.pop(gid, None)
            self._gpartial.discard(gid)
            return gid
        gid = len(self._gkeys)
        if gid >= len(self._gcount):
            cap = len(self._gcount) * 2
            gt = np.full((cap, self.slots), np.nan)
            gt[:gid] = self._gtimes
            gs = np.zeros((cap, self.slots), dtype=bool)
            gs[:gid] = self._gstale
            self._gtimes, self._gstale = gt, gs
            self._gcount = np.concatenate([self._gcount, np.zeros(cap - gid, dtype=np.int64)])
            self._glast = np.concatenate([self._glast, np.full(cap - gid, -np.inf)])
            self._gkeep = np.concatenate([self._gkeep, np.full(cap - gid, np.inf)])
        self._gid[gkey] = gid
        self._gkeys.append(gkey)
        self._grows.append({})
        self._gtext.append(_TextIndex())
        self._glayout.append(None)
        self._gextra.append(())
        self._gseries.append(0)
        return gid

    def _open_slot(self, gid: int, t: float, *, stale: bool, blank: bool = True) -> int | None:
        """The group's slot for time ``t`` (a new one unless ``t`` repeats the last scrape); a new
        slot is blanked for every row of the group unless the caller (``blank=False``) is about
        to write every one of them."""
        last = self._glast[gid]
        if t == last and not stale:
            slot = (self._gcount[gid] - 1) % self.slots
            if not self._gstale[gid, slot]:
                return int(slot)
        if t <= last:
            return None
        k = int(self._gcount[gid])
        slot = k % self.slots
        self._gtimes[gid, slot] = t
        self._gstale[gid, slot] = stale
        if not stale:
            self._gkeep[gid] = np.inf  # back in discovery: no longer retired
        self._gcount[gid] = k + 1
        self._glast[gid] = t
        if not blank:
            return slot
        for name, rows in self._grows[gid].items():  # a series absent from this scrape has no sample
            if rows:
                self._families[name].values[rows, slot] = np.nan
        return slot

    def _new_series(self, key: tuple[str, Labels], gid: int, res: IngestResult,
                    text_hash: int | None = None, *, limited: bool = True,
                    on_page: int | None = None) -> tuple[_Family, int] | None:
        """A new row. Series from a scrape (``text_hash`` given) are found through their group's scrape
        cache only; others through ``_index``. Keeping one map per series (not both) matters at
        hundreds of thousands of series. ``limited=False``: counted, never refused by the series
        limits (see ``append``). ``on_page``: the series a page being stored has stored so far; the
        per-group limit counts those, not the group's series its pages no longer carry (an engine
        restarted under new labels: its old series counted until the ring let them go, hours, and
        refused the new ones; ``_evict_gone`` bounds those instead)."""
        name, labels = key
        if len(labels) > self.max_labels or any(len(v) > self.max_label_value_len for _, v in labels):
            res.errors["label_limit"] += 1
            res.limited.setdefault(name, "label_limit")
            return None
        held = self._gseries[gid] if on_page is None else on_page
        if limited and (self._series >= self.max_series or held >= self.max_series_per_group):
            res.errors["series_limit"] += 1
            res.limited.setdefault(name, "series_limit")
            return None
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = _Family(name, self.slots, len(self._flist), dtype=self.value_dtype)
            self._flist.append(fam)
        if fam.free:
            row = fam.free.pop()
        else:
            if fam.n >= len(fam.group):
                fam.grow()
            row = fam.n
            fam.n += 1
        fam.group[row] = gid
        fam.has_text[row] = text_hash is not None
        fam.text_hash[row] = text_hash or 0
        fam.values[row, :] = np.nan
        fam.nan_t[row] = -np.inf
        fam.cut_t[row], fam.gone_t[row] = -np.inf, np.inf
        rows_len = len(fam.group)
        for lname, lval in labels:
            code = self._vocab.get(lval)
            if code is None:
                code = self._vocab[lval] = len(self._words)
                self._words.append(lval)
            arr = fam.codes.get(lname)
            if arr is None:
                arr = fam.codes[lname] = np.zeros(rows_len, dtype=np.int32)
            arr[row] = code
        if text_hash is None:
            self._index[key] = (fam, row)
        fam.version += 1
        self._grows[gid].setdefault(name, []).append(row)
        self._gseries[gid] += 1
        self._series += 1
        return fam, row

    def _after_write(self, t: float) -> None:
        if t > self._newest:
            self._newest = t
        self._writes_since_gc += 1
        # a pass costs O(series): run it every few hundred writes, but at most every 10 s of
        # sample time unless writes pile up (a thousand targets write thousands per round)
        if self._writes_since_gc >= 256 and (t - self._last_gc_t >= 10.0 or self._writes_since_gc >= 100_000):
            self._last_gc_t = t
            self.collect_garbage()

    def _evict_gone(self, gid: int, t: float, res: IngestResult) -> None:
        """Keep at most ``max_series_per_group`` of the group's series that its page at ``t`` did
        not carry, freeing those gone longest first. They stay for the windows that span a restart
        under new labels (the ring frees them after ``slots`` scrapes); this bounds a target that
        changes its labels at every scrape to twice its limit after each scrape (its page's series
        plus as many it no longer serves), three times during one (a page of new series on top).
        A page the full store (``max_series``) refused series frees all of them: what the target
        serves now comes before what it served, and its next page fits. Caller holds the lock."""
        limit = 0 if res.errors["series_limit"] and self._series >= self.max_series else self.max_series_per_group
        if self._gseries[gid] <= limit:
            return
        k = self._gcount[gid]
        gone: list[tuple[int, int, int]] = []  # (last write, family id, row)
        for name, rows in self._grows[gid].items():
            if rows:
                fam = self._families[name]
                arr = np.asarray(rows)
                away = (fam.last_k[arr] != k) & (fam.nan_t[arr] != t)
                gone.extend(zip(fam.last_k[arr[away]].tolist(), [fam.fid] * int(away.sum()),
                                arr[away].tolist(), strict=True))
        if len(gone) <= limit:
            return
        gone.sort()
        freed: dict[int, set[int]] = {}
        for _, fid, row in gone[:len(gone) - limit]:
            self._free(self._flist[fid], row, unlist=False)
            freed.setdefault(fid, set()).add(row)
        for fid, rows in freed.items():
            name = self._flist[fid].name
            self._grows[gid][name] = [r for r in self._grows[gid][name] if r not in rows]

    def collect_garbage(self) -> int:
        """Free series with no sample left in their ring or none within retention, and those of a
        group retired ``keep_s`` ago (both tiers); returns how many were freed. Runs by itself
        every few hundred writes; the guard also calls it."""
        freed = 0
        with self._lock:
            self._writes_since_gc = 0
            horizon = self._newest - self.retention_s
            glast = self._glast
            gcount = self._gcount
            for fam in self._families.values():
                n = fam.n
                g = fam.group[:n]
                live = g >= 0
                if not live.any():
                    continue
                gg = np.where(live, g, 0)
                gone = live & ((gcount[gg] - fam.last_k[:n] >= self.slots) | (glast[gg] < horizon)
                               | (glast[gg] + self._gkeep[gg] < self._newest))
                # a row whose last write is older than retention
                tslot = fam.last_k[:n] % self.slots
                tlast = self._gtimes[gg, tslot]
                gone |= live & (tlast < horizon)
                for row in np.flatnonzero(gone):
                    self._free(fam, int(row))
                    freed += 1
            for gid in np.flatnonzero(np.isfinite(self._gkeep[:len(self._gkeys)])).tolist():
                if self._gseries[gid] == 0:  # a retired group with nothing left: its id is reused
                    self._orders.pop(self._gkeys[gid], None)
                    del self._gid[self._gkeys[gid]]
                    self._gkeys[gid] = ()
                    self._gkeep[gid] = np.inf
                    self._gfree.append(gid)
            if len(self._words) > self._vocab_limit:
                self._compact_vocab()
        if self._coarse is not None:
            freed += self._coarse.collect_garbage()
        return freed

    def _compact_vocab(self) -> None:
        """Drop label values no live series uses (label churn must not grow memory forever)."""
        used = np.zeros(len(self._words), dtype=bool)
        used[0] = True
        for fam in self._families.values():
            for arr in fam.codes.values():
                used[arr[:fam.n]] = True
        if used.sum() * 2 > len(self._words):
            self._vocab_limit = 2 * len(self._words)
            return
        remap = (np.cumsum(used) - 1).astype(np.int32)
        self._words = [w for w, u in zip(self._words, used.tolist(), strict=True) if u]
        self._vocab = {w: i for i, w in enumerate(self._words)}
        for fam in self._families.values():
            for k, arr in fam.codes.items():
                fam.codes[k] = remap[arr]
            fam.version += 1
        self._vocab_limit = max(65_536, 2 * len(self._words))

    def _free(self, fam: _Family, row: int, *, unlist: bool = True) -> None:
        """Free one row; ``unlist=False``: the caller takes it out of ``_grows`` (in bulk)."""
        gid = int(fam.group[row])
        if not fam.has_text[row]:
            self._index.pop((fam.name, self._row_labels(fam, row)), None)
        else:
            self._gtext[gid].pop(int(fam.text_hash[row]))
        self._glayout[gid] = None
        fam.group[row] = -1
        fam.has_text[row] = False
        fam.values[row, :] = np.nan
        for arr in fam.codes.values():
            arr[row] = 0
        fam.free.append(row)
        fam.version += 1
        rows = self._grows[gid].get(fam.name)
        if rows is not None and unlist:
            rows.remove(row)
        self._gseries[gid] -= 1
        self._series -= 1

    def scraped_label_values(self, group: str, names: Iterable[str], keys: tuple[str, ...]) -> set[tuple[str, ...]]:
        """The values of labels ``keys`` on the group's series of ``names`` that its latest scrape
        wrote: the pools a page speaking for several (``honor_labels``) carried, so that its scraper
        can mark each of them down when the target fails."""
        out: set[tuple[str, ...]] = set()
        with self._lock:
            gid = self._gid.get((group,))
            if gid is None:
                return out
            k = self._gcount[gid]
            for name in names:
                rows = self._grows[gid].get(name)
                if not rows:
                    continue
                fam = self._families[name]
                arr = np.asarray(rows)
                arr = arr[fam.last_k[arr] == k]
                cols = [fam.codes[key][arr].tolist() if key in fam.codes else [0] * len(arr) for key in keys]
                out.update(tuple(self._words[code] for code in combo) for combo in set(zip(*cols, strict=True)))
        return out

    # ------------------------------------------------------------------ stats
    def series_count(self) -> int:
        return self._series

    def nbytes(self) -> int:
        """Bytes held in numpy arrays (the bulk of the store's memory), both tiers."""
        with self._lock:
            return (sum(f.nbytes() for f in self._families.values()) + self._gtimes.nbytes
                    + self._gstale.nbytes + self._gcount.nbytes + self._glast.nbytes
                    + (self._coarse.nbytes() if self._coarse is not None else 0))

    def names(self) -> list[str]:
        return sorted(n for n, f in self._families.items() if (f.group[:f.n] >= 0).any())

    @property
    def newest(self) -> float:
        """Time of the newest sample stored (or -inf)."""
        return self._newest

    # ------------------------------------------------------------------ reading (MetricsView)
    def _query(self, fam: _Family, matchers: Mapping[str, str], by: tuple[str, ...]) -> list:
        """[rows, keys, labels, extra] for (matchers, by), cached until the family's series change
        (the common case between scrapes), so repeated queries skip matching and grouping."""
        ck = (tuple(sorted(matchers.items())), tuple(by))
        hit = fam.qcache.get(ck)
        if hit is not None and hit[0] == fam.version:
            return hit[1]
        rows = self._rows(fam, matchers)
        keys, labels = self._keys(fam, rows, by)
        entry = [rows, keys, labels, {}]
        if len(fam.qcache) > 256:
            fam.qcache.clear()
        fam.qcache[ck] = (fam.version, entry)
        return entry

    def _rows(self, fam: _Family, matchers: Mapping[str, str]) -> np.ndarray:
        n = fam.n
        mask = fam.group[:n] >= 0
        for lname, lval in matchers.items():
            code = self._vocab.get(lval)
            arr = fam.codes.get(lname)
            if arr is None:
                if lval != "":
                    return np.empty(0, dtype=np.int64)
                continue
            if code is None:
                return np.empty(0, dtype=np.int64)
            mask &= arr[:n] == code
        return np.flatnonzero(mask)

    def _window(self, fam: _Family, rows: np.ndarray, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """(T, V), each (len(rows), K): the samples of each row in [start, end], chronological."""
        start = max(start, self._newest - self.retention_s)
        g = fam.group[rows]
        present = np.zeros(len(self._gkeys), dtype=bool)
        present[g] = True
        ug = np.flatnonzero(present)
        lookup = np.empty(len(self._gkeys), dtype=np.int64)
        lookup[ug] = np.arange(len(ug))
        inv = lookup[g]
        c = self.slots
        count = self._gcount[ug]
        first = np.where(count >= c, count % c, 0)
        ar = np.arange(c)
        order = (first[:, None] + ar[None, :]) % c
        ct = np.take_along_axis(self._gtimes[ug], order, axis=1)
        avail = ar[None, :] < np.minimum(count, c)[:, None]
        inw = avail & (ct >= start) & (ct <= end)
        nin = inw.sum(axis=1)
        kmax = int(nin.max()) if len(nin) else 0
        if kmax == 0:
            return np.empty((len(rows), 0)), np.empty((len(rows), 0))
        lo = np.argmax(inw, axis=1)
        j = lo[:, None] + np.arange(kmax)[None, :]
        ok = np.arange(kmax)[None, :] < nin[:, None]
        j = np.minimum(j, c - 1)
        slots = np.take_along_axis(order, j, axis=1)
        times = np.where(ok, np.take_along_axis(ct, j, axis=1), np.nan)
        vals = fam.values[rows[:, None], slots[inv]]
        # cells past a group's last in-window sample repeat a slot: their time is NaN, and
        # every consumer treats a NaN time as no sample
        return times[inv], vals

    def _row_labels(self, fam: _Family, row: int) -> Labels:
        return self._rows_labels(fam, np.array([row]))[0]

    def _rows_labels(self, fam: _Family, rows: np.ndarray) -> list[Labels]:
        """Labels of rows, rebuilt from the label codes (kept once per series, as int32)."""
        words = self._words
        cols = [(k, a[rows]) for k, a in sorted(fam.codes.items())]
        out = []
        for i in range(len(rows)):
            out.append(tuple((k, words[int(col[i])]) for k, col in cols if col[i] != 0))
        return out

    @staticmethod
    def _comparable(fam: _Family, rows: np.ndarray, tt: np.ndarray, vv: np.ndarray, start: float,
                    end: float) -> tuple[np.ndarray, float | np.ndarray]:
        """``vv`` without the bucket samples a window [start, end] must not compare (see
        ``_bucket_changes``): those before a child's ``cut_t``, and every sample of a bound
        removed (``gone_t``) by then; and the start of each row's window (the cut, where later:
        ``increase`` extrapolates no row of the child back over it, so its buckets stay alike)."""
        if not fam.marked:
            return vv, start
        cut = fam.cut_t[rows]
        gone = fam.gone_t[rows] <= end
        cut = np.where((cut <= end) & (cut > start), cut, -np.inf)
        if not gone.any() and not np.isfinite(cut).any():
            return vv, start
        with np.errstate(invalid="ignore"):
            drop = (tt < cut[:, None]) | gone[:, None]
        return np.where(drop, np.nan, vv), np.maximum(cut, start)

    @staticmethod
    def _poisoned(fam: _Family, rows: np.ndarray, start: float, end: float) -> np.ndarray:
        nt = fam.nan_t[rows]
        return (nt >= start) & (nt <= end)

    def _keys(self, fam: _Family, rows: np.ndarray, by: tuple[str, ...]) -> tuple[np.ndarray, list[Labels]]:
        """Group index per row for ``sum by (by)``, and the Labels of each group."""
        if not by:
            return np.zeros(len(rows), dtype=np.int64), [()]
        cols = [fam.codes[b][rows] if b in fam.codes else np.zeros(len(rows), dtype=np.int32) for b in by]
        mat = np.stack(cols, axis=1)
        uniq, inv = np.unique(mat, axis=0, return_inverse=True)
        labels = [tuple(sorted((b, self._words[int(cv)]) for b, cv in zip(by, u, strict=True) if cv != 0))
                  for u in uniq]
        return inv.reshape(-1), labels

    def instant(self, metric: str, matchers: Mapping[str, str], at: float) -> dict[Labels, float]:
        """Value of each series in its group's latest scrape at or before ``at`` (within the
        lookback); a series missing from that scrape, or behind a staleness marker, has none."""
        with self._lock:
            fam = self._families.get(metric)
            if fam is None:
                return {}
            rows = self._rows(fam, matchers)
            if not len(rows):
                return {}
            g = fam.group[rows]
            ug, inv = np.unique(g, return_inverse=True)
            gt = self._gtimes[ug]
            ok = (gt <= at) & (gt >= at - self.lookback_s)
            ts = np.where(ok, gt, -np.inf)
            slot = np.argmax(ts, axis=1)
            has = np.isfinite(ts[np.arange(len(ug)), slot]) & ~self._gstale[ug, slot]
            vals = fam.values[rows, slot[inv]]
            keep = has[inv] & ~np.isnan(vals)
            kept = rows[keep]
            return dict(zip(self._rows_labels(fam, kept), vals[keep].tolist(), strict=True))

    def range(self, metric: str, matchers: Mapping[str, str], start: float, end: float,
              where: Callable[[Labels], bool] | None = None) -> list[Series]:
        """Raw samples of each matching series in [start, end] (closed, like a range selector).
        ``where``: only the series whose labels it accepts are read (the same samples, in the same
        order, as the full answer holds for them): the leak detector reads the 12 h of only the
        processes due for a check, not of all of them at every tick."""
        with self._lock:
            fam = self._families.get(metric)
            rows = self._rows(fam, matchers) if fam is not None else np.empty(0, dtype=np.int64)
            labels = self._rows_labels(fam, rows) if len(rows) else []
            if where is not None and len(rows):
                keep = [i for i, lab in enumerate(labels) if where(lab)]
                rows, labels = rows[keep], [labels[i] for i in keep]
            tt, vv = self._window(fam, rows, start, end) if len(rows) else (None, None)
            out = []
            for i in range(len(rows)):
                m = ~np.isnan(vv[i]) & ~np.isnan(tt[i])
                if m.any():
                    out.append(Series(labels[i], tt[i][m].copy(), vv[i][m].astype(np.float64)))
        if self._coarse is None or metric not in self.coarse_names:
            return out
        return _merge_tiers(self._coarse.range(metric, matchers, start, end, where), out)

    def last_times(self, metric: str, matchers: Mapping[str, str], start: float, end: float) -> dict[Labels, float]:
        """{labels: time of its last sample in [start, end]} of each matching series with one, in
        the order of ``range``: ``s.t[-1]`` of each series ``range`` answers, without copying
        their samples (at a thousand processes' 12 h of RSS ~40 ms a tick, when the leak detector
        needs only the last time of most of them to see that they are not due)."""
        with self._lock:
            fam = self._families.get(metric)
            rows = self._rows(fam, matchers) if fam is not None else np.empty(0, dtype=np.int64)
            out: dict[Labels, float] = {}
            if len(rows):
                lo = max(start, self._newest - self.retention_s)  # as ``_window``
                # each group's last scrape in the window, and each row's value there: most rows have one
                g = fam.group[rows]
                ug, inv = np.unique(g, return_inverse=True)
                gt = self._gtimes[ug]
                gt = np.where((gt >= lo) & (gt <= end), gt, -np.inf)
                slot = gt.argmax(axis=1)
                last = gt[np.arange(len(ug)), slot][inv]
                miss = np.flatnonzero(np.isnan(fam.values[rows, slot[inv]]) & np.isfinite(last))
                if len(miss):  # no value in that scrape (absent, NaN): the row's last one before it
                    tt = self._gtimes[g[miss]]
                    ok = (tt >= lo) & (tt <= end) & ~np.isnan(fam.values[rows[miss]])
                    last[miss] = np.where(ok, tt, -np.inf).max(axis=1)
                has = np.flatnonzero(np.isfinite(last))
                out = dict(zip(self._rows_labels(fam, rows[has]), last[has].tolist(), strict=True))
        if self._coarse is None or metric not in self.coarse_names:
            return out
        merged = {lab: out.pop(lab, t) for lab, t in self._coarse.last_times(metric, matchers, start, end).items()}
        merged.update(out)  # as ``_merge_tiers``: coarse series first, then those only in the main ring
        return merged

    def increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                 by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``sum by (by) (increase(metric{matchers}[window]))`` evaluated at ``at``."""
        return self._sum_rate(metric, matchers, window_s, at, by, is_rate=False)

    def rate(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
             by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``sum by (by) (rate(metric{matchers}[window]))``."""
        return self._sum_rate(metric, matchers, window_s, at, by, is_rate=True)

    def _sum_rate(self, metric, matchers, window_s, at, by, *, is_rate: bool) -> dict[Labels, float]:
        with self._lock:
            fam = self._families.get(metric)
            if fam is None:
                return {}
            rows, keys, labels, _ = self._query(fam, matchers, by)
            if not len(rows):
                return {}
            tt, vv = self._window(fam, rows, at - window_s, at)
            if tt.shape[1] < 2:
                return {}
            vv, starts = self._comparable(fam, rows, tt, vv, at - window_s, at)
            inc = promql.extrapolated_rate_matrix(tt, vv, starts, at, is_counter=True, is_rate=is_rate)
            poisoned = self._poisoned(fam, rows, at - window_s, at)
        return _group_sum(inc, keys, labels, poisoned)

    def counter_delta(self, metric: str, matchers: Mapping[str, str], t0: float, t1: float,
                      by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """Summed reset-aware growth between the last samples at or before t0 and t1, without
        extrapolation: consecutive intervals add up exactly (feeds request-weighted ledgers).
        A series with no sample within the lookback before t0 (its target was down or unreachable
        for longer) starts from its last sample within retention, as ``increase`` over a window
        spanning the gap would: the requests served while it could not be scraped are counted
        when it comes back, not lost."""
        with self._lock:
            fam = self._families.get(metric)
            if fam is None:
                return {}
            rows, keys, labels, _ = self._query(fam, matchers, by)
            if not len(rows):
                return {}
            tt, vv = self._window(fam, rows, t0 - self.lookback_s, t1)
            if tt.shape[1] == 0:
                return {}
            vv, _ = self._comparable(fam, rows, tt, vv, t0 - self.lookback_s, t1)
            d = promql.counter_delta(tt, vv, t0, t1)
            with np.errstate(invalid="ignore"):
                present = ~np.isnan(vv) & ~np.isnan(tt)
                gap = ~(present & (tt <= t0)).any(axis=1) & (present & (tt <= t1)).any(axis=1)
            if gap.any():  # rare (a target back after an outage, or a new series): look further back
                tg, vg = self._window(fam, rows[gap], t0 - self.retention_s, t1)
                vg, _ = self._comparable(fam, rows[gap], tg, vg, t0 - self.retention_s, t1)
                d[gap] = promql.counter_delta(tg, vg, t0, t1)
            poisoned = self._poisoned(fam, rows, t0, t1)
        return _group_sum(d, keys, labels, poisoned)

    def bucket_increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                        by: tuple[str, ...] = (), les: tuple[float, ...] = ()) -> dict[Labels, dict[float, float]]:
        """``sum by (le, by) (increase(metric_bucket[window]))`` as {group: {le: count}} (every bound:
        ``les`` is a hint for views that pay per bucket read). A group with a NaN sample in the
        window gets +Inf counts (quantiles become meaningless)."""
        name = promql.bucket_series(metric)
        with self._lock:
            fam = self._families.get(name)
            if fam is None or "le" not in fam.codes:
                return {}
            rows, keys, labels, extra = self._query(fam, matchers, by)
            if not len(rows):
                return {}
            tt, vv = self._window(fam, rows, at - window_s, at)
            if tt.shape[1] < 2:
                return {}
            vv, starts = self._comparable(fam, rows, tt, vv, at - window_s, at)
            inc = promql.extrapolated_rate_matrix(tt, vv, starts, at, is_counter=True)
            inc[self._poisoned(fam, rows, at - window_s, at)] = np.inf
            if "le" not in extra:
                codes = fam.codes["le"][rows]
                uniq, le_idx = np.unique(codes, return_inverse=True)
                le_values = np.array([_le(self._words[int(u)]) if u != 0 else np.nan for u in uniq], dtype=float)
                extra["le"] = (le_idx.reshape(-1), le_values)
            le_idx, le_values = extra["le"]
        ok = ~np.isnan(inc) & ~np.isnan(le_values[le_idx])
        nl = len(le_values)
        combo = keys[ok] * nl + le_idx[ok]
        sums = np.bincount(combo, weights=inc[ok], minlength=len(labels) * nl)
        present = np.bincount(combo, minlength=len(labels) * nl) > 0
        out: dict[Labels, dict[float, float]] = {}
        for i in np.flatnonzero(present):
            g, li = divmod(int(i), nl)
            out.setdefault(labels[g], {})[float(le_values[li])] = float(sums[i])
        return out

    def histogram_quantile(self, q: float, metric: str, matchers: Mapping[str, str], window_s: float,
                           at: float, by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``histogram_quantile(q, sum by (le, by) (rate(metric_bucket[window])))``; ``metric`` is
        the histogram's name with or without ``_bucket``. Groups whose quantile is NaN (no
        observations) are left out, as Prometheus returns NaN there and we return absence."""
        return promql.group_quantiles(q, self.bucket_increase(metric, matchers, window_s, at, by))


def _series_key(name: str, labels: Mapping[str, str], extra: Mapping[str, str],
                honor: bool = True) -> tuple[str, Labels]:
    """Identity of a series: the sample's labels merged with the target's (``extra``). With
    ``honor`` the sample's own win (Prometheus's ``honor_labels: true``); without, the target's
    win and a sample value that differs is kept as ``exported_<name>`` (``exported_`` repeated
    while that name is taken), as Prometheus does with ``honor_labels: false``. Unlike
    Prometheus, an equal or empty value is not renamed: a page that agrees with its target
    config keeps the very same series. Runs only when a series is first seen (the scrape cache
    maps raw text to rows), so its cost is off the per-sample path."""
    if not extra:
        return name, tuple(sorted(labels.items()))
    if honor:
        merged = dict(extra)
        merged.update(labels)
        return name, tuple(sorted(merged.items()))
    merged = dict(labels)
    for k, v in extra.items():
        own = merged.get(k)
        if own and own != v:
            exported = "exported_" + k
            while exported in merged or exported in extra:
                exported = "exported_" + exported
            merged[exported] = own
        merged[k] = v
    return name, tuple(sorted(merged.items()))


def _merge_tiers(coarse: list[Series], fine: list[Series]) -> list[Series]:
    """Coarse samples older than a series' first fine sample, then its fine samples."""
    by = {s.labels: s for s in fine}
    out = []
    for cs in coarse:
        fs = by.pop(cs.labels, None)
        if fs is None:
            out.append(cs)
            continue
        keep = cs.t < fs.t[0]
        out.append(Series(fs.labels, np.concatenate([cs.t[keep], fs.t]), np.concatenate([cs.v[keep], fs.v])))
    out.extend(by.values())
    return out


def _group_sum(x: np.ndarray, keys: np.ndarray, labels: list[Labels], poisoned: np.ndarray) -> dict[Labels, float]:
    """sum by group, skipping rows without a result (fewer than two samples) but giving NaN to
    a group with a row whose window held a NaN sample (PromQL: NaN propagates through sum)."""
    ok = ~np.isnan(x) | poisoned
    if not ok.any():
        return {}
    vals = np.where(poisoned, np.nan, x)
    sums = np.bincount(keys[ok], weights=vals[ok], minlength=len(labels))
    present = np.bincount(keys[ok], minlength=len(labels)) > 0
    return {labels[i]: float(sums[i]) for i in np.flatnonzero(present)}


def _le(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


_COUNTERS = ("_bucket", "_count", "_sum", "_total")
_Created = Callable[[], dict[tuple[str, Labels], float]]


def _created_key(name: str, labels: Labels) -> tuple[str, Labels]:
    """The key of the ``_created`` sample prometheus_client exports for a counter or histogram
    series (``x_total`` / ``x_bucket{le}`` -> ``x_created``)."""
    for suffix in _COUNTERS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name + "_created", tuple(kv for kv in labels if kv[0] != "le")


def _created_times(text: str, extra: Mapping[str, str] | None, honor: bool) -> dict[tuple[str, Labels], float]:
    """The page's ``_created`` samples by series key (the parser drops them on the hot path;
    read again only when a series appeared)."""
    try:
        samples, _ = parse_exposition(text, drop_created=False)
    except ExpositionError:
        return {}
    extra = dict(extra or {})
    return {_series_key(n, lab, extra, honor): v for n, lab, v in samples if n.endswith("_created")}


def _out_of_order(res: IngestResult, order: SampleOrder) -> IngestResult:
    """``res`` with the names of the samples ``order`` left out as out of order (``limited``)."""
    for name in order.dropped:
        res.limited.setdefault(name, "out_of_order")
    order.dropped.clear()
    return res
