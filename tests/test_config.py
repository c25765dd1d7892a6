"""The configuration file: every error names the field path, the bad value and the fix, for the
guard's own fields and for the sections the detectors and the advisor own."""

import re
import subprocess
import sys

import pytest

from sla_guard.config import ConfigError, load_config, parse_config


def _error(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "guard.yaml")
    return str(info.value)


def test_defaults_are_the_seed_slas():
    cfg = parse_config(None)
    objectives = {s.name: s for s in cfg.slos_for("any", "decode")}
    assert objectives["ttft_mean"].threshold_s == 2.5
    assert objectives["tpot_mean"].threshold_s == 0.020


def test_errors_name_path_value_and_fix():
    msg = _error({"source": {"mode": "scrape", "targets": [{"url": "ftp://x", "pool": "pre"}]},
                  "evaluation_interval_s": -1, "retenton": {}})
    assert "guard.yaml" in msg
    assert "source.scrape.targets.0.url" in msg and "http://" in msg and "'ftp://x'" in msg
    assert "source.scrape.targets.0.pool" in msg and "'prefill', 'decode', 'mixed' or 'client'" in msg
    assert "evaluation_interval_s" in msg and "greater than 0" in msg
    assert "retenton: unknown field; did you mean 'retention'?" in msg


def test_objective_needs_its_parameter():
    msg = _error({"slos": [{"objectives": [{"name": "p", "indicator": "ttft", "objective": "percentile",
                                             "threshold_s": 1}]}]})
    assert "slos.0.objectives.0" in msg and "needs 'percentile'" in msg


def test_a_threshold_in_milliseconds_is_refused_with_its_value_in_seconds():
    """2500 for a 2.5 s TTFT (or 20 for a 20 ms TPOT) passed, and judged every breach "ok"."""
    msg = _error({"slos": [{"objectives": [
        {"name": "t", "indicator": "ttft", "objective": "mean", "threshold_s": 2500},
        {"name": "o", "indicator": "tpot", "objective": "mean", "threshold_s": 20}]}]})
    assert "slos.0.objectives.0" in msg and "threshold_s 2500 is over 160 s" in msg and "threshold_s: 2.5" in msg
    assert "slos.0.objectives.1" in msg and "threshold_s: 0.02" in msg
    parse_config({"slos": [{"objectives": [{"name": "t", "indicator": "ttft", "objective": "mean",
                                            "threshold_s": 160}]}]})  # the histogram's last bucket: allowed


def test_detector_and_advisor_sections_are_validated_at_load():
    msg = _error({"detectors": {"leak": {"limit_bytes": -5}}, "advisor": {"mode": "actve"}})
    assert "detectors.leak.limit_bytes" in msg and "(got -5)" in msg
    assert "advisor.mode" in msg and "'actve'" in msg


def test_default_slas_of_a_set_give_a_prefill_pool_ttft_only():
    """A set that leaves ``objectives`` out gets the default SLAs, and for a prefill pool those are
    the TTFT ones (one token per request: TPOT objectives would wait forever); objectives the
    set lists are kept as written."""
    cfg = parse_config({"slos": [{"model": "m"}, {"model": "n", "pool": "prefill"}]})
    ttft_only = ["ttft_mean", "ttft_p90", "ttft_attainment"]
    assert [o.name for o in cfg.slos_for("m", "prefill")] == ttft_only
    assert [o.name for o in cfg.slos_for("n", "prefill")] == ttft_only
    assert len(cfg.slos_for("m", "decode")) == 5
    tpot_mean = {"name": "tpot_mean", "indicator": "tpot", "objective": "mean", "threshold_s": 0.02}
    listed = parse_config({"slos": [{"objectives": [tpot_mean]}]})
    assert [o.name for o in listed.slos_for("m", "prefill")] == ["tpot_mean"]


def test_a_partial_prefix_hit_section_keeps_the_prefix_defaults():
    """``prefix_hit: {arl0_days: 60}`` (fewer false alarms) replaced the section with the acceptance
    detector's defaults: no hold after a restart, tolerance 0.02, no load hold (the tuning that took
    false alarms from one per 0.6 d to weeks, docs/detectors.md); keys left out keep prefix_hit's own."""
    default = parse_config(None).detectors.prefix_hit
    given = parse_config({"detectors": {"prefix_hit": {"arl0_days": 60}}}).detectors.prefix_hit
    assert given.arl0_days == 60
    assert given.model_dump(exclude={"arl0_days"}) == default.model_dump(exclude={"arl0_days"})
    assert default.reset_hold_s == 3600 and default.tolerance == 0.03 and default.load_hold_ratio == 1.6
    assert parse_config({"detectors": {"prefix_hit": {"tolerance": 0.05}}}).detectors.prefix_hit.tolerance == 0.05


def test_most_specific_slo_set_wins():
    cfg = parse_config({"slos": [
        {"model": "*", "pool": "*"},
        {"model": "m", "pool": "decode", "objectives": [
            {"name": "tpot_mean", "indicator": "tpot", "objective": "mean", "threshold_s": 0.03}]},
    ]})
    assert [s.threshold_s for s in cfg.slos_for("m", "decode")] == [0.03]
    assert len(cfg.slos_for("m", "mixed")) == 5


