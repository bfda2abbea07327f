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
