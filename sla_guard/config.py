"""The guard's one configuration file (YAML), validated with pydantic.

The SLO spec in it is the single source the guard, the alert rules and the dashboards read.
``load_config`` turns any validation failure into a ``ConfigError`` whose message names the
field path, the bad value and what is allowed, one line per problem.

Validation happens in three layers, so that programmatic configs (tests, the simulator, the
benchmarks, ``GuardConfig()``) stay constructible while a file an operator deploys is held to
what ``serve`` / ``check`` actually need:

1. the pydantic models: one field at a time (types, finite numbers, positive durations, URLs,
   ``api.listen`` as HOST:PORT);
2. ``config_problems`` (every ``parse_config``): rules across fields that are wrong in any use
   (duplicate names, an absurd store bound, explicit auth next to URL credentials);
3. ``deployment_problems`` (``load_config`` only): what a file run by ``serve`` / ``check``
   needs from its surroundings and from how the store is built from it: targets to scrape,
   files that exist, SLO windows the ring can serve, thresholds that are histogram buckets.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from exporters.redact import redact_text
from sla_guard import defaults
from sla_guard.settings.advisor import AdvisorConfig
from sla_guard.settings.detectors import DetectorsConfig
from sla_guard.spec_base import Strict, error_message, http_url, load_yaml

log = logging.getLogger("sla_guard.config")

# The embedded store's value matrices are 8 bytes per series per slot: a bound above this is a
# typo (or a guard that would be OOM-killed), not a sizing decision.
STORE_BYTES_CAP = 16 * 2**30
# The embedded SLO ledger keeps 15-min buckets over an attainment period: a year is ~35k buckets.
MAX_PERIOD_S = 400 * 86400.0


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and how to fix it."""


class Indicator(StrEnum):
    TTFT = "ttft"
    TPOT = "tpot"
    # the share of requests the service did not fail (client scope only: ``contract.AVAILABILITY_*``);
    # an attainment objective without a latency threshold
    AVAILABILITY = "availability"


class Objective(StrEnum):
    MEAN = "mean"  # mean over the window (from _sum / _count)
    PERCENTILE = "percentile"  # histogram_quantile over the window
    ATTAINMENT = "attainment"  # share of requests at or under the threshold, with an error budget


_DURATION = re.compile(r"((\d+(\.\d+)?)(ms|s|m|h|d|w))+")
_DURATION_PART = re.compile(r"(\d+(\.\d+)?)(ms|s|m|h|d|w)")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str, *, positive: bool = False) -> float:
    """Prometheus-style duration ('90s', '5m', '1h30m', '30d') in seconds. ``positive``: zero
    is an error too (a 0s window or period would divide by nothing)."""
    if not isinstance(text, str) or not _DURATION.fullmatch(text.strip()):
        raise ValueError(f"bad duration {text!r}; use e.g. 30s, 5m, 6h, 30d")
    total = 0.0
    for num, _, unit in _DURATION_PART.findall(text):
        total += float(num) * (0.001 if unit == "ms" else _UNITS[unit])
    if not math.isfinite(total):
        raise ValueError(f"duration {text!r} is too long; use e.g. 30s, 5m, 6h, 30d")
    if positive and total <= 0:
        raise ValueError(f"duration {text!r} must be greater than zero; use e.g. 30s, 5m, 6h, 30d")
    return total


