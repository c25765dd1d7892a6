"""Parse ``SchedulerStats.kv_connector_stats`` (a plain dict) into KV-transfer observations.

vLLM hands the stat logger the connector's ``to_dict()`` payload. NIXL's (``NixlKVConnectorStats``)
is a dict of per-event lists::

    {"transfer_duration": [s, ...], "post_duration": [s, ...], "bytes_transferred": [n, ...],
     "num_descriptors": [n, ...], "num_failed_transfers": [1, ...], "num_failed_notifications": [...],
     "num_failed_handshakes": [...], "num_kv_expired_reqs": [...], "num_notifications_after_expiry": [...]}

one entry per transfer handle (not per request); failure lists hold a 1 per event. Under
MultiConnector the payload is keyed by connector class name first (vLLM 0.32's NixlConnector is
``NixlPullConnector``): ``{"NixlPullConnector": {...}, "HiSparseConnector": {...}}``. MooncakeConnector's
payload has the same lists (no post_duration) plus ``num_failed_recvs`` (a receiver's remote KV load
that failed), counted as a transfer failure. Anything not in NIXL's format (other connectors,
future fields) is ignored: unknown is not an error. A malformed event count
(negative, NaN, inf) is refused and counted in ``bad`` (it would rewind or poison a counter);
malformed durations and sizes are refused where they are observed (FastHistogram).
Pure functions, no vLLM import: the recorded-dict tests run without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

_NIXL_MARKER = "transfer_duration"
_FAILURES = {"num_failed_transfers": "transfer", "num_failed_notifications": "notification",
             "num_failed_handshakes": "handshake", "num_failed_recvs": "transfer"}  # the last: Mooncake's
MAX_NESTING = 3  # MultiConnector nests once; guard against pathological payloads


@dataclass(slots=True)
class KvTransferBatch:
    """KV-transfer observations of one connector over one stats interval."""

    connector: str
    durations: list[float] = field(default_factory=list)
    post_durations: list[float] = field(default_factory=list)
    nbytes: list[float] = field(default_factory=list)
    descriptors: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    expired: int = 0
    late_notifications: int = 0
    bad: int = 0  # refused event counts (reported as hook_errors{kind="bad_increment"})

    @property
    def empty(self) -> bool:
        return not (self.durations or self.post_durations or self.nbytes or self.descriptors
                    or any(self.failures.values()) or self.expired or self.late_notifications or self.bad)


def _numbers(value: Any) -> list[Any]:
    """Numbers as floats; any other entry (a string, None) is kept as it is, so that the recorder's
    histogram refuses and counts it (hook_errors{kind="bad_observation"}) instead of it vanishing."""
    if not isinstance(value, list | tuple):
        return []
    return [float(v) if isinstance(v, int | float) else v for v in value if not isinstance(v, bool)]


_INF = float("inf")


def _count(value: Any) -> tuple[int, int]:
    """(events, refused): event lists hold one entry (normally 1) per event; a bare number is taken
    as a count. Entries that are not finite numbers >= 0 are refused, not summed; that includes a
    string or None in a list (``["1"]`` was a failure that vanished without a count). An absent key
    (None) is no event."""
    if value is None:
        return 0, 0
    values = value if isinstance(value, list | tuple) else (value,)
    n = bad = 0
    for v in values:
        if isinstance(v, bool):
            continue
        if isinstance(v, int | float) and 0 <= v < _INF:
            n += v
        else:
            bad += 1
    return int(n), bad


def _by_kind(counts: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Failure events per contract kind; several payload keys may feed one kind."""
    out = dict.fromkeys(_FAILURES.values(), 0)
    for key, kind in _FAILURES.items():
        out[kind] += counts[key][0]
    return out


def nixl_batch(data: Mapping[str, Any], connector: str = "NixlConnector") -> KvTransferBatch:
    """One NIXL-format payload -> batch."""
    counts = {key: _count(data.get(key)) for key in (*_FAILURES, "num_kv_expired_reqs",
                                                     "num_notifications_after_expiry")}
    return KvTransferBatch(
        connector=connector,
        durations=_numbers(data.get("transfer_duration")),
        post_durations=_numbers(data.get("post_duration")),
        nbytes=_numbers(data.get("bytes_transferred")),
        descriptors=_numbers(data.get("num_descriptors")),
        failures=_by_kind(counts),
        expired=counts["num_kv_expired_reqs"][0],
        late_notifications=counts["num_notifications_after_expiry"][0],
        bad=sum(b for _, b in counts.values()),
    )


def parse_kv_connector_stats(data: Any, connector: str = "", _depth: int = 0) -> Iterator[KvTransferBatch]:
    """Yield a batch for every NIXL-format payload in ``data`` (flat, or nested under
    MultiConnector); other connectors' payloads yield nothing."""
    if not isinstance(data, Mapping) or _depth > MAX_NESTING:
        return
    if _NIXL_MARKER in data:
        batch = nixl_batch(data, connector or "NixlConnector")
        if not batch.empty:
            yield batch
        return
    for name, sub in data.items():
        if isinstance(sub, Mapping):
            yield from parse_kv_connector_stats(sub, str(name), _depth + 1)
