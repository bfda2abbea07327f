"""Shared fixtures: real elasticd daemons (see daemons.py), cleaned up after.

On teardown every daemon a test made is stopped and any worker process it
left behind is killed.
"""
from __future__ import annotations

import shutil

import pytest

from daemons import DaemonProc, short_tmpdir


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