def split_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT (``[::1]:8080`` for IPv6) -> (host, port); ValueError says what is wrong."""
    host, sep, port = listen.strip().rpartition(":")
    if not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port):
        raise ValueError(f"{listen!r} is not HOST:PORT; use e.g. 127.0.0.1:8080 or 0.0.0.0:8080")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port} in {listen!r} is not in 1..65535; use e.g. 127.0.0.1:8080")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not re.fullmatch(r"[A-Za-z0-9._:%-]+", host):
        raise ValueError(f"host {host!r} in {listen!r} is not a host name or IP address; use e.g. 127.0.0.1:8080")
    return host, int(port)


class SLO(Strict):
    """One objective. ``name`` must be unique within a (model, pool)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    indicator: Indicator = Field(strict=False)  # YAML gives the value ('ttft'), not the enum
    objective: Objective = Field(strict=False)
    threshold_s: float | None = Field(default=None, gt=0,
                                      description="latency threshold in seconds (ttft, tpot; not availability)")
    percentile: float | None = Field(default=None, gt=0, lt=1, description="e.g. 0.9 for p90")
    target: float | None = Field(default=None, gt=0, lt=1, description="attainment target, e.g. 0.99")
    window: str = Field(default="5m", description="evaluation window for mean/percentile SLOs")
    period: str = Field(default="30d", description="SLO period for attainment / error budget")
    min_requests: int = Field(default=20, ge=1, description="fewer requests in the window -> unknown")

    @field_validator("window", "period")
    @classmethod
    def _positive(cls, v: str) -> str:
        parse_duration(v, positive=True)
        return v

    @field_validator("period")
    @classmethod
    def _bounded(cls, v: str) -> str:
        if parse_duration(v) > MAX_PERIOD_S:
            raise ValueError(f"period {v!r} is longer than 400d; use e.g. 30d or 90d")
        return v

    @model_validator(mode="after")
    def _objective_fields(self) -> SLO:
        # a setting the objective does not read is a mistake about the objective, not a no-op
        unused = [f for f, used in (("percentile", Objective.PERCENTILE), ("target", Objective.ATTAINMENT))
                  if getattr(self, f) is not None and self.objective is not used]
        # (a period other than the default: a dumped and reloaded objective carries the default)
        if self.period != type(self).model_fields["period"].default and self.objective is not Objective.ATTAINMENT:
            unused.append("period")
        if unused:
            raise ValueError(f"objective '{self.objective.value}' does not use {' or '.join(unused)}: remove "
                             f"it, or choose objective "
                             f"{' / '.join(repr(o.value) for o in (Objective.PERCENTILE, Objective.ATTAINMENT))}")
        if self.indicator is Indicator.AVAILABILITY:
            # an error ratio: a request fails by its outcome, not its latency
            if self.objective is not Objective.ATTAINMENT:
                raise ValueError(f"indicator 'availability' has no {self.objective.value}: it is the share of "
                                 f"requests the service did not fail; use objective 'attainment' with a target "
                                 f"(e.g. 0.999)")
            if self.threshold_s is not None:
                raise ValueError("indicator 'availability' does not use threshold_s: a request counts as failed "
                                 "by its outcome (outcome=\"error\"), not its latency; remove threshold_s")
            if self.target is None:
                raise ValueError("objective 'attainment' needs 'target' (e.g. 0.999)")
            return self
        if self.threshold_s is None:
            raise ValueError(f"indicator '{self.indicator.value}' needs threshold_s (in seconds, e.g. "
                             f"{2.5 if self.indicator is Indicator.TTFT else 0.02})")
        # beyond the histograms' last finite bucket (TTFT 160 s, TPOT 2.5 s) no SLA is meant in
        # seconds: 2500 for a 2.5 s TTFT, or 20 for a 20 ms TPOT, would judge every breach "ok"
        from exporters.contract import TPOT_BUCKETS, TTFT_BUCKETS

        top = {Indicator.TTFT: TTFT_BUCKETS[-1], Indicator.TPOT: TPOT_BUCKETS[-1]}[self.indicator]
        if self.threshold_s > top:
            raise ValueError(f"threshold_s {self.threshold_s:g} is over {top:g} s, beyond the engines' "
                             f"{self.indicator.value} histogram: it is in seconds (a {self.threshold_s:g} ms "
                             f"threshold is threshold_s: {self.threshold_s / 1000:g})")
        if self.objective is Objective.PERCENTILE and self.percentile is None:
            raise ValueError("objective 'percentile' needs 'percentile' (e.g. 0.9)")
        if self.objective is Objective.ATTAINMENT and self.target is None:
            raise ValueError("objective 'attainment' needs 'target' (e.g. 0.99)")
        return self


def default_slos() -> list[SLO]:
    """Production SLAs from "From Day 0 to Production SLAs" (DaoCloud): mean TTFT <= 2.5 s, mean
    TPOT <= 20 ms; plus p90 TTFT and a 30-day 99% attainment objective on each."""
    ttft, tpot = defaults.TTFT_SLO_S, defaults.TPOT_SLO_S
    return [
        SLO(name="ttft_mean", indicator=Indicator.TTFT, objective=Objective.MEAN, threshold_s=ttft),
        SLO(name="tpot_mean", indicator=Indicator.TPOT, objective=Objective.MEAN, threshold_s=tpot),
        SLO(name="ttft_p90", indicator=Indicator.TTFT, objective=Objective.PERCENTILE, threshold_s=5.0,
            percentile=0.9),
        SLO(name="ttft_attainment", indicator=Indicator.TTFT, objective=Objective.ATTAINMENT,
            threshold_s=ttft, target=0.99),
        SLO(name="tpot_attainment", indicator=Indicator.TPOT, objective=Objective.ATTAINMENT,
            threshold_s=tpot, target=0.99),
    ]


class SLOSet(Strict):
    """SLOs for one model's pool. ``pool: '*'`` / ``model: '*'`` apply to all."""

    model: str = "*"
    pool: Literal["prefill", "decode", "mixed", "client", "*"] = "*"
    objectives: list[SLO] = Field(default_factory=default_slos)

    @field_validator("objectives")
    @classmethod
    def _some(cls, v: list[SLO]) -> list[SLO]:
        if not v:
            raise ValueError("no objectives: list at least one, or leave 'objectives' out for the default SLAs")
        return v

    @field_validator("objectives")
    @classmethod
    def _availability_on_the_client(cls, v: list[SLO], info: ValidationInfo) -> list[SLO]:
        # vLLM counts no request its API server failed (the 500 of a dead engine core): only a
        # router's outcome counter (the client scope) is an honest error ratio
        pool = info.data.get("pool", "*")
        for i, o in enumerate(v):
            if o.indicator is Indicator.AVAILABILITY and pool != "client":
                raise ValueError(f"objective {i} ({o.name}): indicator 'availability' is measured on the client "
                                 f"scope only (the proxy's or router's request outcomes; vLLM counts no request "
                                 f"its API server failed), not on pool {pool!r}: put it in a set with pool: client")
        return v

    def objectives_for(self, pool: str) -> list[SLO]:
        """This set's objectives for ``pool``. The default SLAs (``objectives`` left out) give a
        prefill pool the TTFT ones only, as ``default_slo_sets`` does: its engines emit one token
        per request, so TPOT objectives there would wait for requests and keep the pool unknown."""
        if pool == "prefill" and "objectives" not in self.model_fields_set:
            return [o for o in self.objectives if o.indicator is Indicator.TTFT]
        return list(self.objectives)


