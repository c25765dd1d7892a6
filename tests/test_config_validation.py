"""Broken configurations (issue 13, item 6) are errors, never accepted and never a traceback.

Every variant the adversarial probe found is written as a real YAML file and loaded with
``load_config`` (what ``validate-config``, ``check`` and ``serve`` run): a ``ConfigError`` whose
lines name the field path and the fix. The real ``sla-guard`` CLI exits 2 on them with nothing
but those lines on stderr. A deterministic fuzz mutates a valid config a few hundred ways and
requires every outcome to be either a clean ``ConfigError`` or a config that really loads.
"""

from __future__ import annotations

import copy
import math
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from sla_guard.config import (
    ConfigError,
    GuardConfig,
    PrometheusSource,
    ScrapeSource,
    load_config,
    load_yaml,
    parse_config,
)

ROOT = Path(__file__).resolve().parent.parent
SLA_GUARD = Path(sys.executable).parent / "sla-guard"  # the installed console script, as users run it
HEADER = re.compile(r"^invalid configuration in .+:$")
FIELD_LINE = re.compile(r"^  ([A-Za-z_][\w\-]*(?:\.[\w\-*]+)*): \S")
TOP_FIELDS = set(GuardConfig.model_fields)


def _objectives() -> list[dict[str, Any]]:
    return [
        {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "window": "5m"},
        {"name": "tpot_mean", "indicator": "tpot", "objective": "mean", "threshold_s": 0.02, "window": "5m"},
        {"name": "ttft_p90", "indicator": "ttft", "objective": "percentile", "percentile": 0.9, "threshold_s": 5.0},
        {"name": "ttft_attainment", "indicator": "ttft", "objective": "attainment", "threshold_s": 2.5,
         "target": 0.99, "period": "30d"},
        {"name": "tpot_attainment", "indicator": "tpot", "objective": "attainment", "threshold_s": 0.02,
         "target": 0.99, "period": "30d"},
    ]


