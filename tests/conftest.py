"""Shared fixtures: real elasticd daemons (see daemons.py), cleaned up after.

On teardown every daemon a test made is stopped and any worker process it
left behind is killed. Before the first test, ``preflight()`` stops the run
with one line when it cannot work here: the users the tests create cannot
run this clone's Python (a clone in /root, 0700), or this host's name does
not resolve (torch's workers would retry it for minutes).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest

from daemons import CTL_CALLS, REPO, DaemonProc, short_tmpdir
from elasticd.workers import hostname

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

# An unprivileged uid for the preflight: the tests' real users are others to the clone.
_NOBODY = 65534


def _blocking_dir(path: str) -> str:
    """The first directory above ``path`` that others may not enter, or ""."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts)):
        d = os.sep.join(parts[:i])
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return d
        except OSError:
            return d
    return ""


def users_cannot_run_python() -> str:
    """Why the users the tests create could not run this interpreter and import
    elasticd (one line), or "". As root only: others skip the cases with users."""
    if os.geteuid() != 0:
        return ""
    why = ""
    try:
        proc = subprocess.run([sys.executable, "-c", "import elasticd, elasticctl"],
                              user=_NOBODY, group=_NOBODY, extra_groups=[], cwd="/",
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    except OSError as exc:
        why = f"{exc.strerror or exc}"
    except subprocess.TimeoutExpired:
        why = "it did not finish within 60 s"
    if not why:
        return ""
    base = os.path.realpath(sys.executable)
    clone = next(filter(None, (_blocking_dir(p) for p in (sys.executable, REPO))), "")
    if clone:
        todo = (f"{clone} is {stat.filemode(os.stat(clone).st_mode)}, others cannot enter it: "
                f"clone the repo into a directory they can (e.g. /srv/elasticd) and run "
                f"`bash scripts/test.sh` there, or `chmod o+x {clone}`")
    elif _blocking_dir(base):
        todo = (f"the venv's base interpreter {base} lies under {_blocking_dir(base)}, which "
                f"others cannot enter: `bash scripts/setup.sh` makes the venv again from "
                f"/usr/bin/python3 (or make it with a Python they can run)")
    else:
        todo = "make sure others may read the clone and its .venv/"
    return (f"the tests run workers as users they create, who cannot run {sys.executable} "
            f"({why}); {todo} (ELASTICD_TEST_PREFLIGHT=0 runs the suite anyway)")


def preflight() -> str:
    """What stops the suite before its first test, in one line (an error a person can
    act on, in the first seconds, instead of tests that wait out minutes), or ""."""
    return users_cannot_run_python() or hostname.problem()


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller looked already
        return
    if os.environ.get("ELASTICD_TEST_PREFLIGHT") == "0":  # run anyway, knowing why not
        return
    why = preflight()
    if why:
        pytest.exit(f"elasticd tests cannot run here: {why}", returncode=4)

# The slow suite's two longest cases, minutes each even alone (the GPU check's dry run,
# the README's commands on a bare Debian): their files start first, so the suite does
# not end with one worker on them while the others sit idle. xdist would send them
# last (files with the most cases first); the other files keep that order here
# (pyproject.toml runs xdist with --no-loadscope-reorder, keeping this one). Putting
# the heavy multi-node files first too was tried: started together, their cases ran
# longer, and the default suite with them.
LONG_FILES = ("test_gpu_check.py", "test_first_hour.py")


def pytest_collection_modifyitems(config, items):
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def rank(item):
        name = item.path.name
        long_ = LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)
        return (long_, -counts[name], str(item.path))
    items.sort(key=rank)  # stable: a file's cases keep their order


# ELASTICD_TEST_CPU_LOG=DIR: each case's wall time and the CPU it and every process it
# reaped used (the daemons it stopped, with their workers; and of that, its elasticctl
# runs through DaemonProc.ctl: count and CPU), one JSON line per case in
# DIR/cpu-WORKER.jsonl: where the suite's time goes on a machine of few cores
# (scripts/test_cpu.py sums it up).
_CPU_LOG = os.environ.get("ELASTICD_TEST_CPU_LOG", "")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    t0, c0, ctl0 = time.monotonic(), os.times(), list(CTL_CALLS)
    yield
    t1, c1 = time.monotonic(), os.times()
    cpu = sum(getattr(c1, f) - getattr(c0, f)
              for f in ("user", "system", "children_user", "children_system"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.makedirs(_CPU_LOG, exist_ok=True)
    with open(os.path.join(_CPU_LOG, f"cpu-{worker}.jsonl"), "a") as fh:
        fh.write(json.dumps({"id": item.nodeid, "wall": round(t1 - t0, 2),
                             "cpu": round(cpu, 2), "start": round(time.time() - (t1 - t0), 1),
                             "worker": worker, "ctl_calls": CTL_CALLS[0] - ctl0[0],
                             "ctl_cpu": round(CTL_CALLS[1] - ctl0[1], 2)}) + "\n")


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