def default_slo_sets() -> list[SLOSet]:
    """The default SLAs on every pool, except that a prefill pool -- whose engines emit one
    token per request, so no TPOT -- gets the TTFT objectives only: otherwise its TPOT
    objectives wait for requests forever and a P/D deployment never gets a verdict."""
    ttft_only = [o for o in default_slos() if o.indicator is Indicator.TTFT]
    return [SLOSet(), SLOSet(pool="prefill", objectives=ttft_only)]


class Target(Strict):
    url: str = Field(description="http(s) URL of an engine's /metrics, or of a P/D router's")
    model: str = "default"
    pool: Literal["prefill", "decode", "mixed", "client"] = Field(
        default="mixed", description="'client' for a router or proxy: what clients see end to end")
    name: str | None = None
    adapter: Literal["dynamo", "llm-d", "production-stack"] | None = Field(
        default=None, description="the router whose own metrics this page carries; mapped onto the client scope")
    honor_labels: bool = Field(default=False, description="let the page's own model/pool labels win")
    """Opt-in: let the page's own model/pool labels win over this target's; for sidecars and
    aggregators that speak for several pools (the store and the scraper implement it). The target's
    own model/pool is then no pool: it stands in for the target's pools, in ``up``, only until a
    good page has named them (``Scraper._up``), so a healthy aggregator is judged on its pages'
    pools, and one down from the start is still unknown."""

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        return http_url(v, "http://decode-0:8000/metrics")

    @model_validator(mode="after")
    def _adapter_is_client(self) -> Target:
        if self.adapter is not None and self.pool != "client":
            raise ValueError(f"adapter {self.adapter!r} maps a router's metrics onto the client scope: "
                             "set pool: client on this target")
        return self


class DiscoveryError(ValueError):
    """A targets file entry that is not a target; the message names the entry and field."""


# the keys of a Prometheus file_sd group; its labels are free (job, env, ...)
FILE_SD_KEYS = frozenset({"targets", "labels"})


def parse_targets(data: object, where: str = "<targets>") -> list[Target]:
    """Targets from a parsed targets file; ``DiscoveryError`` names the entry and field. Here, next
    to ``Target``, because config validation checks the file too (``deployment_problems``) and
    the ingest package that re-reads it sits above the config."""
    if data is None:
        return []
    if not isinstance(data, list):
        raise DiscoveryError(f"{where}: expected a list of targets, got {type(data).__name__}")
    out: list[Target] = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise DiscoveryError(f"{where}[{i}]: expected a mapping, got {type(entry).__name__}")
        try:
            if "targets" in entry:  # Prometheus file_sd group
                if unknown := sorted(set(entry) - FILE_SD_KEYS):  # 'label:' for 'labels:' dropped every label
                    raise DiscoveryError(f"{where}[{i}]: unknown key(s) {', '.join(map(str, unknown))} in a file_sd "
                                         f"group; it has 'targets' and 'labels' only")
                # a string would be read character by character, a list of labels fails in dict()
                hosts, labels = entry["targets"], entry.get("labels") or {}
                if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
                    raise DiscoveryError(f"{where}[{i}].targets: expected a list of \"host:port\" strings "
                                         f"(e.g. targets: [\"decode-0:8000\"]), got {hosts!r}")
                if not isinstance(labels, dict):
                    raise DiscoveryError(f"{where}[{i}].labels: expected a mapping (e.g. labels: {{model: m, "
                                         f"pool: decode}}), got {labels!r}")
                labels = dict(labels)
                path = labels.pop("__metrics_path__", "/metrics")
                scheme = labels.pop("__scheme__", "http")
                if not isinstance(path, str) or not path.startswith("/"):
                    raise DiscoveryError(f"{where}[{i}].labels.__metrics_path__: expected a path starting with '/' "
                                         f"(e.g. /metrics), got {path!r}")
                for j, hostport in enumerate(hosts):
                    # 'http://h:8000' or 'h:8000/metrics' became http://http://h:8000/metrics (host "http")
                    # or .../metrics/metrics and failed every scrape; Prometheus refuses them too
                    if not hostport or "/" in hostport or any(ch.isspace() for ch in hostport):
                        raise DiscoveryError(f"{where}[{i}].targets[{j}]: expected \"host:port\" without scheme or "
                                             f"path (e.g. \"decode-0:8000\"; labels __scheme__ and __metrics_path__ "
                                             f"set those), got {hostport!r}")
                    out.append(Target(url=f"{scheme}://{hostport}{path}", model=labels.get("model", "default"),
                                      pool=labels.get("pool", "mixed"), name=labels.get("name")))
            else:
                out.append(Target.model_validate(entry))
        except ValidationError as err:
            e = err.errors()[0]
            field = ".".join(str(p) for p in e["loc"])
            raise DiscoveryError(f"{where}[{i}].{field}: {error_message(e)} (got {e.get('input')!r})") from None
        except (TypeError, KeyError) as err:
            raise DiscoveryError(f"{where}[{i}]: {err}") from None
    return out


class ScrapeSource(Strict):
    mode: Literal["scrape"] = "scrape"
    targets: list[Target] = Field(default_factory=list)
    targets_file: Path | None = Field(default=None, strict=False,  # YAML gives a string
                                      description="YAML/JSON list of targets, re-read each tick")
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=3.0, gt=0, description="per scrape; defaults to min(3, interval_s)")
    concurrency: int = Field(default=64, ge=1)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)

    @model_validator(mode="after")
    def _default_timeout(self) -> ScrapeSource:
        # As Prometheus does: an unset scrape timeout is capped at the interval; a set one that
        # is longer is an error (deployment_problems), since scrapes would overlap.
        if "timeout_s" not in self.model_fields_set and self.timeout_s > self.interval_s:
            object.__setattr__(self, "timeout_s", self.interval_s)
        return self


