"""The guard's one configuration file (YAML), validated with pydantic.

The SLO spec in it is the single source the guard, the alert rules and the dashboards read.
``load_config`` turns any validation failure into a ``ConfigError`` whose message names the
field path, the bad value and what is allowed.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Indicator(StrEnum):
    TTFT = "ttft"
    TPOT = "tpot"


class Objective(StrEnum):
    MEAN = "mean"  # mean over the window (from _sum / _count)
    PERCENTILE = "percentile"  # histogram_quantile over the window
    ATTAINMENT = "attainment"  # share of requests at or under the threshold, with an error budget


class SLO(_Strict):
    """One objective. ``name`` must be unique within a (model, pool)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    indicator: Indicator
    objective: Objective
    threshold_s: float = Field(gt=0, description="latency threshold in seconds")
    percentile: float | None = Field(default=None, gt=0, lt=1, description="e.g. 0.9 for p90")
    target: float | None = Field(default=None, gt=0, lt=1, description="attainment target, e.g. 0.99")
    window: str = Field(default="5m", description="evaluation window for mean/percentile SLOs")
    period: str = Field(default="30d", description="SLO period for attainment / error budget")
    min_requests: int = Field(default=20, ge=1, description="fewer requests in the window -> unknown")

    @model_validator(mode="after")
    def _objective_fields(self) -> SLO:
        if self.objective is Objective.PERCENTILE and self.percentile is None:
            raise ValueError("objective 'percentile' needs 'percentile' (e.g. 0.9)")
        if self.objective is Objective.ATTAINMENT and self.target is None:
            raise ValueError("objective 'attainment' needs 'target' (e.g. 0.99)")
        parse_duration(self.window)
        parse_duration(self.period)
        return self


def default_slos() -> list[SLO]:
    """The seeds' production SLAs: mean TTFT <= 2.5 s, mean TPOT <= 20 ms, plus p90 TTFT and a
    30-day 99% attainment objective on each."""
    return [
        SLO(name="ttft_mean", indicator=Indicator.TTFT, objective=Objective.MEAN, threshold_s=2.5),
        SLO(name="tpot_mean", indicator=Indicator.TPOT, objective=Objective.MEAN, threshold_s=0.020),
        SLO(name="ttft_p90", indicator=Indicator.TTFT, objective=Objective.PERCENTILE, threshold_s=5.0,
            percentile=0.9),
        SLO(name="ttft_attainment", indicator=Indicator.TTFT, objective=Objective.ATTAINMENT,
            threshold_s=2.5, target=0.99),
        SLO(name="tpot_attainment", indicator=Indicator.TPOT, objective=Objective.ATTAINMENT,
            threshold_s=0.020, target=0.99),
    ]


class SLOSet(_Strict):
    """SLOs for one model's pool. ``pool: '*'`` / ``model: '*'`` apply to all."""

    model: str = "*"
    pool: Literal["prefill", "decode", "mixed", "*"] = "*"
    objectives: list[SLO] = Field(default_factory=default_slos)


class Target(_Strict):
    url: str = Field(description="http(s) URL of an engine's /metrics")
    model: str = "default"
    pool: Literal["prefill", "decode", "mixed"] = "mixed"
    name: str | None = None

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v


class ScrapeSource(_Strict):
    mode: Literal["scrape"] = "scrape"
    targets: list[Target] = Field(default_factory=list)
    targets_file: Path | None = Field(default=None, description="YAML/JSON list of targets, re-read each tick")
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=3.0, gt=0)
    concurrency: int = Field(default=64, ge=1)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)


class PrometheusSource(_Strict):
    mode: Literal["prometheus"]
    url: str
    timeout_s: float = Field(default=10.0, gt=0)
    bearer_token_env: str | None = None
    # Label that carries the model / pool in the Prometheus the guard queries.
    selector: str = Field(default="", description="extra PromQL matchers, e.g. 'namespace=\"llm\"'")


Source = Annotated[ScrapeSource | PrometheusSource, Field(discriminator="mode")]


class APISettings(_Strict):
    listen: str = "127.0.0.1:8080"
    token_file: Path | None = None
    token_env: str | None = "SLA_GUARD_TOKEN"
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)

    def token(self) -> str | None:
        if self.token_file is not None:
            return self.token_file.read_text().strip() or None
        if self.token_env:
            return os.environ.get(self.token_env) or None
        return None