def base_config(tmp_path: Path) -> dict[str, Any]:
    """A valid embedded-mode config touching every section the guard validates itself."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    targets = tmp_path / "targets.yaml"
    targets.write_text(yaml.safe_dump([{"targets": ["decode-9:8000"], "labels": {"model": "m", "pool": "decode"}}]))
    return {
        "source": {"mode": "scrape", "interval_s": 5, "timeout_s": 3, "concurrency": 8,
                   "targets": [{"url": "http://prefill-0:8000/metrics", "model": "m", "pool": "prefill", "name": "p0"},
                               {"url": "http://decode-0:8000/metrics", "model": "m", "pool": "decode", "name": "d0"}],
                   "targets_file": str(targets)},
        "slos": [{"model": "*", "pool": "*", "objectives": _objectives()},
                 {"model": "m", "pool": "prefill", "objectives": _objectives()[:1]}],
        "evaluation_interval_s": 15,
        "staleness_s": 60,
        "api": {"listen": "127.0.0.1:8080", "token_file": str(token)},
        "retention": {"duration": "26h", "slots": 1440, "max_series": 200_000},
        "alertmanager": {"url": "http://alertmanager:9093", "timeout_s": 5},
    }


def _write(tmp_path: Path, cfg: dict[str, Any], name: str = "guard.yaml") -> Path:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(cfg))
    return f


def assert_field_lines(msg: str, extra_top: set[str] = frozenset()) -> list[str]:
    """Every line is a header or '  <field path>: <what and fix>'; returns the paths."""
    paths = []
    lines = msg.splitlines()
    assert lines and HEADER.match(lines[0]), msg
    for line in lines[1:]:
        if HEADER.match(line):
            continue
        m = FIELD_LINE.match(line)
        assert m, f"line names no field path: {line!r}\n{msg}"
        assert m.group(1).split(".")[0] in TOP_FIELDS | extra_top, f"not a config field: {line!r}"
        paths.append(m.group(1))
    assert paths, msg
    return paths


def _error(tmp_path: Path, cfg: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, cfg))
    msg = str(info.value)
    assert_field_lines(msg)
    return msg


# --- the probe's variants ----------------------------------------------------------------------

def _set(path: str, value: Any) -> Callable[[dict, Path], None]:
    def mutate(cfg: dict, tmp_path: Path) -> None:
        *head, last = path.split(".")
        node: Any = cfg
        for k in head:
            node = node[int(k)] if isinstance(node, list) else node[k]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return mutate


def _drop(path: str) -> Callable[[dict, Path], None]:
    def mutate(cfg: dict, tmp_path: Path) -> None:
        *head, last = path.split(".")
        node: Any = cfg
        for k in head:
            node = node[int(k)] if isinstance(node, list) else node[k]
        del node[last]
    return mutate


def _both(*fs: Callable[[dict, Path], None]) -> Callable[[dict, Path], None]:
    def mutate(cfg: dict, tmp_path: Path) -> None:
        for f in fs:
            f(cfg, tmp_path)
    return mutate


def _no_targets(cfg: dict, tmp_path: Path) -> None:
    del cfg["source"]["targets"], cfg["source"]["targets_file"]


def _targets_file_dir(cfg: dict, tmp_path: Path) -> None:
    cfg["source"]["targets_file"] = str(tmp_path)


def _token_non_utf8(cfg: dict, tmp_path: Path) -> None:
    (tmp_path / "token").write_bytes(b"\xff\xfe\x00tok")


def _token_dir(cfg: dict, tmp_path: Path) -> None:
    cfg["api"]["token_file"] = str(tmp_path)


def _token_fifo(cfg: dict, tmp_path: Path) -> None:
    import os

    os.mkfifo(tmp_path / "token.fifo")  # was "does not exist", though it does
    cfg["api"]["token_file"] = str(tmp_path / "token.fifo")


def _dup_target(cfg: dict, tmp_path: Path) -> None:
    cfg["source"]["targets"].append({**cfg["source"]["targets"][0], "url": "http://prefill-1:8000/metrics"})


def _dup_url(cfg: dict, tmp_path: Path) -> None:
    for t in cfg["source"]["targets"]:
        t.pop("name")
    cfg["source"]["targets"].append(dict(cfg["source"]["targets"][1]))


def _dup_slo(cfg: dict, tmp_path: Path) -> None:
    cfg["slos"][0]["objectives"].append({**cfg["slos"][0]["objectives"][0], "threshold_s": 3.0})


def _dup_set(cfg: dict, tmp_path: Path) -> None:
    cfg["slos"].append(copy.deepcopy(cfg["slos"][1]))


AVAILABILITY = {"name": "availability", "indicator": "availability", "objective": "attainment", "target": 0.999}


def _availability(pool: str, **change: Any) -> Callable[[dict, Path], None]:
    """A set for ``pool`` with the availability objective, changed by ``change`` (None drops a field)."""
    def mutate(cfg: dict, tmp_path: Path) -> None:
        o = {k: v for k, v in {**AVAILABILITY, **change}.items() if v is not None}
        cfg["slos"].append({"model": "m", "pool": pool, "objectives": [o]})
    return mutate


def _prom(url: str, **extra: Any) -> Callable[[dict, Path], None]:
    def mutate(cfg: dict, tmp_path: Path) -> None:
        cfg["source"] = {"mode": "prometheus", "url": url, **extra}
    return mutate


def _file_parent(field: str) -> Callable[[dict, Path], None]:
    """``field`` (under ``advisor``) names a file whose parent directory is a regular file."""
    def mutate(cfg: dict, tmp_path: Path) -> None:
        (tmp_path / "plain").write_text("a file, not a directory")
        path = str(tmp_path / "plain" / "out")
        if field == "advisor.decision_log":
            cfg["advisor"] = {"decision_log": path}
        else:
            cfg["advisor"] = {"mode": "active", "actuation": {"webhook": {"url": "http://scaler:8080/scale"},
                                                              "leader_election": {"mode": "file", "lock_file": path}}}
    return mutate


INF, NAN = math.inf, math.nan

# (id, mutation, field path named, a word of the fix)
VARIANTS: list[tuple[str, Callable[[dict, Path], None], str, str]] = [
    ("no-targets", _no_targets, "source.scrape.targets", "source.targets_file"),
    ("no-source-at-all", _drop("source"), "source.scrape.targets", "no targets"),
    ("targets-file-missing", _set("source.targets_file", "/nonexistent/targets.yaml"),
     "source.scrape.targets_file", "does not exist"),
    ("targets-file-is-a-directory", _targets_file_dir, "source.scrape.targets_file", "is a directory"),
    ("duplicate-target-name", _dup_target, "source.scrape.targets.2.name", "unique name"),
    ("duplicate-target-url", _dup_url, "source.scrape.targets.2.name", "unique name"),
    ("window-longer-than-ring", _both(_set("retention.slots", 48), _set("slos.0.objectives.0.window", "10m")),
     "slos.0.objectives.0.window", "retention.slots to at least 120"),
    ("window-longer-than-duration", _set("retention.duration", "1m"), "slos.0.objectives.0.window",
     "retention.duration"),
    ("attainment-window-longer-than-ring", _set("slos.0.objectives.3.window", "3h"), "slos.0.objectives.3.window",
     "retention.slots"),
    ("evaluation-interval-longer-than-ring", _both(_set("retention.slots", 8), _set("evaluation_interval_s", 60)),
     "evaluation_interval_s", "evaluate more often"),
    ("ttft-threshold-not-a-bucket", _set("slos.0.objectives.3.threshold_s", 2.7), "slos.0.objectives.3.threshold_s",
     "SLA_GUARD_TTFT_SLO_S=2.7"),
    ("tpot-threshold-not-a-bucket", _set("slos.0.objectives.4.threshold_s", 0.018), "slos.0.objectives.4.threshold_s",
     "engine_buckets: {tpot: [0.018]}"),
    ("threshold-declared-for-the-other-indicator",
     _both(_set("slos.0.objectives.3.threshold_s", 2.7), _set("engine_buckets", {"tpot": [2.7]})),
     "slos.0.objectives.3.threshold_s", "SLA_GUARD_TTFT_SLO_S"),
    ("duplicate-slo-name", _dup_slo, "slos.0.objectives.5.name", "rename"),
    # availability: an error ratio of the client scope's outcomes, with no latency threshold
    ("availability-on-an-engine-pool", _availability("decode"), "slos.2.objectives", "pool: client"),
    ("availability-on-every-pool", _availability("*"), "slos.2.objectives", "pool: client"),
    ("availability-with-a-threshold", _availability("client", threshold_s=2.5), "slos.2.objectives.0",
     "remove threshold_s"),
    ("availability-as-a-mean", _availability("client", objective="mean", target=None), "slos.2.objectives.0",
     "use objective 'attainment'"),
    ("availability-without-target", _availability("client", target=None), "slos.2.objectives.0", "0.999"),
    ("latency-without-threshold", _set("slos.0.objectives.0.threshold_s", None), "slos.0.objectives.0",
     "needs threshold_s"),
    ("duplicate-slo-set", _dup_set, "slos.2", "merge"),
    ("zero-window", _set("slos.0.objectives.0.window", "0s"), "slos.0.objectives.0.window", "greater than zero"),
    ("zero-period", _set("slos.0.objectives.3.period", "0d"), "slos.0.objectives.3.period", "greater than zero"),
    ("negative-window", _set("slos.0.objectives.0.window", "-5m"), "slos.0.objectives.0.window", "e.g. 30s"),
    ("zero-retention", _set("retention.duration", "0s"), "retention.duration", "greater than zero"),
    ("overflowing-duration", _set("slos.0.objectives.0.window", "9" * 400 + "s"), "slos.0.objectives.0.window",
     "too long"),
    ("period-over-400d", _set("slos.0.objectives.3.period", "1000d"), "slos.0.objectives.3.period", "30d"),
    ("interval-inf", _set("source.interval_s", INF), "source.scrape.interval_s", "finite"),
    ("timeout-inf", _set("source.timeout_s", INF), "source.scrape.timeout_s", "finite"),
    ("staleness-inf", _set("staleness_s", INF), "staleness_s", "finite"),
    ("threshold-inf", _set("slos.0.objectives.0.threshold_s", INF), "slos.0.objectives.0.threshold_s", "finite"),
    # the detectors' and advisor's sections too (docs/guard.md: numbers must be finite): an
    # infinite interval never ran the advisor, an infinite ARL silenced a detector, without a word
    ("advisor-interval-inf", _set("advisor", {"interval_s": INF}), "advisor.interval_s", "finite"),
    ("advisor-cooldown-nan", _set("advisor", {"cooldown_s": NAN}), "advisor.cooldown_s", "finite"),
    ("detectors-arl-inf", _set("detectors", {"acceptance": {"arl0_days": INF}}), "detectors.acceptance.arl0_days",
     "finite"),
    ("detectors-leak-eta-inf", _set("detectors", {"leak": {"critical_eta_h": INF}}), "detectors.leak.critical_eta_h",
     "finite"),
    ("evaluation-interval-nan", _set("evaluation_interval_s", NAN), "evaluation_interval_s", "finite"),
    ("percentile-nan", _set("slos.0.objectives.2.percentile", NAN), "slos.0.objectives.2.percentile", "finite"),
    ("target-nan", _set("slos.0.objectives.3.target", NAN), "slos.0.objectives.3.target", "finite"),
    ("alertmanager-timeout-nan", _set("alertmanager.timeout_s", NAN), "alertmanager.timeout_s", "finite"),
    ("engine-bucket-nan", _set("engine_buckets", {"ttft": [NAN]}), "engine_buckets.ttft.0", "finite"),
    ("prometheus-url-no-scheme", _prom("prometheus:9090"), "source.prometheus.url", "http://"),
    ("prometheus-url-no-host", _prom("http://"), "source.prometheus.url", "with a host"),
    ("prometheus-url-bad-port", _prom("http://prometheus:99999"), "source.prometheus.url", "valid URL"),
    ("target-url-not-http", _set("source.targets.0.url", "ftp://x/metrics"), "source.scrape.targets.0.url",
     "http://"),
    ("alertmanager-url-not-a-url", _set("alertmanager.url", "alertmanager"), "alertmanager.url", "http://"),
    # the file is not a shell template: '${HOST}' passed validation and every scrape failed on DNS
    ("target-url-env-variable", _set("source.targets.0.url", "http://${PREFILL_HOST}:8000/metrics"),
     "source.scrape.targets.0.url", "environment variables are not expanded"),
    ("prometheus-url-env-variable", _prom("http://${PROM_HOST}:9090"), "source.prometheus.url",
     "environment variables are not expanded"),
    ("alertmanager-url-spaces", _set("alertmanager.url", "http://alert manager:9093"), "alertmanager.url",
     "http://"),
    ("listen-port-99999", _set("api.listen", "0.0.0.0:99999"), "api.listen", "1..65535"),
    ("listen-port-0", _set("api.listen", "127.0.0.1:0"), "api.listen", "1..65535"),
    ("listen-port-not-numeric", _set("api.listen", "127.0.0.1:http"), "api.listen", "HOST:PORT"),
    ("listen-no-port", _set("api.listen", "127.0.0.1"), "api.listen", "HOST:PORT"),
    ("listen-int", _set("api.listen", 8080), "api.listen", "string"),
    ("token-file-missing", _set("api.token_file", "/nonexistent/token"), "api.token_file", "api.token_env"),
    ("token-file-is-a-directory", _token_dir, "api.token_file", "is a directory"),
    ("token-file-is-a-fifo", _token_fifo, "api.token_file", "is not a regular file"),
    ("token-file-not-utf8", _token_non_utf8, "api.token_file", "UTF-8"),
    ("slos-empty", _set("slos", []), "slos", "at least one"),
    ("objectives-empty", _set("slos.0.objectives", []), "slos.0.objectives", "at least one"),
    ("store-bound-absurd", _both(_set("retention.max_series", 10_000_000), _set("retention.slots", 100_000)),
     "retention.max_series", "7,450.6 GiB"),
    ("mode-unknown", _set("source.mode", "prom"), "source", "'scrape' (the default) or 'prometheus'"),
    ("timeout-longer-than-interval", _set("source.timeout_s", 10), "source.scrape.timeout_s",
     "scrape_timeout <= scrape_interval"),
    ("url-credentials-and-bearer", _prom("http://user:pw@prometheus:9090", bearer_token_env="PROM_TOKEN"),
     "source.prometheus.url", "bearer_token_env"),
    ("unknown-key", _set("retention.slot", 10), "retention.slot", "unknown field"),
    # no coercion across types (spec_base.Strict): YAML `true` is not 1.0, `'5'` is not 5
    ("interval-bool", _set("source.interval_s", True), "source.scrape.interval_s",
     "expected a number (e.g. 5 or 0.25), not a boolean"),
    ("interval-string", _set("source.interval_s", "5"), "source.scrape.interval_s", "write it without quotes"),
    ("concurrency-bool", _set("source.concurrency", True), "source.scrape.concurrency",
     "expected a whole number (e.g. 5), not a boolean"),
    ("concurrency-string", _set("source.concurrency", "8"), "source.scrape.concurrency", "write it without quotes"),
    ("concurrency-decimal", _set("source.concurrency", 8.0), "source.scrape.concurrency", "write 8"),
    ("detectors-float-bool", _set("detectors", {"leak": {"critical_eta_h": True}}), "detectors.leak.critical_eta_h",
     "not a boolean"),
    ("detectors-bool-number", _set("detectors", {"leak": {"enabled": 1}}), "detectors.leak.enabled",
     "expected true or false"),
    ("advisor-int-string", _set("advisor", {"pools": {"decode": {"max_replicas": "4"}}}),
     "advisor.pools.decode.max_replicas", "write it without quotes"),
    ("threshold-string", _set("slos.0.objectives.0.threshold_s", "2.5"), "slos.0.objectives.0.threshold_s",
     "not a string"),
    # files the running guard writes: a parent that is a file crashed `serve` at start with a
    # traceback (the decision log) or left it a standby for good (the lock file)
    ("decision-log-under-a-file", _file_parent("advisor.decision_log"), "advisor.decision_log",
     "is not a directory"),
    ("decision-log-is-a-directory", lambda cfg, tmp: cfg.__setitem__("advisor", {"decision_log": str(tmp)}),
     "advisor.decision_log", "decisions.jsonl"),
    ("lock-file-under-a-file", _file_parent("advisor.actuation.leader_election.lock_file"),
     "advisor.actuation.leader_election.lock_file", "is not a directory"),
    # actuation targets that passed validation and failed at the first scaling decision
    ("k8s-actuation-pool-typo", _set("advisor", {"mode": "active", "actuation": {"kubernetes": {
        "prefil": {"name": "glm-prefill"}}}}), "advisor.actuation.kubernetes.prefil", "'prefill' or 'decode'"),
    ("webhook-url-not-a-url", _set("advisor", {"mode": "active", "actuation": {"webhook": {"url": "scaler:80"}}}),
     "advisor.actuation.webhook.url", "http://"),
]


@pytest.mark.parametrize(("mutate", "field", "fix"), [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_broken_variant_is_a_config_error_naming_the_field(tmp_path, mutate, field, fix):
    cfg = base_config(tmp_path)
    mutate(cfg, tmp_path)
    msg = _error(tmp_path, cfg)
    assert any(line.startswith(f"  {field}: ") for line in msg.splitlines()), msg
    assert fix in msg, msg


def test_base_config_is_valid(tmp_path):
    cfg = load_config(_write(tmp_path, base_config(tmp_path)))
    assert isinstance(cfg.source, ScrapeSource) and len(cfg.source.targets) == 2
    assert cfg.api.token() == "s3cret"


def test_programmatic_default_stays_constructible():
    """GuardConfig() / parse_config({}) are the defaults of tests, the simulator, `generate` and
    the benchmarks (their store is built outside the config): only a loaded file must name targets."""
    assert isinstance(GuardConfig().source, ScrapeSource)
    assert parse_config({}).source.targets == []


def test_yaml_numbers_are_numbers_and_only_numbers(tmp_path):
    """An int is a float (interval_s: 5); YAML 1.2 exponents without a dot or a sign (1e-3, 6e1),
    which PyYAML alone reads as strings, are numbers; the same text quoted stays a string and is
    refused, as is a boolean (before: `true` ran as 1.0, `'5'` as 5.0)."""
    cfg = base_config(tmp_path)
    text = yaml.safe_dump(cfg).replace("staleness_s: 60", "staleness_s: 6e1")
    f = tmp_path / "guard.yaml"
    f.write_text(text)
    loaded = load_config(f)
    assert loaded.staleness_s == 60.0 and isinstance(loaded.staleness_s, float)
    assert loaded.source.interval_s == 5.0 and isinstance(loaded.source.interval_s, float)
    for bad, word in (("'6e1'", "not a string"), ("true", "not a boolean"), ('"60"', "without quotes")):
        f.write_text(text.replace("staleness_s: 6e1", f"staleness_s: {bad}"))
        with pytest.raises(ConfigError) as info:
            load_config(f)
        lines = [ln for ln in str(info.value).splitlines() if ln.startswith("  staleness_s: ")]
        assert lines and word in lines[0] and "number" in lines[0], str(info.value)


def test_text_that_yaml_reads_as_a_boolean_or_number_says_to_quote_it(tmp_path):
    """YAML 1.1 reads `on`/`no` as booleans, and the loader now reads `1e5` as a number (which
    yaml.safe_dump writes unquoted for the string "1e5"): a text field given one said only
    "Input should be a valid string (got 100000.0)", not what to do."""
    f = tmp_path / "guard.yaml"
    for field, bad, got in (("model", "on", "a boolean"), ("model", "1e5", "a number"), ("name", "no", "a boolean")):
        cfg = base_config(tmp_path)
        cfg["source"]["targets"][1][field] = "HERE"
        f.write_text(yaml.safe_dump(cfg).replace("HERE", bad))
        with pytest.raises(ConfigError) as info:
            load_config(f)
        lines = [ln for ln in str(info.value).splitlines() if ln.startswith(f"  source.scrape.targets.1.{field}: ")]
        assert lines and f"expected a string, not {got}" in lines[0] and "quote text" in lines[0], str(info.value)
        f.write_text(yaml.safe_dump(cfg).replace("HERE", f"'{bad}'"))
        assert getattr(load_config(f).source.targets[1], field) == bad


def test_a_word_yaml_reads_as_a_boolean_in_a_choice_field_says_to_quote_it(tmp_path):
    """`mode: on`, `synchronous: off`: a field that lists its words (a Literal or an enum) said
    only "Input should be 'advisory' or 'active' (got True)"."""
    f = tmp_path / "guard.yaml"
    for section, field, word in (("advisor", "mode", "on"), ("state", "synchronous", "off")):
        cfg = base_config(tmp_path)
        cfg[section] = {**cfg.get(section, {}), field: "HERE"}
        f.write_text(yaml.safe_dump(cfg).replace("HERE", word))
        with pytest.raises(ConfigError) as info:
            load_config(f)
        lines = [ln for ln in str(info.value).splitlines() if ln.startswith(f"  {section}.{field}: ")]
        assert lines and "booleans: write the word in quotes" in lines[0], str(info.value)


def test_paths_and_enums_still_read_from_yaml_strings(tmp_path):
    """strict mode refuses str -> Path and str -> enum; those fields relax it, since YAML has no
    other way to write them."""
    from sla_guard.config import Indicator, Objective

    cfg = load_config(_write(tmp_path, base_config(tmp_path)))
    assert isinstance(cfg.source.targets_file, Path) and isinstance(cfg.api.token_file, Path)
    assert cfg.slos[0].objectives[0].indicator is Indicator.TTFT
    assert cfg.slos[0].objectives[0].objective is Objective.MEAN
    assert isinstance(parse_config({"state": {"path": str(tmp_path / "s.db")}}).state.path, Path)


def test_profile_numbers_are_not_coerced(tmp_path):
    """The simulator's profiles share the base model: a boolean or a quoted number is an error
    naming the field; the shipped profile's 1.72e12-style numbers still load."""
    from sla_guard.sim.profile import PROFILE_DIR, ProfileError, load_profile

    text = (PROFILE_DIR / "default.yaml").read_text()
    assert load_profile("default").kv.cpu_offload_bytes == 1.72e12
    data = load_yaml(text)
    for field, value, word in (("step_base_s", True, "not a boolean"), ("chunk_tokens", "2048", "without quotes")):
        broken = copy.deepcopy(data)
        broken["prefill"][field] = value
        f = tmp_path / f"{field}.yaml"
        f.write_text(yaml.safe_dump(broken))
        with pytest.raises(ProfileError) as info:
            load_profile(f)
        assert f"  prefill.{field}: " in str(info.value) and word in str(info.value), str(info.value)