class PrometheusSource(Strict):
    mode: Literal["prometheus"]
    url: str
    timeout_s: float = Field(default=10.0, gt=0)
    bearer_token_env: str | None = None
    # Label that carries the model / pool in the Prometheus the guard queries.
    selector: str = Field(default="", description="extra PromQL matchers, e.g. 'namespace=\"llm\"'")
    concurrency: int = Field(default=8, ge=1, le=64, description="queries in flight at once within a tick")
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024,
                                description="largest answer read; a bigger one counts as too_large (unknown)")
    accept_partial: bool = Field(
        default=False, description="use answers that carry warnings (a remote-read or store failure: partial data); "
                                   "by default they count as partial and read unknown")
    headers: dict[str, str] = Field(
        default_factory=dict, description="sent with every query, e.g. {X-Scope-OrgID: team-a} for a multi-tenant "
                                          "Mimir or Cortex; not for secrets (headers_env)")
    headers_env: dict[str, str] = Field(
        default_factory=dict, description="header name -> environment variable holding its value (secrets)")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        return http_url(v, "http://prometheus:9090")

    @field_validator("headers")
    @classmethod
    def _headers(cls, v: dict[str, str]) -> dict[str, str]:
        """Values are sent as they are, so one httpx cannot send (a line break, non-ASCII) is
        refused here, where the error can name the header, rather than failing every query.
        The value itself is never quoted: someone may have put a secret there after all."""
        _header_names(v, "headers")
        out = {}
        for name, value in v.items():
            value = value.strip()
            if not value or not all(" " <= ch <= "~" for ch in value):
                what = "empty" if not value else "not one line of printable ASCII"
                raise ValueError(f"the value of {name!r} is {what} (an HTTP header value cannot hold line breaks, "
                                 f"control or non-ASCII characters); write it on one line, or remove the header")
            out[name] = value
        return out

    @field_validator("headers_env")
    @classmethod
    def _headers_env(cls, v: dict[str, str]) -> dict[str, str]:
        _header_names(v, "headers_env")
        for name, env in v.items():
            if not _ENV_NAME.fullmatch(env):
                # not quoted: a value written where the variable's name belongs may be the secret
                raise ValueError(f"{name!r}: its variable is not an environment variable name (letters, digits, _); "
                                 f"write the name of the variable that holds the value, e.g. {{{name}: MIMIR_KEY}}")
        return v


# an HTTP header name (RFC 9110 token) and an environment variable name (POSIX)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# headers httpx writes itself from the request: one in the config would be sent twice or break framing
_CLIENT_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def _header_names(v: dict[str, str], field: str) -> None:
    """ValueError naming the header and the fix for a name that cannot be sent, Authorization
    (the credentials have their own fields, kept out of logs) or a name given twice."""
    seen: set[str] = set()
    for name in v:
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an HTTP header name (letters, digits and !#$%&'*+.^_`|~- only, no "
                             f"spaces or colons); write it as e.g. X-Scope-OrgID")
        low = name.lower()
        if low == "authorization":
            raise ValueError("Authorization cannot be set here: use source.bearer_token_env (Bearer, read from the "
                             "environment) or user:password@ in source.url (Basic)")
        if low in _CLIENT_HEADERS:
            raise ValueError(f"{name!r} is written by the HTTP client from source.url; remove it from {field}")
        if low in seen:
            raise ValueError(f"{name!r} is given twice (header names ignore case); keep one")
        seen.add(low)


def _source_mode(v: Any) -> str:
    """``source:`` without ``mode:`` is a scrape source (as documented)."""
    if isinstance(v, dict):
        mode = v.get("mode", "scrape")
        return mode if isinstance(mode, str) else f"<{type(mode).__name__}>"
    return getattr(v, "mode", "scrape")


Source = Annotated[
    Annotated[ScrapeSource, Tag("scrape")] | Annotated[PrometheusSource, Tag("prometheus")],
    Discriminator(_source_mode, custom_error_type="source_mode",
                  custom_error_message="mode must be 'scrape' (the default) or 'prometheus'"),
]


class APISettings(Strict):
    listen: str = "127.0.0.1:8080"
    token_file: Path | None = Field(default=None, strict=False)  # YAML gives a string
    token_env: str | None = "SLA_GUARD_TOKEN"
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        split_listen(v)
        return v

    def token(self) -> str | None:
        """The bearer token for /v1/* now; ConfigError (never OSError/UnicodeDecodeError) if the file
        cannot be used. The server follows a token file's changes through ``TokenFile``."""
        if self.token_file is not None:
            return _read_token(self.token_file) or None
        if self.token_env:
            return _env_token(self.token_env)
        return None


def _env_token(name: str) -> str | None:
    """The token in ``$name``, surrounding whitespace dropped as for ``token_file``: a Secret
    written with ``echo`` (a trailing newline) and mapped into the variable made /v1 answer 401
    to every client, which cannot send a line break in a header. One inside is refused."""
    token = os.environ.get(name, "").strip()
    if token and not token.isprintable():
        raise ConfigError(f"api.token_env: ${name} holds more than one line (or a control character) where one "
                          f"token is read; set it to the token alone")
    return token or None


