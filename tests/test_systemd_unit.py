"""systemd/elasticd.service: systemd itself accepts it, and it agrees with the daemon."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd import config

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "elasticd.service"


def _parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values...]}}; systemd keys may repeat, so keep them all."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"setting outside a section: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return _parse_unit(UNIT.read_text())


def _one(unit, section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values and len(values) == 1, f"[{section}] {key}= should be set once, got {values}"
    return values[0]


def _elasticd_executable() -> tuple[str, bool]:
    """The installed `elasticd` console script, or /bin/true; and whether it is the real one.

    The interpreter's own bin directory comes first, so the script found is the
    one `pip install -e .` made for this Python (not some other install's).
    """
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("elasticd", path=search)
    if found:
        return found, True
    # Not installed yet (e.g. the package was never `pip install`ed here).
    # verify only needs ExecStart= to name an existing executable, so /bin/true
    # lets the rest of the unit still be checked; the real path is asserted below.
    return "/bin/true", False


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("needs systemd-analyze (Debian package `systemd`) to verify the unit")
    exe, _ = _elasticd_executable()
    text = UNIT.read_text()
    assert "ExecStart=/usr/bin/elasticd " in text
    # /usr/bin/elasticd exists only once the .deb is installed; verify fails a
    # unit whose ExecStart= is not executable, so point it at this machine's.
    unit_file = tmp_path / "elasticd.service"
    unit_file.write_text(text.replace("ExecStart=/usr/bin/elasticd ", f"ExecStart={exe} "))

    # Works without systemd as PID 1 (containers): verify loads the unit into an
    # in-process manager. --man=no: don't need man(1) or man pages installed;
    # --recursive-errors=no: only this unit's errors decide the exit status,
    # not those of the host's own units it pulls in (network-online.target...).
    env = dict(os.environ, SYSTEMD_LOG_LEVEL="info", SYSTEMD_LOG_COLOR="0")
    proc = subprocess.run(
        [analyze, "verify", "--man=no", "--recursive-errors=no", str(unit_file)],
        capture_output=True, text=True, timeout=120, env=env)
    output = proc.stdout + proc.stderr
    # Bad values and unknown keys are only warnings ("..., ignoring") that
    # leave the exit status 0, so the output has to be read as well.
    about_unit = [line for line in output.splitlines()
                  if str(unit_file) in line or "elasticd.service" in line]
    assert proc.returncode == 0, f"systemd-analyze verify failed:\n{output}"
    assert not about_unit, "systemd-analyze verify complained:\n" + "\n".join(about_unit)


def test_notify_and_watchdog(unit):
    assert _one(unit, "Service", "Type") == "notify"
    assert _one(unit, "Service", "NotifyAccess") == "main"
    watchdog = float(_one(unit, "Service", "WatchdogSec"))
    # The main loop pings every tick; at the default tick a ping is never late.
    assert config.DaemonSettings().main_loop_interval < watchdog / 2


def test_exec_start_reads_the_default_config_file(unit):
    exec_start = _one(unit, "Service", "ExecStart").split()
    assert exec_start == ["/usr/bin/elasticd", "--config", config.DEFAULT_CONFIG_PATH]


def test_directories_match_the_daemons_root_defaults(unit):
    # DESIGN: socket /run/elasticd/control.sock, state /var/lib/elasticd.
    assert _one(unit, "Service", "RuntimeDirectory") == "elasticd"
    assert _one(unit, "Service", "StateDirectory") == "elasticd"
    assert _one(unit, "Service", "RuntimeDirectoryMode") == "0755"
    # Records and logs are root's alone; users read theirs through elasticctl.
    assert _one(unit, "Service", "StateDirectoryMode") == "0700"


def test_stop_kills_workers_but_only_after_the_graceful_stop(unit):
    assert _one(unit, "Service", "KillMode") == "mixed"
    timeout_stop = float(_one(unit, "Service", "TimeoutStopSec"))
    defaults = config.Config()
    assert timeout_stop > defaults.daemon.shutdown_timeout
    assert timeout_stop > defaults.agent.stop_grace_period


def test_restart_environment_limits_and_install(unit):
    assert _one(unit, "Service", "Restart") == "on-failure"
    assert float(_one(unit, "Service", "RestartSec")) > 0
    assert "PYTHONUNBUFFERED=1" in unit["Service"]["Environment"]
    assert int(_one(unit, "Service", "LimitNOFILE")) >= 65536
    assert "network-online.target" in _one(unit, "Unit", "After").split()
    assert "network-online.target" in _one(unit, "Unit", "Wants").split()
    assert re.match(r"\S+:", _one(unit, "Unit", "Documentation"))
    assert _one(unit, "Install", "WantedBy") == "multi-user.target"
    assert "User" not in unit["Service"], "runs as root: it starts workers as their users"


def test_hardening_keeps_what_jobs_need(unit):
    """Hardened where it costs jobs nothing (tests/test_systemd_real.py runs them under it)."""
    service = unit["Service"]
    assert _one(unit, "Service", "UMask") == "0077"
    assert _one(unit, "Service", "ProtectSystem") in ("full", "strict")
    for key in ("ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
                "ProtectControlGroups", "ProtectHostname", "RestrictSUIDSGID",
                "LockPersonality"):
        assert _one(unit, "Service", key) == "yes", key
    # Switching to the job's user, chowning its run dir, signalling its
    # process groups, reaching its files, a metrics port below 1024 (one no
    # user can take first): nothing more.
    assert set(_one(unit, "Service", "CapabilityBoundingSet").split()) == {
        "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_KILL", "CAP_DAC_OVERRIDE",
        "CAP_DAC_READ_SEARCH", "CAP_NET_BIND_SERVICE"}
    # Jobs use the user's /tmp, home and every device (GPUs); setuid helpers
    # they run must still work.
    for key in ("PrivateTmp", "ProtectHome", "PrivateDevices", "DeviceAllow", "DevicePolicy",
                "ProtectClock", "NoNewPrivileges", "RestrictNamespaces", "SystemCallFilter",
                "ProtectProc"):
        assert key not in service, f"{key}= would take from jobs what they need"