def test_source_without_mode_is_scrape(tmp_path):
    cfg = base_config(tmp_path)
    del cfg["source"]["mode"]
    assert isinstance(load_config(_write(tmp_path, cfg)).source, ScrapeSource)


def test_declared_engine_bucket_makes_a_threshold_usable(tmp_path):
    cfg = base_config(tmp_path)
    cfg["slos"][0]["objectives"][3]["threshold_s"] = 2.7
    cfg["engine_buckets"] = {"ttft": [2.7]}
    assert load_config(_write(tmp_path, cfg)).engine_buckets.ttft == [2.7]


def test_availability_of_the_client_scope_loads(tmp_path):
    """No threshold, so no bucket to check; a file is checked as ``serve`` would run it."""
    from sla_guard.config import Indicator

    cfg = base_config(tmp_path)
    _availability("client")(cfg, tmp_path)
    o = load_config(_write(tmp_path, cfg)).slos_for("m", "client")[0]
    assert o.indicator is Indicator.AVAILABILITY and o.threshold_s is None and o.target == 0.999


def test_unset_timeout_follows_a_short_interval(tmp_path):
    """As in Prometheus: only an explicit timeout longer than the interval is an error."""
    cfg = base_config(tmp_path)
    cfg["source"].pop("timeout_s")
    cfg["source"]["interval_s"] = 1
    assert load_config(_write(tmp_path, cfg)).source.timeout_s == 1