def _read_token(path: Path) -> str:
    """The token in ``path``: surrounding whitespace and an editor's byte-order mark dropped. A token
    with a line break or another control character inside is refused: no client can send it in an
    Authorization header, so /v1 would answer 401 to everyone without a word."""
    try:
        token = path.read_text(encoding="utf-8").removeprefix("\ufeff").strip()
    except OSError as err:
        raise ConfigError(f"api.token_file: cannot read {path}: {err.strerror or err}; "
                          f"create it (one line, the token) or use api.token_env") from None
    except UnicodeDecodeError:
        raise ConfigError(f"api.token_file: {path} is not UTF-8 text; write the token as one line of "
                          f"plain text") from None
    if not token.isprintable():
        raise ConfigError(f"api.token_file: {path} holds more than one line (or a control character) where one "
                          f"token is read; write the token alone on one line")
    return token


class TokenFile:
    """``api.token_file`` as the server reads it: re-read when the file changes (a Kubernetes Secret
    rotates by swapping the mounted file), so a rotated token is the one accepted, without a restart.
    A file that cannot be used after a change (gone mid-swap, empty, two lines) keeps the last good
    token and is logged: the API never opens, and a bad edit never locks every client out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key = self._stat()
        self._token = _read_token(path)  # ConfigError at start: serve names the field and exits 2
        self._complained: object = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()  # follows the Secret's ..data symlink
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def __call__(self) -> str:
        key = self._stat()
        if key is not None and key != self._key:
            try:
                token = _read_token(self.path)
                if not token:
                    raise ConfigError(f"api.token_file: {self.path} is empty")
            except ConfigError as err:
                if self._complained != key:
                    log.warning("%s; the last token read stays in use", err)
                    self._complained = key
            else:
                self._token, self._key = token, key
                log.info("api.token_file: %s changed; the new token is in use", self.path)
        return self._token


class Retention(Strict):
    duration: str = Field(default="26h", description="how long the embedded store keeps samples")
    coarse_step: str = Field(default="5m", description="step of the downsampled tier (process memory, load "
                                                       "gauges) that long-range reads such as leak detection use")
    coarse_duration: str = Field(default="26h", description="span of the downsampled tier; 0s disables it")
    max_series: int = Field(default=200_000, ge=100)
    max_series_per_target: int = Field(default=20_000, ge=10, description="a label bomb in one target stops here")
    max_labels_per_series: int = Field(default=16, ge=4)
    slots: int = Field(default=1440, ge=8, le=100_000,
                       description="samples kept per series (ring); window coverage = slots x scrape interval")

    @field_validator("duration")
    @classmethod
    def _positive(cls, v: str) -> str:
        parse_duration(v, positive=True)
        return v

    @field_validator("coarse_step", "coarse_duration")
    @classmethod
    def _duration(cls, v: str) -> str:
        if v.strip() in ("0", "0s"):  # the downsampled tier is off
            return v
        parse_duration(v, positive=True)
        return v


class AlertmanagerSettings(Strict):
    url: str | None = None
    bearer_token_env: str | None = None
    timeout_s: float = Field(default=5.0, gt=0)
    runbook_base_url: str = "https://github.com/sla-guard/sla-guard/blob/main/docs/runbooks.md"
    # the guard's URL as people reach it (a proxy, an Ingress): alerts link to its /v1/findings;
    # unset, the api.listen address
    external_url: str | None = None

    @field_validator("url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v, "http://alertmanager:9093")

    @field_validator("external_url")
    @classmethod
    def _external(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v, "https://sla-guard.example.com")


class EngineBuckets(Strict):
    """Extra TTFT / TPOT bucket boundaries the engines were started with (``SLA_GUARD_TTFT_SLO_S``,
    ``SLA_GUARD_TPOT_SLO_S``, see exporters/contract.py ``bucket_override``). An attainment SLO
    counts requests from the bucket whose upper bound is its threshold, so a threshold must be
    a contract bucket or one declared here."""

    ttft: list[Annotated[float, Field(gt=0)]] = Field(default_factory=list)
    tpot: list[Annotated[float, Field(gt=0)]] = Field(default_factory=list)


class StateSettings(Strict):
    """Crash-safe state (``sla_guard.state``): SLO ledgers, open findings, advisor memory."""

    path: Path | None = Field(default=None, strict=False,  # YAML gives a string
                              description="SQLite file kept across restarts; unset: state is in memory only "
                                          "and a restart forgets it")
    max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024, description="size cap; oldest log records go")
    synchronous: Literal["normal", "full"] = Field(
        default="normal", description="normal: survives kill -9 (WAL); full: also power loss, one fsync per tick")


class GuardConfig(Strict):
    source: Source = Field(default_factory=ScrapeSource)
    slos: list[SLOSet] = Field(default_factory=default_slo_sets)
    evaluation_interval_s: float = Field(default=15.0, gt=0)
    staleness_s: float = Field(default=60.0, gt=0, description="older data is unknown, never ok")
    api: APISettings = Field(default_factory=APISettings)
    retention: Retention = Field(default_factory=Retention)
    alertmanager: AlertmanagerSettings = Field(default_factory=AlertmanagerSettings)
    state: StateSettings = Field(default_factory=StateSettings)
    engine_buckets: EngineBuckets = Field(default_factory=EngineBuckets)
    # The detectors' and the advisor's settings (models in sla_guard.settings, below the config)
    detectors: DetectorsConfig = Field(default_factory=DetectorsConfig)
    advisor: AdvisorConfig = Field(default_factory=AdvisorConfig)

    @field_validator("slos")
    @classmethod
    def _some(cls, v: list[SLOSet]) -> list[SLOSet]:
        if not v:
            raise ValueError("no SLO sets: list at least one, or leave 'slos' out for the default SLAs")
        return v

    @model_validator(mode="after")
    def _staleness_fits_the_scrape(self) -> GuardConfig:
        scrape = getattr(self.source, "interval_s", None)
        if scrape is not None and self.staleness_s < scrape:
            raise ValueError(f"staleness_s {self.staleness_s:g} is shorter than source.interval_s {scrape:g}: every "
                             f"verdict would be unknown between two scrapes; use at least 2 x the interval "
                             f"({2 * scrape:g})")
        if self.staleness_s > 86400:
            raise ValueError(f"staleness_s {self.staleness_s:g} is over a day: data that old would still count as "
                             f"current; use a few scrape intervals (the default is 60)")
        return self

    def slos_for(self, model: str, pool: str) -> list[SLO]:
        """Objectives for one (model, pool): the most specific matching SLOSet wins."""
        best: tuple[int, SLOSet] | None = None
        for s in self.slos:
            if s.model not in ("*", model) or s.pool not in ("*", pool):
                continue
            score = (s.model != "*") * 2 + (s.pool != "*")
            if best is None or score > best[0]:
                best = (score, s)
        return best[1].objectives_for(pool) if best else []


def _models_in(tp: Any) -> list[type[BaseModel]]:
    """The models an annotation holds, through Optional, unions, lists, dicts and Annotated."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in get_args(tp) for m in _models_in(a)]


