"""Keep credentials in URLs out of everything the guard shows: labels, the API, logs.

Target and Prometheus URLs may carry secrets (``http://user:pass@host/metrics``,
``/metrics?token=...``). The guard's ``/metrics`` is unauthenticated and its logs go wherever
the operator ships them, so a URL is only ever *shown* through ``redact_url``: the userinfo
becomes ``***`` and every query value ``***``; scheme, host, port, path and query keys stay, so
the target is still recognisable. ``redact_text`` does the same to every URL inside free text
(httpx's exception messages include the request URL), and ``RedactingFilter`` applies it to log
records, including httpx's own ``HTTP Request: GET <url>`` lines and exception tracebacks.
Text a peer wrote (Prometheus's ``error``, an Alertmanager rejection) is shown through
``peer_text``: cut short, control characters escaped.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"

# scheme://rest-of-url up to whitespace, a quote or an angle bracket (how URLs end in messages)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
# userinfo: up to the last '@' before the first '/'; failing that, before the query (a '/' in an
# unencoded password). Over-redacts an odd path with '@' in it rather than leak a password.
_USERINFO = (re.compile(r"[^/]*@"), re.compile(r"[^?]*@"))


def _mask_query(query: str) -> str:
    """Every ``key=value`` pair's value masked; a bare item (``?s3cret``) masked whole."""
    parts = []
    for pair in query.split("&"):
        key, eq, _ = pair.partition("=")
        parts.append(f"{key}={MASK}" if eq else (MASK if pair else pair))
    return "&".join(parts)


def redact_url(url: str) -> str:
    """``url`` without secrets: userinfo -> ``***``, each query value -> ``***``, the fragment
    dropped; scheme, host, port and path kept. Never raises, and leaks nothing from input that
    is not a well-formed URL either (a scheme-less ``user:pw@host``, unencoded ``@ / ? #`` in a
    password): it works on the text, not on what a URL parser accepts. A non-string is ``***``."""
    if not isinstance(url, str):
        return MASK
    if "@" not in url and "?" not in url and "#" not in url:
        return url  # the common case: nothing to hide
    scheme, sep, rest = url.partition("://")
    head = scheme + sep if sep else ""
    if not sep:
        rest = url
    if "@" in rest:
        m = _USERINFO[0].match(rest) or _USERINFO[1].match(rest)
        if m:
            rest = MASK + "@" + rest[m.end():]
    rest = rest.split("#", 1)[0]
    path, q, query = rest.partition("?")
    return head + path + (q + _mask_query(query) if q else "")


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through ``redact_url`` (cheap when there is none)."""
    if not isinstance(text, str):
        text = str(text)
    if "://" not in text:
        return text
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def strip_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """``(url without userinfo, (user, password) or None)``, percent-decoded, for turning
    ``http://user:pw@host`` into explicit Basic auth on a URL that can be shown and logged."""
    from urllib.parse import unquote

    try:
        p = urlsplit(url)
    except ValueError:  # not a URL httpx could use either; it fails there, redacted
        return url, None
    if "@" not in p.netloc:
        return url, None
    userinfo, _, host = p.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit((p.scheme, host, p.path, p.query, p.fragment)), (unquote(user), unquote(password))


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """``record`` with its message and traceback text passed through ``redact_text``."""
    try:
        msg = record.getMessage()
    except Exception:  # a broken %-format: leave it to the handler's own error path
        return record
    clean = redact_text(msg)
    if clean != msg:
        record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redact_text(record.exc_text)
    if record.stack_info:
        record.stack_info = redact_text(record.stack_info)
    return record


class RedactingFilter(logging.Filter):
    """``redact_record`` as a filter, for handlers set up outside ``install_log_redaction``.
    Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        redact_record(record)
        return True


_installed = False


def install_log_redaction(level: int | str | None = None) -> None:
    """Redact URLs in every log record of this process, whichever logger makes it and whichever
    handler (root, uvicorn's own, Python's last-resort stderr) writes it: the record factory
    redacts each record as it is created, so handlers configured later are covered too. Unless
    ``level`` is DEBUG, httpx's per-request INFO line (one per scrape per target: noise) is
    silenced; at DEBUG it stays, redacted. Idempotent."""
    global _installed
    if not _installed:
        _installed = True
        make = logging.getLogRecordFactory()

        def factory(*args, **kwargs) -> logging.LogRecord:
            return redact_record(make(*args, **kwargs))

        logging.setLogRecordFactory(factory)
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not (isinstance(numeric, int) and numeric <= logging.DEBUG):
        logging.getLogger("httpx").setLevel(logging.WARNING)


def peer_text(text: object, limit: int = 300) -> str:
    """What a peer wrote (Prometheus's ``error`` or warning, an Alertmanager's rejection), fit for
    one log line and /v1/targets: at most ``limit`` characters, control characters escaped.
    Verbatim, a newline in it forged log lines, an escape sequence repainted the operator's
    terminal, and a long one was logged whole for every query of every tick."""
    s = str(text)
    cut = s[:limit]
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in cut) + ("..." if len(s) > limit else "")
