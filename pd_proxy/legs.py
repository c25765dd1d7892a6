"""The two legs of a P/D request, as data: body rewriting, headers, SSE events, error bodies.

Pure functions and one small incremental parser, no I/O, so the protocol details (vLLM's
``kv_transfer_params`` hand-off, OpenAI's streaming format) are testable without servers.

The P/D protocol (vLLM's NixlConnector / ExampleConnector examples): the prefill engine gets the
client's request with one output token, no streaming, and ``kv_transfer_params`` asking it to keep
the KV cache for a remote decode; its answer carries ``kv_transfer_params`` (engine id, block ids,
host, port) that the decode engine needs to pull that KV. The decode engine gets the client's
request unchanged plus those parameters.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
# Client headers passed to both legs: the request id joins the two halves in the engines' logs
# and traces; Authorization is the engines' API key, if they have one.
PASSED_HEADERS = ("authorization",)


def request_id(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id, or a new one (both legs and the response carry it)."""
    return headers.get("x-request-id") or uuid.uuid4().hex


def upstream_headers(headers: Mapping[str, str], rid: str) -> dict[str, bytes]:
    """As bytes, the client's own: the server decoded them as Latin-1, and httpx encodes a str as ASCII
    (an X-Request-Id or Authorization with a byte past 0x7f raised out of the handler, a 500)."""
    out = {"X-Request-Id": rid.encode("latin-1")}
    for name in PASSED_HEADERS:
        if name in headers:
            out[name] = headers[name].encode("latin-1")
    return out


# vLLM reads its request's booleans with pydantic in lax mode; so does the proxy
_LAX_BOOL = TypeAdapter(bool | None)


def vllm_bool(value: Any, name: str = "stream") -> bool:
    """A request boolean (``stream``, ``include_usage``) as the engine will read it, or ValueError
    where the engine would refuse it. vLLM's request model reads ``"false"``, ``"no"`` and ``0`` as
    False; Python's ``bool("false")`` is True, so the proxy waited for a stream the engine never sent."""
    try:
        return bool(_LAX_BOOL.validate_python(value))
    except ValidationError:
        raise ValueError(f"{name} must be a boolean, got {json.dumps(value)[:40]}") from None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, KV kept for a remote decode. ``min_tokens`` goes:
    over the one token, vLLM refuses the request (min_tokens must not exceed max_tokens)."""
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": dict(PREFILL_KV_PARAMS)}
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def wants_usage(body: Mapping[str, Any]) -> bool:
    """Did the client ask for the final usage chunk of a stream? Read as vLLM reads it (``"false"`` is
    no); a value vLLM refuses is no too, and the decode engine answers the client's 400."""
    so = body.get("stream_options")
    if not isinstance(so, Mapping):
        return False
    try:
        return vllm_bool(so.get("include_usage"), "include_usage")
    except ValueError:
        return False


def decode_body(body: dict[str, Any], prefill_answer: Mapping[str, Any], streaming: bool) -> dict[str, Any]:
    """The decode leg: the client's body plus the prefill's ``kv_transfer_params``. A stream also
    asks for the usage chunk, the only place completion_tokens (hence TPOT) is known; the proxy
    drops that chunk again if the client did not ask for it."""
    out = dict(body)
    kv = prefill_answer.get("kv_transfer_params")
    if kv:
        out["kv_transfer_params"] = kv
    else:  # an engine without a KV connector: decode recomputes the prompt, the answer stays right
        out.pop("kv_transfer_params", None)
    if streaming:
        so = body.get("stream_options")
        if so is None or isinstance(so, Mapping):
            out["stream_options"] = {**(so or {}), "include_usage": True}
            if not wants_usage(body):
                # vLLM sends continuous usage only with include_usage: turning that on for TPOT must not
                # also put usage into every chunk of a client that asked continuous_usage_stats alone
                out["stream_options"].pop("continuous_usage_stats", None)
    return out


