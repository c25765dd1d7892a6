"""The pydantic base of every YAML-facing model: the guard's config, the detectors' and the
advisor's sections, the simulator's profiles. One definition, so the rules cannot drift apart:
the base model (``Strict``), the YAML reader (``load_yaml``) and the wording of a type error
(``error_message``)."""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown keys are errors (a mistyped key in YAML must not be silently ignored), a validated
    model is frozen (what was checked is what runs), and values are not coerced across types
    (``strict``): ``interval_s: true`` is not 1.0, ``"5"`` is not 5, ``max_replicas: 4.5`` is not
    4, ``enabled: 1`` is not true. An int is still a float (``interval_s: 5``). Fields whose YAML
    form is a string by nature (a ``Path``, an enum) relax this with ``Field(strict=False)``.
    Numbers are finite (``allow_inf_nan=False``): ``.inf`` / ``.nan`` are YAML floats, and no
    setting means anything with them (``advisor.interval_s: .inf`` never ran the advisor,
    ``arl0_days: .inf`` silenced a detector); the config's own models had this, the detectors',
    the advisor's and the profiles' sections did not."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# --- YAML ----------------------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one, so
    ``staleness_s: 60`` followed further down by ``staleness_s: 1`` ran the second without a word),
    and reads YAML 1.2 floats that PyYAML's YAML 1.1 rules leave as strings: ``1e-3``,
    ``1.72e12``, ``5E+9`` (1.1 wants a dot and a signed exponent). Since models do not coerce
    strings to numbers, ``bytes: 1.6e9`` must arrive as a number; a quoted ``"1.6e9"`` still
    arrives as a string and is refused. YAML 1.1's other number forms are refused by name:
    ``010`` is octal 8 and ``1:30`` is base 60 (90), so ``max_replicas: 010`` ran with 8 and
    ``window: 1:30`` arrived as 90 without a word."""


def _unique_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # ``<<: *defaults``: merged keys may be overridden by the mapping's own
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):
            continue  # ``? [a, b]``: construct_mapping says "found unhashable key" (``in`` raised TypeError)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark,
                f"key {key!r} is given twice (first on line {seen[key] + 1}); keep one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


def _no_yaml11_number(loader: _Loader, node: yaml.ScalarNode) -> int | float:
    text = str(loader.construct_scalar(node))
    digits = text.replace("_", "").lstrip("+-")
    is_int = node.tag.endswith(":int")
    if ":" in digits:
        meaning, fix = "a base-60 number", "write the plain number in the field's unit"
    elif is_int and len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():
        sign = "-" if text.startswith("-") else ""
        meaning, fix = "an octal number", f"write {sign}{digits.lstrip('0')} without the leading zero"
    else:
        return (yaml.SafeLoader.construct_yaml_int if is_int else yaml.SafeLoader.construct_yaml_float)(loader, node)
    raise yaml.constructor.ConstructorError(
        None, None, f"{text} is {meaning} in YAML 1.1 (read as {yaml.safe_load(text)}): {fix}, or quote it if it "
        "is text", node.start_mark)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
_Loader.add_constructor("tag:yaml.org,2002:int", _no_yaml11_number)
_Loader.add_constructor("tag:yaml.org,2002:float", _no_yaml11_number)
# (add_implicit_resolver copies SafeLoader's table into _Loader first: yaml.safe_load is unchanged)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
                              list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys and reads ``1e-3`` as a number (config
    files, targets files, simulator profiles)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


# --- error messages ------------------------------------------------------------------------------

_EXPECTED = {"float_type": "a number (e.g. 5 or 0.25)", "int_type": "a whole number (e.g. 5)",
             "bool_type": "true or false"}


def error_message(e: Mapping[str, Any]) -> str:
    """The message for one pydantic error (an item of ``ValidationError.errors()``): pydantic's,
    except that a value of the wrong type (strict mode: ``interval_s: true``, ``"5"``) says what
    the field expects, what kind of value it got and how to write it."""
    value = e.get("input")
    if e["type"] == "string_type" and isinstance(value, bool | int | float):
        # `model: on` arrives as True, `name: 1e5` as 100000.0: what was written is text to the user
        what = "a boolean" if isinstance(value, bool) else "a number"
        return (f"expected a string, not {what} (YAML reads unquoted yes/no/on/off as booleans and 1e5, 0x10 as "
                "numbers: quote text that looks like one)")
    if e["type"] in ("literal_error", "enum") and isinstance(value, bool):
        # `mode: on` / `synchronous: off`: YAML made a boolean of a word the field lists
        return f"{e['msg']}; YAML reads unquoted yes/no/on/off as booleans: write the word in quotes"
    expected = _EXPECTED.get(e["type"])
    if expected is None:
        return e["msg"]
    if isinstance(value, bool):
        return f"expected {expected}, not a boolean"
    if isinstance(value, str):
        quoted = value.strip().lower() in ("true", "false") if e["type"] == "bool_type" else _is_number(value)
        return f"expected {expected}, not a string" + (": write it without quotes" if quoted else "")
    if isinstance(value, float) and e["type"] == "int_type":
        return f"expected {expected}, not a decimal number" + (f": write {int(value)}" if value.is_integer() else "")
    if isinstance(value, int | float) and e["type"] == "bool_type":
        return f"expected {expected}, not a number"
    if value is None:
        return f"expected {expected}, not an empty value (null)"
    if isinstance(value, dict | list):
        return f"expected {expected}, not a {'mapping' if isinstance(value, dict) else 'list'}"
    return e["msg"]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def http_url(v: str, example: str) -> str:
    """An http(s) URL with a host and, if any, a numeric port (urlsplit alone accepts 'http:x'). Here, below
    the config and the settings, so every URL field (sources, Alertmanager, the scaling webhook) reads alike."""
    try:
        parts = urlsplit(v)
        _ = parts.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as err:
        raise ValueError(f"not a valid URL ({err}); use e.g. {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in v):
        raise ValueError(f"must be an http:// or https:// URL with a host, e.g. {example}")
    if not re.fullmatch(r"[\w.:%-]+", parts.hostname):  # \w: IDN names too
        # 'http://${HOST}:8000' passed and every scrape failed on DNS: the file is not a shell template
        hint = "; environment variables are not expanded in the config: write the value" if "$" in v else ""
        raise ValueError(f"host {parts.hostname!r} is not a host name or IP address{hint}; use e.g. {example}")
    return v
