"""The suite stops in its first seconds, with one line saying why and what to do,
when it cannot work here (tests/conftest.py ``preflight``), instead of tests that
fail one by one or wait out minutes (issue 30: 19 failures from a clone in /root,
0700, whose venv the tests' real users cannot run).

The clone is made for real: a virtualenv in a directory only root may enter,
its packages this run's (a ``.pth`` that adds them), run as root, exactly as
``bash scripts/test.sh`` runs pytest; the tests' users are others to it.
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
import time

import pytest

from daemons import REPO, short_tmpdir

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: the suite checks its users as root only")


@pytest.fixture
def private_clone():
    """A venv like a /root clone's: in a 0700 directory, with this run's packages."""
    top = short_tmpdir("h30-private-")
    os.chmod(top, 0o700)
    venv = os.path.join(top, "venv")
    base = os.path.realpath(sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    with open(os.path.join(venv, "lib", ver, "site-packages", "this-run.pth"), "w") as fh:
        fh.write("import site; " + "; ".join(f"site.addsitedir({p!r})"
                                             for p in site.getsitepackages()) + "\n")
    yield top, os.path.join(venv, "bin", "python")
    subprocess.run(["rm", "-rf", top], check=False)


def test_a_clone_others_cannot_enter_stops_the_suite_with_one_line(private_clone):
    top, python = private_clone
    t0 = time.monotonic()
    proc = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "tests/test_values.py"], capture_output=True, text=True, cwd=REPO,
                          timeout=120, env={k: v for k, v in os.environ.items()
                                            if k != "ELASTICD_TEST_PREFLIGHT"})
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out
    said = [line for line in out.splitlines() if "cannot run here" in line]
    assert len(said) == 1, out
    line = said[0]
    assert f"who cannot run {python} (Permission denied)" in line, line
    assert f"{top} is drwx------, others cannot enter it" in line, line
    assert "clone the repo into a directory they can (e.g. /srv/elasticd)" in line, line
    assert "passed" not in out and "failed" not in out   # no test ran
    assert took < 30, took


def test_the_same_suite_runs_when_others_may_enter(private_clone):
    top, python = private_clone
    os.chmod(top, 0o755)
    proc = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "tests/test_values.py"], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
