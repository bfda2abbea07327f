"""elasticd.config.load: sources and their order, validation, and the shipped sample file."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from elasticd import config
from elasticd.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "packaging" / "elasticd.toml"
SETTING_LINE = re.compile(r"^# ([a-z_]+) = ")


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "elasticd.toml"
    path.write_text(text)
    return str(path)


def _load(path: str, env: dict | None = None, overrides: dict | None = None) -> config.Config:
    # env={} always: the host's own ELASTICD_* variables must not leak in.
    return config.load(path=path, env=env or {}, overrides=overrides)


def _errors(excinfo) -> list[str]:
    return excinfo.value.errors


def _without_source(cfg: config.Config) -> config.Config:
    return dataclasses.replace(cfg, source="")


# --- the sample file, packaging/elasticd.toml ---

def test_sample_as_shipped_gives_the_defaults(tmp_path):
    cfg = _load(str(SAMPLE))
    assert cfg.source == str(SAMPLE)
    assert _without_source(cfg) == _without_source(_load(_write(tmp_path, "")))
    assert cfg.agent == config.AgentSettings()
    assert cfg.etcd == config.EtcdSettings()


def test_sample_lists_every_setting_once_with_its_default(tmp_path):
    listed: dict[str, list[str]] = {}
    section = None
    for line in SAMPLE.read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
            continue
        m = SETTING_LINE.match(line)
        if m:
            listed.setdefault(section, []).append(m.group(1))
    expected = {s: [f.name for f in dataclasses.fields(cls)] for s, cls in config.SECTIONS.items()}
    assert listed == expected, "packaging/elasticd.toml drifted from elasticd.config"


def test_sample_with_every_line_uncommented_still_loads_to_the_defaults(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    uncommented = [line[2:] if SETTING_LINE.match(line) else line for line in lines]
    assert uncommented != lines
    cfg = _load(_write(tmp_path, "\n".join(uncommented) + "\n"))
    assert _without_source(cfg) == _without_source(_load(str(SAMPLE)))


# --- sources and their order ---

def test_file_value_is_used(tmp_path):
    cfg = _load(_write(tmp_path, "[agent]\nstop_grace_period = 7\n"))
    assert cfg.agent.stop_grace_period == 7.0


def test_env_wins_over_file(tmp_path):
    path = _write(tmp_path, "[agent]\nstop_grace_period = 7\n")
    cfg = _load(path, env={"ELASTICD_AGENT_STOP_GRACE_PERIOD": "2.5"})
    assert cfg.agent.stop_grace_period == 2.5


def test_flags_win_over_env(tmp_path):
    path = _write(tmp_path, "[agent]\nstop_grace_period = 7\n")
    cfg = _load(path, env={"ELASTICD_AGENT_STOP_GRACE_PERIOD": "2.5"},
                overrides={"agent.stop_grace_period": 1})
    assert cfg.agent.stop_grace_period == 1.0


def test_env_strings_are_coerced(tmp_path):
    cfg = _load(_write(tmp_path, ""), env={
        "ELASTICD_DAEMON_STANDALONE": "yes",
        "ELASTICD_ETCD_ENDPOINTS": "http://a:2379, http://b:2379",
        "ELASTICD_METRICS_PORT": "9500",
    })
    assert cfg.daemon.standalone is True
    assert cfg.etcd.endpoints == ["http://a:2379", "http://b:2379"]
    assert cfg.metrics.port == 9500


# --- validation: every bad field named ---

def test_bad_value_names_the_field_and_the_rule(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "[agent]\nmonitor_interval = 0.001\n"))
    assert _errors(excinfo) == ["agent.monitor_interval: must be >= 0.005, got 0.001"]
    assert "agent.monitor_interval: must be >= 0.005" in str(excinfo.value)


def test_inprocess_rules_are_the_wrappers_named_once(tmp_path):
    """config.py reports the wrapper's own rules (workers/inprocess_settings.problems) under
    inprocess.<field>, and a field a bound already refused is not named twice."""
    from elasticd.inprocess import InProcessSettings
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "[inprocess]\nsoft_timeout = 100\nmax_restarts = -1\n"))
    assert _errors(excinfo) == [
        "inprocess.max_restarts: must be >= 0, got -1",
        "inprocess.soft_timeout: need 0 < soft_timeout < hard_timeout < barrier_timeout, "
        "got 100 / 90 / 240"]
    with pytest.raises(ValueError) as worker_side:
        InProcessSettings(soft_timeout=100)
    assert "soft_timeout: need 0 < soft_timeout < hard_timeout < barrier_timeout, " \
           "got 100 / 90 / 240" in str(worker_side.value)


def test_bad_value_from_env_or_flag_is_named_too(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, ""), env={"ELASTICD_METRICS_PORT": "70000"},
              overrides={"daemon.log_level": "loud"})
    errors = _errors(excinfo)
    assert any(e.startswith("metrics.port: must be <= 65535") for e in errors), errors
    assert any(e.startswith("daemon.log_level: must be one of debug, info") for e in errors), errors


def test_several_bad_values_are_all_listed_in_one_error(tmp_path):
    path = _write(tmp_path, "[agent]\nmonitor_interval = 0\nstop_grace_period = -1\n"
                            "[metrics]\nport = 70000\n[daemon]\nshutdown_timeout = 0\n")
    with pytest.raises(ConfigError) as excinfo:
        _load(path)
    named = sorted(e.split(":")[0] for e in _errors(excinfo))
    assert named == ["agent.monitor_interval", "agent.stop_grace_period",
                     "daemon.shutdown_timeout", "metrics.port"]
    for field in named:
        assert field in str(excinfo.value)


def test_a_phase_record_outlives_two_publish_intervals_and_goes_stale_before_the_floor(
        tmp_path):
    # Else a peer publishing on time would count as stale between two writes.
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "[agent]\nphase_publish_interval = 3\nphase_stale_after = 5\n"))
    assert _errors(excinfo) == ["agent.phase_stale_after: must exceed twice "
                                "agent.phase_publish_interval (5.0 <= 2 x 3.0)"]
    # Else a peer's checkpoint could go unseen for longer than a learned timeout.
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "[agent]\nphase_stale_after = 12\n"))
    assert _errors(excinfo) == ["agent.phase_stale_after: must be below agent.hang_learn_floor "
                                "(12.0 >= 10.0)"]


def test_an_unchanged_phase_record_is_refreshed_before_it_goes_stale(tmp_path):
    # Written only on a change and every refresh interval: it must stay fresh between two.
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "[agent]\nphase_refresh_interval = 4\n"))
    assert _errors(excinfo) == ["agent.phase_stale_after: must exceed twice "
                                "agent.phase_refresh_interval (7.0 <= 2 x 4.0)"]
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "[agent]\nphase_publish_interval = 2\n"
                               "phase_refresh_interval = 1\n"))
    assert _errors(excinfo) == ["agent.phase_refresh_interval: must be at least "
                                "agent.phase_publish_interval (1.0 < 2.0)"]
    cfg = _load(_write(tmp_path, "[agent]\nphase_refresh_interval = 0.5\n"
                                 "phase_publish_interval = 0.2\nphase_stale_after = 1.5\n"))
    assert (cfg.agent.phase_refresh_interval, cfg.agent.phase_stale_after) == (0.5, 1.5)


def test_unknown_section_is_rejected_with_the_known_ones_listed(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "[agnet]\nmonitor_interval = 1\n"))
    (error,) = _errors(excinfo)
    assert error.startswith("agnet: unknown section")
    for section in config.SECTIONS:
        assert section in error


def test_unknown_setting_is_rejected_with_the_known_ones_listed(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "[agent]\nmonitor_intervall = 1\n"))
    (error,) = _errors(excinfo)
    assert error.startswith("agent.monitor_intervall: unknown setting")
    assert "monitor_interval" in error and "stop_grace_period" in error


def test_unknown_flag_is_rejected(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, ""), overrides={"agent.nope": 1, "nosuch.thing": 2})
    errors = _errors(excinfo)
    assert any(e.startswith("agent.nope: unknown setting") for e in errors), errors
    assert any(e.startswith("nosuch.thing: unknown section") for e in errors), errors


@pytest.mark.parametrize("toml, field, expected", [
    ('[agent]\nstop_grace_period = "soon"\n', "agent.stop_grace_period", "float"),
    ("[agent]\ndefault_max_restarts = 1.5\n", "agent.default_max_restarts", "int"),
    ("[agent]\ndefault_max_restarts = true\n", "agent.default_max_restarts", "int"),
    ('[daemon]\nstandalone = "maybe"\n', "daemon.standalone", "bool"),
    ("[etcd]\nendpoints = [1, 2]\n", "etcd.endpoints", "list"),
    ("[metrics]\naddress = 1.5\n", "metrics.address", "str"),
])
def test_wrong_type_is_named(tmp_path, toml, field, expected):
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, toml))
    (error,) = _errors(excinfo)
    assert error.startswith(f"{field}: expected {expected}, got ")


def test_section_that_is_not_a_table_is_rejected(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _load(_write(tmp_path, "agent = 3\n"))
    assert _errors(excinfo) == ["agent: must be a table, got 3"]


def test_missing_config_file_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as excinfo:
        _load(missing)
    assert _errors(excinfo) == [f"config file {missing}: does not exist"]


def test_unparsable_config_file_names_the_file(tmp_path):
    path = _write(tmp_path, "[agent\n")
    with pytest.raises(ConfigError) as excinfo:
        _load(path)
    (error,) = _errors(excinfo)
    assert error.startswith(f"config file {path}: ")


def test_relations_between_settings_are_checked(tmp_path):
    path = _write(tmp_path, "[agent]\nrestart_backoff_initial = 60\nrestart_backoff_max = 30\n")
    with pytest.raises(ConfigError) as excinfo:
        _load(path)
    assert _errors(excinfo)[0].startswith(
        "agent.restart_backoff_initial: must not exceed agent.restart_backoff_max")


def test_a_user_may_not_hold_more_streams_than_the_daemon_serves(tmp_path):
    path = _write(tmp_path, "[limits]\nstreams_total = 8\nstreams_per_user = 9\n")
    with pytest.raises(ConfigError) as excinfo:
        _load(path)
    assert _errors(excinfo) == ["limits.streams_per_user: must not exceed limits.streams_total "
                                "(9 > 8)"]


def test_a_user_may_not_hold_more_idle_templates_than_the_node_keeps(tmp_path):
    path = _write(tmp_path, "[agent]\ntemplate_idle_max = 1\ntemplate_idle_per_user = 2\n")
    with pytest.raises(ConfigError) as excinfo:
        _load(path)
    assert _errors(excinfo) == ["agent.template_idle_per_user: must not exceed "
                                "agent.template_idle_max (2 > 1)"]


def test_metrics_address_is_a_setting_and_a_flag():
    from elasticd.node import cli
    args = cli.build_parser().parse_args(["--metrics-address", "127.0.0.1"])
    assert config.load("/dev/null", env={}, overrides=cli.overrides_from(args)).metrics.address \
        == "127.0.0.1"
    assert config.load("/dev/null", env={}).metrics.address == "0.0.0.0"


def test_describe_lists_every_setting_with_its_env_name():
    text = config.describe()
    for sname, cls in config.SECTIONS.items():
        assert f"[{sname}]" in text
        for f in dataclasses.fields(cls):
            assert f"  {f.name} = " in text
            assert f"ELASTICD_{sname}_{f.name}".upper() in text


def test_inprocess_section_is_the_wrappers_settings_type_and_imports_no_torch():
    """One definition of the in-process settings (workers/inprocess_settings.py) for the config
    and the wrapper; loading the config still imports no torch."""
    import subprocess
    import sys
    from elasticd.workers import inprocess_settings as settings
    assert config.InprocessSettings is settings.InprocessSettings
    code = ("import sys, elasticd.config; assert 'torch' not in sys.modules, "
            "'config imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
