"""Shared fixtures: real elasticd daemons (see daemons.py), cleaned up after.

On teardown every daemon a test made is stopped and any worker process it
left behind is killed.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

from daemons import DaemonProc, short_tmpdir

# A pid of 0 or less names the caller's own process group (or every process):
# from a test that would be pytest itself and, in CI, the whole run (a
# SIGSTOP there once froze CI to its time limit). A pid read from a daemon's
# answer or a file that is not there yet must fail the test, not the run.
_os_kill, _os_killpg = os.kill, os.killpg


def _kill(pid: int, sig: int) -> None:
    if pid <= 0:
        raise AssertionError(f"a test signalled pid {pid} ({sig}): its own process group")
    _os_kill(pid, sig)


def _killpg(pgid: int, sig: int) -> None:
    if pgid <= 0 or pgid == os.getpgrp():
        raise AssertionError(f"a test signalled process group {pgid} ({sig}): its own")
    _os_killpg(pgid, sig)


os.kill, os.killpg = _kill, _killpg

# The tests run with the project virtualenv's python (scripts/test.sh): put
# its bin/ first on PATH, as activating it would, so commands installed with
# the project (torchrun, elasticd, elasticctl) are the venv's own.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture
def tmp_short():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_factory():
    made: list[DaemonProc] = []

    def make(**kwargs) -> DaemonProc:
        d = DaemonProc(short_tmpdir(), **kwargs)
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProc:
    return daemon_factory().start()