def error_body(message: str, kind: str, status: int, leg: str | None = None,
               engine: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object, naming the leg and engine when one failed."""
    err: dict[str, Any] = {"message": message, "type": kind, "code": status}
    if leg:
        err["leg"] = leg
    if engine:
        err["engine"] = engine
    return {"error": err}


def sse_error_event(message: str, kind: str, status: int, leg: str, engine: str) -> bytes:
    """A failure after the stream has started (status already sent): vLLM's own in-stream error
    form, ``data: {"error": ...}``, with no ``[DONE]`` after it."""
    return b"data: " + json.dumps(error_body(message, kind, status, leg, engine)).encode() + b"\n\n"


# --- server-sent events ---------------------------------------------------------------------------

# An event longer than this is passed on in pieces, uninspected: an engine answering a stream with a
# body that has no blank line (JSON, HTML) was buffered whole, copied and re-searched on every chunk
# (a 26 MB body: 17 s of the event loop, the client's first byte at the end). vLLM's largest events
# (the first chunk with a long prompt's token ids) are far below it.
MAX_EVENT_BYTES = 4 * 1024 * 1024


class SseSplitter:
    """Cuts a byte stream into whole SSE events (each with its blank-line terminator), so each
    event is inspected and forwarded as one unit however the network split it."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = bytearray()
        self._searched = 0  # bytes of _buf already searched for a terminator: only new bytes are
        self.max_event_bytes = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        start = 0
        while True:
            cut = _event_end(buf, start, max(start, self._searched - 3))  # a terminator is at most 4 bytes
            if cut < 0:
                break
            out.append(bytes(buf[start:cut]))
            start = cut
        del buf[:start]
        self._searched = len(buf)
        if len(buf) > self.max_event_bytes:
            out.append(bytes(buf))
            buf.clear()
            self._searched = 0
        return out

    def flush(self) -> list[bytes]:
        """What is left when the stream ends (an event without its terminator)."""
        rest = bytes(self._buf)
        self._buf.clear()
        self._searched = 0
        return [rest] if rest.strip() else []


def _event_end(buf: bytes | bytearray, start: int, search_from: int) -> int:
    """Index just past the first event terminator at or after ``start`` (none starts before
    ``search_from``), or -1."""
    ends = [(i, len(sep)) for sep in (b"\n\n", b"\r\n\r\n", b"\r\r") if (i := buf.find(sep, search_from)) >= 0]
    if not ends:
        return -1
    i, n = min(ends)
    return i + n


# Text in a chunk cut short: a choice's key followed by a non-empty string (or a tool call). The key must
# follow ``{`` or ``,``: inside a JSON string every quote is escaped, so the prompt's own text cannot match.
_CUT_TEXT = re.compile(rb'[{,]\s*"(?:text|content|reasoning|reasoning_content)"\s*:\s*"[^"]'
                       rb'|[{,]\s*"tool_calls"\s*:\s*\[\s*\{')
_CUT_HEAD_BYTES = 64 * 1024  # vLLM writes a choice's text before its logprobs and token ids


# vLLM's finish_reason for a request the engine itself aborted while its client was still connected: engine
# shutdown (``--shutdown-timeout`` 0 by default), a fault, ``/pause`` in abort mode. The client's answer is cut
# short, yet it comes as any other ending: a 200, that chunk, the usage chunk and ``[DONE]``.
ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Event:
    """What the proxy needs to know of one SSE event."""

    token: bool = False  # carries generated text (the client sees output)
    usage_only: bool = False  # the final usage chunk (no choices)
    completion_tokens: int | None = None
    done: bool = False  # data: [DONE]
    error: bool = False  # an in-stream error object
    choices: tuple[int, ...] = ()  # the indices of the choices that carry text (n > 1, a list of prompts)
    step: bool = False  # carries choices, with text or not: a decode step's output (the EOS step's has no text)
    finished: bool = False  # a choice carries a finish_reason
    ended: tuple[int, ...] = ()  # the indices of the choices that carry a finish_reason
    aborted: bool = False  # a choice finished with "abort": the engine dropped the request
    opaque: bool = False  # data the proxy could not read (an event over MAX_EVENT_BYTES, cut; not JSON)
    fingerprint: Any = None  # the chunk's system_fingerprint (vLLM: on the usage chunk when include_usage is on)


_NOTHING = Event()
_OPAQUE = Event(opaque=True)
_CUT_TOKEN = Event(token=True, step=True, opaque=True)


def inspect_event(raw: bytes) -> Event:
    """Classify one SSE event of an OpenAI completions or chat-completions stream."""
    data = b"".join(line[5:].lstrip() for line in raw.splitlines() if line.startswith(b"data:"))
    if not data:
        return _NOTHING
    if data.strip() == b"[DONE]":
        return Event(done=True)
    try:
        if not data.rstrip().endswith(b"}"):  # not an object: no need to parse up to 4 MiB to learn it
            raise ValueError("not a JSON object")
        obj = json.loads(data)
    except ValueError:
        # the head of an event over MAX_EVENT_BYTES, cut mid-JSON: vLLM's first chunk of an echo with logprobs
        # (the prompt's, recomputed on decode) passes 4 MiB at ~20k prompt tokens; it carries the first token,
        # which was missed (TTFT taken at the next chunk, TPOT 0 s with one more)
        return _CUT_TOKEN if _CUT_TEXT.search(data, 0, _CUT_HEAD_BYTES) else _OPAQUE
    if not isinstance(obj, dict):
        return _NOTHING
    if obj.get("error"):
        return Event(error=True)
    choices = obj.get("choices")
    usage = obj.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int):
        tokens = None
    if not isinstance(choices, list):
        choices = []
    with_text = tuple(_index(ch, i) for i, ch in enumerate(choices) if _has_text(ch))
    ending = [(_index(ch, i), r) for i, ch in enumerate(choices)
              if isinstance(ch, dict) and isinstance(r := ch.get("finish_reason"), str)]
    reasons = {r for _, r in ending}
    return Event(token=bool(with_text), usage_only=tokens is not None and not choices, completion_tokens=tokens,
                 choices=with_text, step=bool(choices), finished=bool(reasons), ended=tuple(i for i, _ in ending),
                 aborted=ABORT in reasons, fingerprint=obj.get("system_fingerprint"))


