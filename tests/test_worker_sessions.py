"""No job reaches the terminal of whoever started the daemon (issue 29, item 3).

A real root daemon started the way the README's ``elasticd --standalone &``
from a root shell starts it: its session has a terminal (a pty this test
holds the master of, tests/with_ctty.py). A real unprivileged user made
here submits a job whose rank tries what took root's shell in the report:
``open('/dev/tty')`` and ``TIOCSTI`` on that and on every descriptor it has.
It must get ENXIO for /dev/tty, hold no descriptor of a terminal, have no
controlling terminal (``tty_nr`` 0 in /proc/self/stat, whatever
``dev.tty.legacy_tiocsti`` says) and lead a session of its own: a cold start,
and a rank the worker template forked (and the template itself). Every
process the daemon started for the job (template, round store) is checked
the same way from outside.
"""
from __future__ import annotations

import json
import os
import pty
import sys

import psutil
import pytest

from daemons import REPO, DaemonProc, short_tmpdir
from elasticd.v1 import control_pb2 as pb
from test_local_trust import NOGROUP, PY, real_users, submit_as, submitted, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: a real user is created and the daemon "
                                       "switches to it (CI runs as root)")

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
USER = f"h29s_alice{_WORKER}"
MARK = "SESSION_PROBE "

# The rank's attempt on the daemon's terminal, as a user's job would make it. It
# never writes more than one harmless '#' (the test's own pty, were it reached).
PROBE = r"""
import errno, fcntl, json, os, sys, termios

def stat(pid):
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return {"session": int(fields[3]), "tty_nr": int(fields[4])}

def name(exc):
    return errno.errorcode.get(exc.errno, str(exc.errno))

out = {"pid": os.getpid(), "sid": os.getsid(0), "self": stat(os.getpid()),
       "parent_pid": os.getppid(), "parent": stat(os.getppid())}
try:
    fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    out["dev_tty"] = "opened"
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, b"#")
        out["dev_tty_tiocsti"] = "injected"
    except OSError as exc:
        out["dev_tty_tiocsti"] = name(exc)
except OSError as exc:
    out["dev_tty"] = name(exc)
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
out["tty_fds"] = [f for f in fds if os.isatty(f)]
out["injected"] = []
for f in fds:
    try:
        fcntl.ioctl(f, termios.TIOCSTI, b"#")
        out["injected"].append(f)
    except OSError:
        pass
print("SESSION_PROBE " + json.dumps(out), flush=True)
"""


def tty_nr(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[4])


@pytest.fixture(scope="module")
def user():
    with real_users((USER,), "h29s-home-") as made:
        yield next(iter(made.values()))


@pytest.fixture(scope="module")
def node(user):
    """A root daemon whose session has a terminal, as when started from a root shell."""
    master, slave = pty.openpty()
    d = DaemonProc(short_tmpdir(), slots=2, extra_args=(
        "--set", f"daemon.socket_group={NOGROUP}"))
    d.wrap = [sys.executable, os.path.join(REPO, "tests", "with_ctty.py"), os.ttyname(slave),
              "--"]
    try:
        d.start(timeout=60)
        assert tty_nr(d.proc.pid) != 0, "the daemon under test has no controlling terminal"
        yield d
    finally:
        d.cleanup()
        os.close(slave)
        os.close(master)


def probe(node, user, *command: str) -> tuple[str, dict]:
    """Run ``command`` as the user's job; (job id, what its rank 0 found)."""
    work = user.mkdir(os.path.join(user.home, "work"))
    script = os.path.join(work, "probe.py")
    with open(script, "w") as fh:
        fh.write(PROBE)
    os.chown(script, user.uid, user.gid)
    job_id = submitted(submit_as(node, user, "--", *[a.replace("SCRIPT", script)
                                                     for a in command], cwd=work))
    seen = wait_for(lambda: [ln for ln in _log(node, job_id).splitlines()
                             if ln.startswith(MARK)], 180, "the probe's report",
                    lambda: _log(node, job_id)[-2000:] + node.log()[-3000:])
    return job_id, json.loads(seen[0][len(MARK):])


def _log(node, job_id: str) -> str:
    try:
        return node.rank_log(job_id, 0)
    except FileNotFoundError:
        return ""


def assert_no_terminal(found: dict) -> None:
    assert found["dev_tty"] == "ENXIO", found        # no controlling terminal to open
    assert "dev_tty_tiocsti" not in found, found
    assert found["tty_fds"] == [] and found["injected"] == [], found
    assert found["self"]["tty_nr"] == 0, found
    assert found["sid"] == found["pid"], found      # a session of its own


def assert_daemon_children_have_no_terminal(node) -> None:
    """Every process the daemon started (and what they started) has no terminal, and
    each the daemon started itself leads a session of its own."""
    daemon = psutil.Process(node.proc.pid)
    for child in daemon.children(recursive=True):
        try:
            nr, sid = tty_nr(child.pid), os.getsid(child.pid)
        except (OSError, psutil.Error):
            continue  # gone meanwhile
        assert nr == 0, (child.pid, child.cmdline())
        if child.ppid() == daemon.pid:
            assert sid == child.pid, (child.pid, child.cmdline())


def test_a_cold_started_rank_cannot_reach_the_daemons_terminal(node, user):
    # Through a shell: never forked from a template nor handed to a spare.
    job_id, found = probe(node, user, "/bin/sh", "-c", f"exec {PY} SCRIPT")
    assert_no_terminal(found)
    assert node.wait_job(job_id, timeout=60).state == pb.SUCCEEDED
    status = json.loads(node.ctl("-o", "json", "status", job_id).stdout)
    assert status["workers"][0]["start_path"] == "cold", status


def test_a_rank_forked_from_the_template_cannot_reach_the_daemons_terminal(node, user):
    job_id, found = probe(node, user, PY, "SCRIPT")
    status = json.loads(node.ctl("-o", "json", "status", job_id).stdout)
    assert status["workers"][0]["start_path"] == "template", status
    assert_no_terminal(found)
    # Its parent is the worker template: no terminal either, and a session of its own
    # (the job's code it preloads runs there).
    assert found["parent"]["tty_nr"] == 0, found
    assert found["parent"]["session"] == found["parent_pid"], found
    assert_daemon_children_have_no_terminal(node)
    node.wait_job(job_id, timeout=60)


def test_every_process_of_a_running_job_is_off_the_terminal(node, user):
    """Template, round store and ranks of a job that keeps running, seen from outside."""
    work = user.mkdir(os.path.join(user.home, "work"))
    script = os.path.join(work, "sleeper.py")
    with open(script, "w") as fh:
        fh.write("import time\nprint('UP', flush=True)\ntime.sleep(300)\n")
    job_id = submitted(submit_as(node, user, "--nproc-per-node", "2", "--", PY, script,
                                 cwd=work))
    wait_for(lambda: "UP" in _log(node, job_id), 180, "the job's rank 0")
    assert_daemon_children_have_no_terminal(node)
    assert node.ctl("cancel", job_id).returncode == 0
    node.wait_job(job_id, timeout=60)