class Retention(_Strict):
    duration: str = Field(default="26h", description="how long the embedded store keeps samples")
    coarse_step: str = Field(default="5m", description="step of the downsampled tier (process memory, load "
                                                       "gauges) that long-range reads such as leak detection use")
    coarse_duration: str = Field(default="26h", description="span of the downsampled tier; 0s disables it")
    max_series: int = Field(default=200_000, ge=100)
    max_series_per_target: int = Field(default=20_000, ge=10, description="a label bomb in one target stops here")
    max_labels_per_series: int = Field(default=16, ge=4)
    slots: int = Field(default=1440, ge=8, le=100_000,
                       description="samples kept per series (ring); window coverage = slots x scrape interval")

    @field_validator("duration", "coarse_step", "coarse_duration")
    @classmethod
    def _duration(cls, v: str) -> str:
        if v.strip() in ("0", "0s"):
            return v
        parse_duration(v)
        return v


class AlertmanagerSettings(_Strict):
    url: str | None = None
    bearer_token_env: str | None = None
    timeout_s: float = 5.0
    runbook_base_url: str = "https://github.com/sla-guard/sla-guard/blob/main/docs/runbooks.md"


class GuardConfig(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Source = Field(default_factory=ScrapeSource)
    slos: list[SLOSet] = Field(default_factory=lambda: [SLOSet()])
    evaluation_interval_s: float = Field(default=15.0, gt=0)
    staleness_s: float = Field(default=60.0, gt=0, description="older data is unknown, never ok")
    api: APISettings = Field(default_factory=APISettings)
    retention: Retention = Field(default_factory=Retention)
    alertmanager: AlertmanagerSettings = Field(default_factory=AlertmanagerSettings)
    # Sections owned by the detectors and the advisor; validated by their own models.
    detectors: dict[str, Any] = Field(default_factory=dict)
    advisor: dict[str, Any] = Field(default_factory=dict)

    def slos_for(self, model: str, pool: str) -> list[SLO]:
        """Objectives for one (model, pool): the most specific matching SLOSet wins."""
        best: tuple[int, SLOSet] | None = None
        for s in self.slos:
            if s.model not in ("*", model) or s.pool not in ("*", pool):
                continue
            score = (s.model != "*") * 2 + (s.pool != "*")
            if best is None or score > best[0]:
                best = (score, s)
        return list(best[1].objectives) if best else []


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Prometheus-style duration ('90s', '5m', '1h30m', '30d') in seconds."""
    import re

    parts = re.fullmatch(r"((\d+(\.\d+)?)(ms|s|m|h|d|w))+", text.strip())
    if not parts:
        raise ValueError(f"bad duration {text!r}; use e.g. 30s, 5m, 6h, 30d")
    total = 0.0
    for num, _, unit in re.findall(r"(\d+(\.\d+)?)(ms|s|m|h|d|w)", text):
        total += float(num) * (0.001 if unit == "ms" else _UNITS[unit])
    return total


def format_validation_error(err: ValidationError, where: str, prefix: str = "") -> str:
    """One line per problem: the field path (under ``prefix``), what is wrong, the bad value."""
    lines = [f"invalid configuration in {where}:"]
    for e in err.errors():
        path = ".".join([*([prefix] if prefix else []), *(str(p) for p in e["loc"])]) or "(top level)"
        value = e.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        msg = "unknown field; remove it or check its spelling" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {path}: {msg} (got {shown[:80]})")
    return "\n".join(lines)


# Sections owned by other parts of the guard, validated by their own models at load time so that
# `validate-config`, `check` and `serve` all reject a bad file the same way (imported lazily:
# the config layer does not depend on the detectors or the advisor).
_SECTION_PARSERS = {
    "detectors": ("sla_guard.detect.evaluators", "parse_detectors"),
    "advisor": ("sla_guard.scale.config", "parse_advisor"),
}


def _validate_sections(cfg: GuardConfig) -> None:
    import importlib

    problems = []
    for section, (module, func) in _SECTION_PARSERS.items():
        try:
            getattr(importlib.import_module(module), func)(getattr(cfg, section))
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("\n".join(problems))


def parse_config(data: dict[str, Any] | None, where: str = "<config>") -> GuardConfig:
    try:
        cfg = GuardConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, where)) from None
    _validate_sections(cfg)
    return cfg


def load_config(path: str | Path) -> GuardConfig:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {p}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p} is not valid YAML: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of settings, got {type(data).__name__}")
    return parse_config(data, str(p))
