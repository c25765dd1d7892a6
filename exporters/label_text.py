"""Label values written as text. The exposition format and PromQL string literals escape the same
three characters (backslash, double quote, newline); a regex matcher also needs RE2's
metacharacters escaped. One definition for the guard's queries and the generated rules."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.utils import floatToGoString

_RE2_META = frozenset("\\.+*?()|[]{}^$")


def string_literal(value: str) -> str:
    """``value`` as a double-quoted PromQL string: a model named ``we"ird`` must not end the
    string (the generated rules failed promtool on it)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def any_of_literal(values: Iterable[str]) -> str:
    """A PromQL string holding an RE2 regex that matches exactly one of ``values``: each value's
    metacharacters escaped, since a ``model!~"qwen2.5"`` also excluded ``qwen2x5`` (its dot
    matches anything) and that model was never alerted on."""
    return string_literal("|".join("".join("\\" + ch if ch in _RE2_META else ch for ch in v)
                                   for v in sorted(set(values))))


def le_spellings(bound: float) -> frozenset[str]:
    """How exporters write a bucket bound as an ``le`` value: prometheus_client "2.0", Go and Rust
    clients (the routers: llm-d, Dynamo) "2". Prometheus 2.x keeps ``le`` as scraped, so a matcher
    on one spelling misses the other's buckets."""
    return frozenset({floatToGoString(float(bound)), f"{bound:g}", repr(float(bound))})