def _sections(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """Every section of the config as (dotted path without list indices, its model)."""
    out = [(path, model)]
    for name, f in model.model_fields.items():
        for m in _models_in(f.annotation):
            out += _sections(m, f"{path}.{name}" if path else name)
    return out


def _unknown_field(loc: tuple, root: type[BaseModel]) -> str:
    """Why a key is unknown where it stands: a field of another section (a wrong indentation
    moves `targets:` out of `source:`), a near spelling of a field here, or neither."""
    name, here = str(loc[-1]), [root]
    for part in loc[:-1]:
        fields = [m.model_fields[part] for m in here if isinstance(part, str) and part in m.model_fields]
        # list indices, union tags (source.scrape) and mapping keys (advisor.pools.prefill) stay put
        here = [m for f in fields for m in _models_in(f.annotation)] if fields else here
    siblings = {n for m in here for n in m.model_fields}
    homes = sorted({p for p, m in _sections(root) if name in m.model_fields and m not in here},
                   key=lambda p: (p.count("."), p))  # the nearest sections first
    if homes:
        where = " or ".join(p or "the top level" for p in homes[:3])
        return f"unknown field here; {name!r} is a field of {where}: check its indentation"
    near = difflib.get_close_matches(name, sorted(siblings), n=1, cutoff=0.75)
    if near:
        return f"unknown field; did you mean {near[0]!r}?"
    return "unknown field; remove it or check its spelling"


def format_validation_error(err: ValidationError, where: str, prefix: str = "") -> str:
    """One line per problem: the field path (under ``prefix``), what is wrong, the bad value."""
    lines = [f"invalid configuration in {where}:"]
    for e in err.errors():
        # a bad mapping key (advisor.pools.prefil) is located by pydantic at "<key>.[key]"
        path = ".".join([*([prefix] if prefix else []), *(str(p) for p in e["loc"] if p != "[key]")]) or "(top level)"
        value = e.get("input")
        shown = redact_text(repr(value)) if not isinstance(value, dict) else "{...}"
        msg = _unknown_field(e["loc"], GuardConfig) if e["type"] == "extra_forbidden" else error_message(e)
        lines.append(f"  {path}: {redact_text(msg)} (got {shown[:80]})")
    return "\n".join(lines)


Problem = tuple[str, str]  # (field path, what is wrong and how to fix it)


def format_problems(problems: list[Problem], where: str) -> str:
    """The same one-line-per-problem form as ``format_validation_error``."""
    return "\n".join([f"invalid configuration in {where}:", *(f"  {path}: {msg}" for path, msg in problems)])


def config_problems(cfg: GuardConfig) -> list[Problem]:
    """Rules across fields that no use of the config can be right to break."""
    out: list[Problem] = []
    src = cfg.source
    if isinstance(src, ScrapeSource):
        seen: dict[str, int] = {}
        for i, t in enumerate(src.targets):
            key = t.name or t.url
            if key in seen:
                out.append((f"source.scrape.targets.{i}.name",
                            f"duplicate target name {redact_text(repr(key))} (also targets.{seen[key]}; a target's "
                            f"name is its 'name', else its url); give each target a unique name"))
            seen.setdefault(key, i)
    else:
        url = urlsplit(src.url)
        if (url.username is not None or url.password is not None) and src.bearer_token_env:
            out.append(("source.prometheus.url",
                        "has user:password@ credentials and bearer_token_env is set too; only one can be "
                        "sent: remove the credentials from the URL or drop bearer_token_env"))
        both = {n.lower() for n in src.headers} & {n.lower() for n in src.headers_env}
        for name in sorted(both):
            out.append(("source.prometheus.headers_env",
                        f"{name!r} is also in source.headers; only one value can be sent: remove it from one"))
    sets: dict[tuple[str, str], int] = {}
    for si, s in enumerate(cfg.slos):
        if (s.model, s.pool) in sets:
            out.append((f"slos.{si}", f"a second SLO set for model={s.model!r}, pool={s.pool!r} (also "
                                      f"slos.{sets[(s.model, s.pool)]}); only one would be used: merge their "
                                      f"objectives into one set"))
        sets.setdefault((s.model, s.pool), si)
        names: dict[str, int] = {}
        for oi, o in enumerate(s.objectives):
            if o.name in names:
                out.append((f"slos.{si}.objectives.{oi}.name",
                            f"duplicate SLO name {o.name!r} (also objectives.{names[o.name]}); names must be "
                            f"unique within a set: rename one"))
            names.setdefault(o.name, oi)
    r = cfg.retention
    worst = r.max_series * r.slots * 8
    if worst > STORE_BYTES_CAP:
        out.append(("retention.max_series",
                    f"the store could hold {r.max_series} series x {r.slots} slots x 8 B = {worst / 2**30:,.1f} GiB, "
                    f"over the {STORE_BYTES_CAP // 2**30} GiB cap; lower retention.max_series or retention.slots"))
    return out


def _fmt_s(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _short(path: Path) -> str:
    text = repr(str(path))
    return text if len(text) <= 120 else f"{text[:117]}..."


def _path_kind(path: Path) -> str:
    """'file', or what is wrong with ``path`` as a file to read (never raises: a NUL byte or an
    overlong name is a config error, not an OSError)."""
    try:
        if path.is_file():
            return "file"
        if path.is_dir():
            return "is a directory, not a file"
        return "is not a regular file (a FIFO, socket or device)" if path.exists() else "does not exist"
    except (OSError, ValueError) as err:
        return f"cannot be used ({getattr(err, 'strerror', None) or err})"


def _writable_file_problem(field: str, text: str, example: str) -> Problem | None:
    """A file the running guard creates or appends to (``advisor.decision_log``, the file
    leader election's ``lock_file``): not a directory, and creatable in a writable directory.
    Unchecked, a parent that is a file or read-only crashed ``serve`` at start with a traceback
    (the decision log) or left it a standby for good, logging a traceback every retry (the lock)."""
    path = Path(text)
    where = "" if path.is_absolute() else f" (relative paths are read from the working directory, {Path.cwd()})"
    try:
        if path.is_dir():
            return field, f"{_short(path)} is a directory{where}; name a file, e.g. {_short(path / example)}"
        if path.exists():
            if not os.access(path, os.W_OK):
                return field, f"{_short(path)} is not writable{where}; fix its permissions or name another file"
            return None
        parent = path.parent
        while not parent.exists():  # the guard creates the missing directories
            parent = parent.parent
        if not parent.is_dir():
            return field, (f"{_short(path)} cannot be created: {_short(parent)} is not a directory{where}; "
                           f"name a file under a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            return field, (f"{_short(path)} cannot be created: directory {_short(parent)} is not writable{where}; "
                           f"mount a writable volume there or name another file")
    except (OSError, ValueError) as err:
        return field, f"{_short(path)} cannot be used ({getattr(err, 'strerror', None) or err}); name another file"
    return None


def _targets_file_problems(src: ScrapeSource) -> list[Problem]:
    path = src.targets_file
    field = "source.scrape.targets_file"
    where = "" if path.is_absolute() else f" (relative paths are read from the working directory, {Path.cwd()})"
    kind = _path_kind(path)
    if kind != "file":
        return [(field, f"{_short(path)} {kind}{where}; name an existing YAML/JSON targets file (a list of "
                        f"targets, may be empty)")]
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
        targets = parse_targets(data, str(path))
    except OSError as err:
        return [(field, f"cannot read {_short(path)}: {err.strerror or err}; fix its permissions")]
    except UnicodeDecodeError:
        return [(field, f"{_short(path)} is not UTF-8 text; write it as YAML or JSON")]
    except yaml.YAMLError as err:
        return [(field, f"{_short(path)} is not valid YAML: {' '.join(str(err).split())}")]
    except DiscoveryError as err:
        return [(field, f"{err}; fix the entry")]
    seen = {t.name or t.url for t in src.targets}
    out: list[Problem] = []
    for t in targets:
        key = t.name or t.url
        if key in seen:
            out.append((field, f"target name {key!r} appears twice (in the file or also in source.targets); "
                               f"the second would be ignored: give each target a unique name"))
        seen.add(key)
    return out


def deployment_problems(cfg: GuardConfig) -> list[Problem]:
    """What ``serve`` / ``check`` need beyond a well-formed config: checked by ``load_config``
    (a file is what gets deployed), not by ``parse_config`` (tests, the simulator and the
    benchmarks build configs whose store and engines are not the file's)."""
    from exporters.contract import TPOT_BUCKETS, TTFT_BUCKETS

    out: list[Problem] = []
    src = cfg.source
    if isinstance(src, ScrapeSource):
        if not src.targets and src.targets_file is None:
            out.append(("source.scrape.targets", "no targets: list the engines' /metrics URLs under "
                                                 "source.targets, name a source.targets_file, or use "
                                                 "mode: prometheus"))
        if src.targets_file is not None:
            out.extend(_targets_file_problems(src))
        if "timeout_s" in src.model_fields_set and src.timeout_s > src.interval_s:
            out.append(("source.scrape.timeout_s",
                        f"{src.timeout_s:g}s is longer than interval_s ({src.interval_s:g}s): scrapes would "
                        f"overlap (Prometheus requires scrape_timeout <= scrape_interval); lower timeout_s "
                        f"or raise interval_s"))
        # mean/percentile and the attainment SLI are read over `window` from the sample ring; the
        # attainment period and burn windows come from the per-pool ledger (slo.py), which only
        # needs the ring to span one evaluation interval.
        r = cfg.retention
        ring = r.slots * src.interval_s
        keep = min(ring, parse_duration(r.duration))
        what = (f"the store keeps {_fmt_s(keep)} (retention.slots {r.slots} x interval_s {src.interval_s:g}s "
                f"= {_fmt_s(ring)}, retention.duration {r.duration})")
        for si, s in enumerate(cfg.slos):
            for oi, o in enumerate(s.objectives):
                w = parse_duration(o.window)
                if o.objective is not Objective.ATTAINMENT and w < src.interval_s:
                    # a window's increase needs two scrapes in it; under one interval it never holds two,
                    # and the objective is unknown for good (Prometheus advises 2-4 intervals)
                    out.append((f"slos.{si}.objectives.{oi}.window",
                                f"{o.window} is shorter than one scrape interval (interval_s {src.interval_s:g}s): "
                                f"it never holds two scrapes, so the objective could never be judged; use at "
                                f"least {_fmt_s(2 * src.interval_s)}"))
                if w > keep:
                    need = math.ceil(w / src.interval_s)
                    out.append((f"slos.{si}.objectives.{oi}.window",
                                f"{o.window} is longer than {what}; shorten the window or raise "
                                f"retention.slots to at least {need} (and retention.duration to at least "
                                f"{o.window})"))
        if cfg.evaluation_interval_s > keep:
            out.append(("evaluation_interval_s", f"{cfg.evaluation_interval_s:g}s is longer than {what}; "
                                                 f"evaluate more often or keep more samples"))
    defaults = {Indicator.TTFT: TTFT_BUCKETS, Indicator.TPOT: TPOT_BUCKETS}
    env = {Indicator.TTFT: "SLA_GUARD_TTFT_SLO_S", Indicator.TPOT: "SLA_GUARD_TPOT_SLO_S"}
    for si, s in enumerate(cfg.slos):
        for oi, o in enumerate(s.objectives):
            if o.objective is not Objective.ATTAINMENT or o.threshold_s is None:
                continue  # (availability has no threshold)
            ind = o.indicator
            known = [*defaults[ind], *getattr(cfg.engine_buckets, ind.value)]
            if any(math.isclose(o.threshold_s, b, rel_tol=1e-9) for b in known):
                continue
            near = sorted(defaults[ind], key=lambda b: abs(b - o.threshold_s))[:2]
            out.append((f"slos.{si}.objectives.{oi}.threshold_s",
                        f"the engines' {ind.value} histograms have no bucket boundary at threshold_s "
                        f"{o.threshold_s:g} (attainment counts requests from the bucket whose upper bound is "
                        f"the threshold); start the "
                        f"engines with {env[ind]}={o.threshold_s:g} and declare it as engine_buckets: "
                        f"{{{ind.value}: [{o.threshold_s:g}]}}, or use a boundary such as "
                        f"{' or '.join(f'{b:g}' for b in sorted(near))}"))
    adv = cfg.advisor
    files = [("advisor.decision_log", adv.decision_log, "decisions.jsonl")]
    if adv.mode == "active" and adv.actuation.leader_election.mode == "file":  # the only use of the lock
        files.append(("advisor.actuation.leader_election.lock_file", adv.actuation.leader_election.lock_file,
                      "actuation.lock"))
    out.extend(p for field, text, eg in files if text and (p := _writable_file_problem(field, text, eg)) is not None)
    tf = cfg.api.token_file
    if tf is not None:
        if (kind := _path_kind(tf)) != "file":
            out.append(("api.token_file", f"{_short(tf)} {kind}; create it (one line, the token) or use "
                                          f"api.token_env"))
        else:
            try:
                if not _read_token(tf):
                    out.append(("api.token_file", f"{_short(tf)} is empty; write the token into it"))
            except ConfigError as err:
                out.append(("api.token_file", str(err).removeprefix("api.token_file: ")))
    return out


def parse_config(data: dict[str, Any] | None, where: str = "<config>") -> GuardConfig:
    """A config from parsed YAML: the models (the detectors' and the advisor's sections
    included), then ``config_problems``; every problem of a stage is reported at once."""
    try:
        cfg = GuardConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, where)) from None
    if problems := config_problems(cfg):
        raise ConfigError(format_problems(problems, where))
    return cfg


def check_deployment(cfg: GuardConfig, where: str = "<config>") -> GuardConfig:
    """``cfg`` if it can be served as is, else ConfigError listing ``deployment_problems``."""
    problems = deployment_problems(cfg)
    if problems:
        raise ConfigError(format_problems(problems, where))
    return cfg


def load_config(path: str | Path) -> GuardConfig:
    """The config file ``serve``, ``check`` and ``validate-config`` run: parsed, validated and
    checked for deployment; any problem is a ConfigError, never another exception."""
    p = Path(path)
    try:
        data = load_yaml(p.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read config {p}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p} is not valid YAML: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of settings, got {type(data).__name__}")
    return check_deployment(parse_config(data, str(p)), str(p))