@pytest.mark.parametrize(("text", "rc", "needle"), [
    ("source: {targets: [{url: 'http://e0:8000/metrics'}]}\nevaluation_interval_s: 10\n", 0, "ok: source=scrape"),
    ("evaluation_interval_s: 10\n", 2, "source.scrape.targets: no targets"),
    ("advisor: {mode: actve}\n", 2, "advisor.mode"),
    ("- just\n- a list\n", 2, "top level must be a mapping"),
    ("source: {mode: scrape\n", 2, "not valid YAML"),
    # an SLO set for a pool no target serves waits for data for ever: said, not silently "ok"
    ("source: {targets: [{url: 'http://e0:8000/metrics', pool: decode}]}\nslos: [{pool: client, objectives: "
     "[{name: avail, indicator: availability, objective: attainment, target: 0.999}]}]\n", 0,
     "note: slos[0] is for pool 'client' but no target has pool: client"),
])
def test_validate_config_cli(tmp_path, text, rc, needle):
    f = tmp_path / "guard.yaml"
    f.write_text(text)
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "validate-config", str(f)],
                       capture_output=True, text=True)
    assert r.returncode == rc, r.stderr
    assert needle in r.stdout + r.stderr


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a staleness_s: 1 further down silently replaced
    the 60 above it."""
    f = tmp_path / "g.yaml"
    f.write_text("staleness_s: 60\nevaluation_interval_s: 15\nstaleness_s: 1\n")
    with pytest.raises(ConfigError, match=r"key 'staleness_s' is given twice \(first on line 1\)"):
        load_config(f)


def test_a_file_sd_group_with_a_misspelt_key_is_refused(tmp_path):
    """'label:' for 'labels:' dropped every label: the targets ran as model default, pool mixed."""
    t = tmp_path / "targets.yaml"
    t.write_text("- targets: ['127.0.0.1:9']\n  label: {model: m, pool: prefill}\n")
    f = tmp_path / "g.yaml"
    f.write_text(f"source: {{targets_file: {t}}}\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) label in a file_sd group"):
        load_config(f)
    t.write_text("- targets: ['127.0.0.1:9']\n  labels: {model: m, pool: prefill, job: vllm}\n")  # free labels
    assert load_config(f).source.targets_file == t


def test_staleness_must_outlast_a_scrape_and_stay_under_a_day():
    msg = _error({"staleness_s": 1, "source": {"interval_s": 5}})
    assert "staleness_s 1 is shorter than source.interval_s 5" in msg and "(10)" in msg
    assert "over a day" in _error({"staleness_s": 1e9})


def test_a_setting_the_objective_does_not_read_is_refused():
    """objective: mean with a target, a percentile or a period: each was ignored without a word,
    where the writer meant another objective."""
    msg = _error({"slos": [{"objectives": [
        {"name": "m", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "target": 0.99,
         "period": "7d"},
        {"name": "p", "indicator": "ttft", "objective": "percentile", "threshold_s": 2.5, "percentile": 0.9,
         "target": 0.99}]}]})
    assert "slos.0.objectives.0" in msg and "'mean' does not use target or period" in msg
    assert "slos.0.objectives.1" in msg and "'percentile' does not use target" in msg


def test_a_window_shorter_than_a_scrape_interval_is_a_deployment_problem(tmp_path):
    f = tmp_path / "g.yaml"
    f.write_text("source: {interval_s: 5, targets: [{url: 'http://127.0.0.1:9/metrics'}]}\n"
                 "slos: [{objectives: [{name: m, indicator: ttft, objective: mean, threshold_s: 2.5, "
                 "window: 1ms}]}]\n")
    with pytest.raises(ConfigError, match=r"slos.0.objectives.0.window.*never holds two scrapes.*at least 10s"):
        load_config(f)


@pytest.mark.parametrize(("text", "said"), [
    ("evaluation_interval_s: 010\n", "010 is an octal number in YAML 1.1 (read as 8): write 10 without the leading"),
    ("evaluation_interval_s: 1:30\n", "1:30 is a base-60 number in YAML 1.1 (read as 90)"),
    ("staleness_s: 1:30.5\n", "1:30.5 is a base-60 number in YAML 1.1 (read as 90.5)"),
])
def test_yaml_11_octal_and_base_60_numbers_are_refused_by_name(tmp_path, text, said):
    """PyYAML follows YAML 1.1: ``010`` loaded as 8 and ``1:30`` as 90, silently. Both are refused
    with what YAML made of them and the fix; YAML 1.2 forms (10, 0x10, 1e-3, quoted text) load."""
    f = tmp_path / "g.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(f)
    f.write_text("evaluation_interval_s: 10\nstaleness_s: 60.0\nsource: {targets: [{url: 'http://127.0.0.1:9/metrics', "
                 "name: '010'}]}\n")
    cfg = load_config(f)
    assert cfg.evaluation_interval_s == 10 and cfg.source.targets[0].name == "010"


def test_yaml_merge_keys_load_and_override(tmp_path):
    """``<<: *first`` (YAML merge keys) failed to load: the duplicate-key check built the ``<<``
    key itself, which has no constructor. Merged keys load; the mapping's own keys win."""
    f = tmp_path / "g.yaml"
    f.write_text("source: {targets: [{url: 'http://127.0.0.1:9/metrics'}]}\nslos:\n- model: m\n  pool: decode\n"
                 "  objectives:\n"
                 "  - &first {name: ttft_mean, indicator: ttft, objective: mean, threshold_s: 2.5, min_requests: 5}\n"
                 "  - {<<: *first, name: tpot_mean, indicator: tpot, threshold_s: 0.02}\n")
    objectives = load_config(f).slos[0].objectives
    assert [(o.name, o.indicator, o.threshold_s, o.min_requests) for o in objectives] == [
        ("ttft_mean", "ttft", 2.5, 5), ("tpot_mean", "tpot", 0.02, 5)]
    f.write_text(f.read_text() + "  - {<<: *first, name: x, name: y}\n")
    with pytest.raises(ConfigError, match="given twice"):
        load_config(f)
