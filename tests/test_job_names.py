"""Job names are per user, and a name says nothing of other users' jobs (issues 29, 30).

A real root daemon, real unprivileged users made here with useradd (their
elasticctl drops to them for real: the daemon learns who asks from the
kernel), real workers:

* two users may each have a live ``bert``; each one's ``bert`` is their own;
* another user's name answers NOT_FOUND word for word as a name nobody has;
  root sees all, and is told when a name it gives stands for several jobs;
* a name of several finished jobs of yours is refused with the list of them
  (ids, states, times) instead of the newest picked in silence;
* ``events JOB -f`` ends with the job, like ``logs -f``.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from test_local_trust import NOGROUP, real_users

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: real users are created and the daemon "
                                       "switches to them (CI runs as root)")

USERS = ("h30n_alice", "h30n_bob", "h30n_carol")


@pytest.fixture(scope="module")
def users():
    with real_users(USERS, "h30n-home-") as made:
        yield made


@pytest.fixture(scope="module")
def node(users):
    from daemons import DaemonProc, short_tmpdir
    d = DaemonProc(short_tmpdir(), slots=8,
                   extra_args=("--set", f"daemon.socket_group={NOGROUP}")).start()
    yield d
    d.cleanup()


def ctl(node, user, *args, timeout: float = 60.0):
    """elasticctl as ``user`` (None: root), from the user's home."""
    if user is None:
        return node.ctl(*args, timeout=timeout)
    return node.ctl(*args, cwd=user.home, user=user.creds, env={"HOME": user.home},
                    timeout=timeout)


def submit(node, user, name: str, *command: str) -> str:
    r = ctl(node, user, "-o", "json", "submit", "--name", name, "--", *command)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["id"]


def status(node, user, key: str) -> subprocess.CompletedProcess:
    return ctl(node, user, "-o", "json", "status", key)


def test_two_users_each_have_their_own_live_bert(node, users):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    # Jobs that outlive the test however slow its calls (a loaded machine took over 60 s
    # for them); the test cancels them at its end.
    a = submit(node, alice, "bert", "/bin/sleep", "3600")
    b = submit(node, bob, "bert", "/bin/sleep", "3600")   # refused before: ALREADY_EXISTS
    try:
        assert json.loads(status(node, alice, "bert").stdout)["id"] == a
        assert json.loads(status(node, bob, "bert").stdout)["id"] == b
        again = ctl(node, alice, "submit", "--name", "bert", "--", "/bin/sleep", "3600")
        assert again.returncode == 1 and "ALREADY_EXISTS" in again.stderr  # hers is live

        # carol has no bert: someone else's name answers as a name nobody has.
        theirs = status(node, carol, "bert")
        nobody = status(node, carol, "ernie")
        assert theirs.returncode == nobody.returncode == 1
        assert theirs.stderr == nobody.stderr.replace("ernie", "bert"), (theirs.stderr,
                                                                         nobody.stderr)
        assert "NOT_FOUND" in theirs.stderr and a not in theirs.stderr and b not in theirs.stderr
        assert "alice" not in theirs.stderr and "bob" not in theirs.stderr
        for cmd in ("cancel", "wait", "logs", "events"):
            r = ctl(node, carol, cmd, "bert")
            assert r.returncode == 1 and "NOT_FOUND" in r.stderr, (cmd, r.stderr)

        # root sees both: the name is ambiguous, and says so with both ids.
        root = status(node, None, "bert")
        assert root.returncode == 1 and "FAILED_PRECONDITION" in root.stderr, root.stderr
        assert "stands for 2 live jobs" in root.stderr and a in root.stderr and b in root.stderr
        assert "give the job id" in root.stderr
    finally:
        for job in (a, b):
            node.ctl("cancel", job)


def test_a_name_of_several_finished_jobs_lists_them(node, users):
    alice = users["alice"]
    ids = [submit(node, alice, "sweep", "/bin/sh", "-c", f"exit {code}") for code in (0, 3)]
    for job in ids:
        node.wait_job(job)
    r = status(node, alice, "sweep")
    assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stderr, r.stderr
    said = r.stderr
    assert "the name 'sweep' stands for 2 finished jobs (none live)" in said, said
    assert f"{ids[1]} FAILED (submitted " in said and f"{ids[0]} SUCCEEDED (submitted " in said
    assert said.index(ids[1]) < said.index(ids[0])   # newest first
    assert ", ended " in said and "give the job id" in said
    # A live one of the name is the one meant; a single finished one is found as before.
    live = submit(node, alice, "sweep", "/bin/sleep", "60")
    try:
        assert json.loads(status(node, alice, "sweep").stdout)["id"] == live
    finally:
        node.ctl("cancel", live)
    once = submit(node, alice, "once", "/bin/true")
    node.wait_job(once)
    assert json.loads(status(node, alice, "once").stdout)["id"] == once


def test_events_follow_ends_with_the_job(node, users):
    alice = users["alice"]
    job = submit(node, alice, "short", "/bin/sh", "-c", "sleep 2")
    t0 = time.monotonic()
    r = ctl(node, alice, "events", "short", "-f", timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert any("RUNNING -> SUCCEEDED" in line for line in lines), r.stdout
    assert all(job in line for line in lines)
    assert took < 30, took
    # And at once for a job that already ended.
    t0 = time.monotonic()
    again = ctl(node, alice, "events", job, "-f", timeout=60)
    assert again.returncode == 0 and "RUNNING -> SUCCEEDED" in again.stdout
    assert time.monotonic() - t0 < 10


def test_a_name_stands_for_the_callers_jobs_only():
    from types import SimpleNamespace as Job
    from elasticd.jobs.names import AmbiguousName, stands_for
    from elasticd.jobs.states import JobState

    def job(id_, uid, live, created):
        return Job(id=id_, name="bert", uid=uid, live=live, user=f"u{uid}", created_at=created,
                   finished_at=0.0 if live else created + 1, state_since=created,
                   state=JobState.RUNNING if live else JobState.FAILED)
    jobs = [job("a1", 1001, True, 10.0), job("a0", 1001, False, 5.0), job("b1", 1002, True, 20.0)]
    assert stands_for("bert", jobs, lambda uid: uid == 1001).id == "a1"
    assert stands_for("bert", jobs, lambda uid: uid == 1003) is None
    with pytest.raises(AmbiguousName) as root:
        stands_for("bert", jobs, lambda uid: True)
    assert root.value.ids == ["b1", "a1"] and root.value.live
    assert "u1002's b1 RUNNING" in str(root.value)
    finished = [job("c2", 7, False, 30.0), job("c1", 7, False, 20.0)]
    with pytest.raises(AmbiguousName, match=r"stands for 2 finished jobs \(none live\): c2 "):
        stands_for("bert", finished, lambda uid: uid == 7)