def with_fingerprint(raw: bytes, fingerprint: Any) -> bytes:
    """A choice's last chunk with the ``system_fingerprint`` vLLM would have put on it. vLLM stamps it on the chunks
    carrying a finish_reason, unless include_usage is on: then only on the usage chunk, which the proxy asked for
    (TPOT) and drops for a client that did not, so that client lost it. The rest of the event is left byte for byte;
    an event of several lines, or that has the field already, is left whole."""
    body = raw.rstrip(b"\r\n")
    if fingerprint is None or not body.startswith(b"data:") or b"\n" in body or b"\r" in body:
        return raw
    try:
        obj = json.loads(body[5:])
    except ValueError:
        return raw
    if not isinstance(obj, dict) or not obj or "system_fingerprint" in obj:
        return raw
    end = body.rindex(b"}")
    field = b',"system_fingerprint":' + json.dumps(fingerprint, ensure_ascii=False).encode()
    return body[:end] + field + body[end:] + raw.removeprefix(body)


def is_json_object(content: bytes) -> bool:
    """Is a whole answer's body a JSON object? vLLM's always are; one cut short (its process died mid-body) is not."""
    try:
        return isinstance(json.loads(content), dict)
    except (ValueError, RecursionError):
        return False


def aborted_answer(content: bytes) -> bool:
    """Does a whole (non-streamed) answer end a choice with ``finish_reason: "abort"``?"""
    if ABORT.encode() not in content:  # most answers: no need to parse them
        return False
    try:
        obj = json.loads(content)
    except (ValueError, RecursionError):
        return False
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return False
    return any(isinstance(ch, dict) and ch.get("finish_reason") == ABORT for ch in choices)


def _index(choice: dict, position: int) -> int:
    """A choice's ``index`` (vLLM: its place among the n choices of each prompt), else its position."""
    i = choice.get("index")
    return i if isinstance(i, int) else position


def _has_text(choice: object) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):  # completions
        return True
    delta = choice.get("delta")  # chat completions
    return isinstance(delta, dict) and bool(
        delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"))