def test_credentials_or_bearer_alone_are_fine(tmp_path):
    cfg = base_config(tmp_path)
    cfg["source"] = {"mode": "prometheus", "url": "http://user:pw@prometheus:9090"}
    assert isinstance(load_config(_write(tmp_path, cfg)).source, PrometheusSource)
    cfg["source"] = {"mode": "prometheus", "url": "http://prometheus:9090", "bearer_token_env": "T"}
    assert load_config(_write(tmp_path, cfg)).source.bearer_token_env == "T"


def test_honor_labels_is_opt_in(tmp_path):
    cfg = base_config(tmp_path)
    cfg["source"]["targets"][0]["honor_labels"] = True
    targets = load_config(_write(tmp_path, cfg)).source.targets
    assert [t.honor_labels for t in targets] == [True, False]


def test_many_problems_one_line_each(tmp_path):
    cfg = base_config(tmp_path)
    _dup_target(cfg, tmp_path)
    _dup_slo(cfg, tmp_path)
    paths = assert_field_lines(_error(tmp_path, cfg))
    assert paths == ["source.scrape.targets.2.name", "slos.0.objectives.5.name"]


def test_a_key_indented_into_the_wrong_section_says_where_it_belongs(tmp_path):
    """`targets:` one indent too far left lands at the top level, `token_env:` beside `api:`; a
    misspelt key inside a section. Each said "unknown field; remove it or check its spelling":
    the spelling was right, and removing the key loses the targets. The line now names the
    section the key belongs to, or the field it is closest to."""
    f = tmp_path / "guard.yaml"
    f.write_text("source:\n  mode: scrape\n  intervall_s: 5\n"
                 "targets:\n  - {url: 'http://d0:8000/metrics', model: m, pool: decode}\n"
                 "api:\n  listen: 127.0.0.1:8080\ntoken_env: SLA_GUARD_TOKEN\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    lines = str(err.value).splitlines()
    assert any(ln.startswith("  targets: ") and "a field of source" in ln and "indentation" in ln
               for ln in lines), lines
    assert any(ln.startswith("  token_env: ") and "a field of api" in ln for ln in lines), lines
    assert any(ln.startswith("  source.scrape.intervall_s: ") and "did you mean 'interval_s'" in ln
               for ln in lines), lines


def test_non_utf8_config_is_a_config_error(tmp_path):
    f = tmp_path / "guard.yaml"
    f.write_bytes(b"source: {targets: [{url: 'http://e\xff0:8000/metrics'}]}\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(f)


def test_every_shipped_config_validates(monkeypatch):
    """examples/ and the compose guard config, as `validate-config` reads them from the repo root."""
    monkeypatch.chdir(ROOT)  # examples/guard-scrape.yaml names examples/targets.yaml
    monkeypatch.setenv("SLA_GUARD_TOKEN", "x")
    files = [*sorted((ROOT / "examples").glob("guard-*.yaml")), ROOT / "deploy/compose/sla-guard/guard.yaml"]
    assert len(files) >= 3
    for f in files:
        assert load_config(f).slos, f


def _doc_config_snippets() -> list[tuple[str, str]]:
    """Every ```yaml block of README.md and docs/*.md that is a mapping with a guard config section
    among its keys (other YAML there, such as recording rules, is left out; a misspelt section next
    to a real one is kept, and refused), as (file:line, text)."""
    out = []
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = f.read_text(encoding="utf-8")
        for m in re.finditer(r"^```ya?ml\n(.*?)^```", text, re.S | re.M):
            data = load_yaml(m.group(1))
            if isinstance(data, dict) and set(data) & TOP_FIELDS:
                out.append((f"{f.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return out


def test_every_config_snippet_in_the_docs_validates():
    """A user copies a block from the docs into guard.yaml: it must be a valid config (the fields,
    their types and their combinations; deployment checks need the user's own hosts and paths).
    The scaling page's leader-election block had a `{...}` placeholder and lacked advisor.model."""
    snippets = _doc_config_snippets()
    assert len(snippets) >= 7, snippets
    for where, text in snippets:
        try:
            parse_config(load_yaml(text), where)
        except ConfigError as err:
            pytest.fail(str(err))


# --- the real CLI ------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SLA_GUARD), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _broken_file(tmp_path: Path, variant: str) -> Path:
    cfg = base_config(tmp_path)
    dict((v[0], v[1]) for v in VARIANTS)[variant](cfg, tmp_path)
    return _write(tmp_path, cfg)


@pytest.mark.parametrize(("command", "variant", "field"), [
    ("validate-config", "listen-port-99999", "api.listen"),
    ("validate-config", "token-file-not-utf8", "api.token_file"),
    ("validate-config", "no-targets", "source.scrape.targets"),
    ("validate-config", "interval-inf", "source.scrape.interval_s"),
    ("validate-config", "interval-bool", "source.scrape.interval_s"),
    ("check", "ttft-threshold-not-a-bucket", "slos.0.objectives.3.threshold_s"),
    ("check", "timeout-longer-than-interval", "source.scrape.timeout_s"),
    ("check", "token-file-not-utf8", "api.token_file"),
    ("serve", "listen-port-99999", "api.listen"),
    ("serve", "decision-log-under-a-file", "advisor.decision_log"),
    ("validate-config", "k8s-actuation-pool-typo", "advisor.actuation.kubernetes.prefil"),
])
def test_cli_exits_2_naming_the_field(tmp_path, command, variant, field):
    f = _broken_file(tmp_path, variant)
    r = _cli(*([command, str(f)] if command == "validate-config" else [command, "--config", str(f)]))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"  {field}: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert_field_lines(r.stderr.strip())


def test_cli_reminds_how_declared_buckets_must_be_started(tmp_path):
    cfg = base_config(tmp_path)
    cfg["slos"][0]["objectives"][3]["threshold_s"] = 2.7
    cfg["engine_buckets"] = {"ttft": [2.7]}
    r = _cli("validate-config", str(_write(tmp_path, cfg)))
    assert r.returncode == 0, r.stderr
    assert "start every engine with SLA_GUARD_TTFT_SLO_S=2.7" in r.stdout


def test_cli_non_utf8_config(tmp_path):
    f = tmp_path / "guard.yaml"
    f.write_bytes(b"api: {listen: '127.0.0.1:8080'}\n# caf\xe9\n")
    for args in (["validate-config", str(f)], ["check", "--config", str(f)]):
        r = _cli(*args)
        assert r.returncode == 2 and "not UTF-8" in r.stderr and "Traceback" not in r.stderr, r.stderr


# --- fuzz --------------------------------------------------------------------------------------

def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _get(node: Any, path: tuple) -> Any:
    for k in path:
        node = node[k]
    return node


BAD_VALUES: list[Any] = [0, -1, INF, -INF, NAN, 10**30, "abc", "", None, [], {}, True, [1, 2], {"x": 1}]
BAD_URLS = ["ftp://x", "http://", "not a url", "http://h:99999/", "//h:80", "http://a b/", "http:///metrics"]
BAD_DURATIONS = ["0s", "0", "5", "-1m", "1y", "", "5 m", "9" * 400 + "s", "1.5.5m", "m5"]


def _mutate(rng: random.Random, cfg: dict, tmp_path: Path) -> str:
    """One mutation in place (none where an earlier one removed its place); its description."""
    try:
        return _mutate_once(rng, cfg)
    except (KeyError, IndexError, TypeError):
        return "no-op"


def _mutate_once(rng: random.Random, cfg: dict) -> str:
    kind = rng.choice(["drop", "value", "section", "duplicate", "url", "duration", "unknown"])
    paths = _paths(cfg)
    if kind == "drop":
        path = rng.choice([p for p in paths if isinstance(p[-1], str)])
        del _get(cfg, path[:-1])[path[-1]]
    elif kind == "value":
        path = rng.choice(paths)
        value = copy.deepcopy(rng.choice(BAD_VALUES))
        _get(cfg, path[:-1])[path[-1]] = value
        return f"{kind} {'.'.join(map(str, path))}={value!r}"
    elif kind == "section":
        path = (rng.choice(["source", "slos", "api", "retention", "alertmanager", "engine_buckets"]),)
        cfg[path[0]] = copy.deepcopy(rng.choice([5, "x", [1], {"bogus": 1}, None, [{"a": 1}], True]))
    elif kind == "duplicate":
        where = rng.choice([("source", "targets"), ("slos",), ("slos", 0, "objectives"), ("slos", 1, "objectives")])
        items = _get(cfg, where) if _is_list(cfg, where) else None
        if not items:
            return "duplicate of nothing"
        items.append(copy.deepcopy(rng.choice(items)))
        path = where
    elif kind == "url":
        path = rng.choice([("source", "targets", 0, "url"), ("alertmanager", "url"), ("source", "targets", 1, "url")])
        _get(cfg, path[:-1])[path[-1]] = rng.choice(BAD_URLS)
    elif kind == "duration":
        path = rng.choice([("slos", 0, "objectives", rng.randrange(5), "window"),
                           ("slos", 0, "objectives", 3, "period"), ("retention", "duration")])
        _get(cfg, path[:-1])[path[-1]] = rng.choice(BAD_DURATIONS)
    else:
        parents = [p for p in paths if isinstance(_get(cfg, p), dict)] + [()]
        path = rng.choice(parents)
        _get(cfg, path)["bogus_key"] = 1
    return f"{kind} {'.'.join(map(str, path))}"


def _is_list(cfg: dict, path: tuple) -> bool:
    try:
        return isinstance(_get(cfg, path), list)
    except (KeyError, IndexError, TypeError):
        return False


def test_fuzz_broken_configs_are_config_errors(tmp_path):
    rng = random.Random(20240613)
    generated = rejected = accepted = 0
    others: list[str] = []
    rejected_files: list[Path] = []
    for i in range(300):
        d = tmp_path / f"c{i}"
        d.mkdir()
        cfg = base_config(d)
        what = [_mutate(rng, cfg, d) for _ in range(rng.choice([1, 1, 2, 3]))]
        f = _write(d, cfg)
        generated += 1
        try:
            loaded = load_config(f)
        except ConfigError as err:
            rejected += 1
            rejected_files.append(f)
            assert_field_lines(str(err), extra_top={"bogus_key"})
            continue
        except Exception as err:  # the point of the test: nothing but ConfigError
            others.append(f"{what}: {type(err).__name__}: {err}")
            continue
        assert isinstance(loaded, GuardConfig)
        accepted += 1
    print(f"\nfuzz: {generated} generated, {rejected} rejected (ConfigError, field lines), "
          f"{accepted} accepted as valid, {len(others)} other exceptions")
    assert others == []
    assert generated == 300 and rejected + accepted == generated
    assert rejected >= 0.8 * generated  # the mutations are meant to break; most must be caught

    # the real CLI on a sample: exit 2, the same lines, never a traceback
    for f in random.Random(7).sample(rejected_files, 20):
        r = _cli("validate-config", str(f))
        assert r.returncode == 2, (f.read_text(), r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        assert_field_lines(r.stderr.strip(), extra_top={"bogus_key"})
