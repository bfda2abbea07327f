"""One user can neither read another's secrets nor starve the node (issue 15).

A real root daemon, real unprivileged users made here with useradd (names
prefixed ``h15``, removed on teardown), real elasticctl as those users
(tests/run_as.py drops privileges before it connects).
"""
from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from daemons import REPO, DaemonProc, real_users, short_tmpdir
from etcd_server import free_port
from elasticd.v1 import control_pb2 as pb

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: real users (useradd), a root daemon, "
                                       "tmpfs mounts (CI runs as root)")

# One set per pytest-xdist worker, so parallel workers never share a user.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
GROUP = f"h15_ctl{_WORKER}"
# An HTTP/2 client's first words: the preface and an empty SETTINGS frame.
HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
USERS = (f"h15_alice{_WORKER}", f"h15_bob{_WORKER}")


@pytest.fixture(scope="module")
def users():
    """Two real users, both in the group that may use the control socket:
    name -> (uid, gid, groups) as run_as.py takes it."""
    with real_users(USERS, GROUP) as made:
        yield made


def start(*settings: str, root: str | None = None, slots: int = 4) -> DaemonProc:
    args = ("--set", f"daemon.socket_group={GROUP}")
    for s in settings:
        args += ("--set", s)
    return DaemonProc(root or short_tmpdir(), slots=slots, extra_args=args).start()


@pytest.fixture
def daemons():
    made: list[DaemonProc] = []
    yield made
    for d in made:
        d.cleanup()


def workdir(d: DaemonProc, who: tuple) -> str:
    path = os.path.join(d.root, f"work-{who[0]}")
    os.makedirs(path, exist_ok=True)
    os.chown(path, who[0], who[1])
    return path


def submit_as(d: DaemonProc, who: tuple, *cmd: str, env: dict | None = None) -> \
        subprocess.CompletedProcess:
    extra = [a for k, v in (env or {}).items() for a in ("--env", f"{k}={v}")]
    return d.ctl("-o", "json", "submit", *extra, "--", *cmd, cwd=workdir(d, who), user=who)


def readable_by(path: str, who: tuple) -> bool:
    """Whether ``who`` can read ``path`` (cat, as that user for real)."""
    r = subprocess.run(["/bin/cat", path], capture_output=True, user=who[0], group=who[1],
                       extra_groups=who[2])
    return r.returncode == 0


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def mode(path: str) -> int:
    return os.stat(path).st_mode & 0o777


# -- private state -----------------------------------------------------------------

def test_another_user_cannot_read_the_database_wal_or_logs(users, daemons):
    alice, bob = users[USERS[0]], users[USERS[1]]
    root = short_tmpdir()
    # An older version's state dir: 0755 with a world-readable file in it.
    state = os.path.join(root, "state")
    os.makedirs(state, mode=0o755)
    os.chmod(state, 0o755)
    with open(os.path.join(state, "old-notes"), "w") as fh:
        fh.write("x")
    os.chmod(os.path.join(state, "old-notes"), 0o644)
    d = start(root=root)
    daemons.append(d)
    assert "tightened" in d.log()

    r = submit_as(d, alice, "/bin/sh", "-c", 'echo "out: $H15_SECRET"; sleep 60',
                  env={"H15_SECRET": "hunter2-h15"})
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["id"]
    d.wait_state(job, "RUNNING")
    db = os.path.join(d.state_dir, "jobs.sqlite3")
    log = os.path.join(d.state_dir, "logs", job, "rank-0.log")
    deadline = time.monotonic() + 30
    while "hunter2-h15" not in open(log).read() and time.monotonic() < deadline:
        time.sleep(0.1)

    assert mode(d.state_dir) == 0o700
    assert mode(os.path.join(d.state_dir, "logs")) == 0o700
    assert mode(os.path.join(d.state_dir, "logs", job)) == 0o700
    for path in (db, db + "-wal", db + "-shm", log, os.path.join(d.state_dir, "old-notes")):
        assert os.path.exists(path), path
        assert mode(path) == 0o600, (path, oct(mode(path)))
        assert os.stat(path).st_uid == 0
        assert not readable_by(path, bob), path
        assert not readable_by(path, alice), path  # her own output: through elasticctl only

    # Alice reads her job's output through the daemon; Bob may not.
    mine = d.ctl("logs", job, user=alice)
    assert mine.returncode == 0 and "out: hunter2-h15" in mine.stdout, mine.stderr
    theirs = d.ctl("logs", job, user=bob)
    assert theirs.returncode == 1 and "PERMISSION_DENIED" in theirs.stderr
    # ... and is not told whose job it is (by name it would be NOT_FOUND).
    assert USERS[0] not in theirs.stderr and f"uid {alice[0]}" not in theirs.stderr
    assert d.ctl("cancel", job).returncode == 0


# -- fair share of the daemon ------------------------------------------------------------

def test_forty_follow_streams_of_one_user_leave_list_to_another(users, daemons):
    alice, bob = users[USERS[0]], users[USERS[1]]
    d = start()
    daemons.append(d)
    r = submit_as(d, alice, "/bin/sh", "-c", "echo hello; sleep 120")
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["id"]
    d.wait_state(job, "RUNNING")
    holder = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "hold_streams.py"), str(alice[0]),
         str(alice[1]), ",".join(map(str, alice[2])), d.socket, job, "40", "60"],
        stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in holder.stdout:
            lines.append(line.strip())
            if line.startswith("ready"):
                break
        opened = [x for x in lines if x == "open"]
        refused = [x for x in lines if x.startswith("refused")]
        assert opened, lines
        assert all("RESOURCE_EXHAUSTED" in x and "limits.streams_per_user" in x
                   and f"uid {alice[0]}" in x for x in refused), refused
        # Bob's list answers while Alice holds every stream she may.
        t0 = time.monotonic()
        listed = d.ctl("-o", "json", "list", user=bob, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert time.monotonic() - t0 < 30
        assert json.loads(listed.stdout) == {"jobs": []}
        # And root's.
        assert d.ctl("list", timeout=60).returncode == 0
    finally:
        holder.kill()
        holder.wait()
    assert d.ctl("cancel", job).returncode == 0


def test_a_connection_flood_leaves_a_second_client_served(users, daemons):
    bob = users[USERS[1]]
    d = start("limits.max_connections=200", "limits.handshake_timeout=2",
              "limits.idle_timeout=2")
    daemons.append(d)
    # The daemon's open files as under a tight LimitNOFILE: a flood of 1,500
    # connections would take every one without the connection cap. Every
    # other one speaks HTTP/2 (preface and SETTINGS) then idles; the rest
    # never say a word.
    psutil.Process(d.proc.pid).rlimit(psutil.RLIMIT_NOFILE, (1024, 1024))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    proc = psutil.Process(d.proc.pid)
    before = len(proc.net_connections("unix"))
    flood = []
    try:
        for _ in range(1500):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(d.socket)
                if len(flood) % 2:
                    s.send(HTTP2_HELLO)
            except (BlockingIOError, InterruptedError):
                pass  # queued; the daemon takes it (or not) in its own time
            except OSError:
                s.close()
                break
            flood.append(s)
        # The handshake timeout closes the silent ones the cap let in, the
        # idle timeout those that spoke HTTP/2 but never made a call: witnessed by
        # the daemon's unix sockets back to as many as before the flood.
        deadline = time.monotonic() + 30
        while len(proc.net_connections("unix")) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(proc.net_connections("unix")) <= before, "the flood's sockets stay open"
        t0 = time.monotonic()
        listed = d.ctl("-o", "json", "list", user=bob, timeout=60)
        assert listed.returncode == 0, listed.stderr + d.log()[-3000:]
        assert time.monotonic() - t0 < 30
    finally:
        for s in flood:
            s.close()
    assert d.proc.poll() is None
    assert d.ctl("list").returncode == 0


def test_per_user_caps_name_the_limit_while_another_user_submits(users, daemons):
    alice, bob = users[USERS[0]], users[USERS[1]]
    d = start("limits.jobs_per_user=2", "limits.spec_bytes_per_user=400000", slots=8)
    daemons.append(d)
    for _ in range(2):
        r = submit_as(d, alice, "/bin/sleep", "60")
        assert r.returncode == 0, r.stderr
    over = submit_as(d, alice, "/bin/sleep", "60")
    assert over.returncode == 1
    assert "RESOURCE_EXHAUSTED" in over.stderr
    assert f"uid {alice[0]}" in over.stderr and "has 2 unfinished jobs" in over.stderr
    assert "(limits.jobs_per_user 2)" in over.stderr
    # Bob is not held back by Alice's jobs.
    ok = submit_as(d, bob, "/bin/sleep", "60", env={f"H15_BIG{i}": "b" * 50_000 for i in range(3)})
    assert ok.returncode == 0, ok.stderr
    big = submit_as(d, bob, "/bin/sleep", "60", env={f"H15_BIG{i}": "b" * 50_000
                                                     for i in range(6)})
    assert big.returncode == 1 and "RESOURCE_EXHAUSTED" in big.stderr
    assert "limits.spec_bytes_per_user 400000" in big.stderr
    listed = json.loads(d.ctl("-o", "json", "list").stdout)["jobs"]
    assert len(listed) == 3
    for j in listed:
        assert d.ctl("cancel", j["id"]).returncode == 0


def test_list_comes_in_pages_under_the_response_limit(daemons):
    d = start("limits.response_bytes=65536", "limits.jobs_per_user=20")
    daemons.append(d)
    ids = [d.submit("/bin/true", "a" * 30_000) for _ in range(6)]
    big = d.submit("/bin/true", *(["b" * 1000] * 200))  # one command past a page
    with d.client() as c:
        first = c.call("ListJobs", pb.ListJobsRequest())
        assert first.next_page_token and first.ByteSize() <= 65536
        seen, token = [], ""
        while True:
            page = c.call("ListJobs", pb.ListJobsRequest(page_token=token))
            assert page.ByteSize() <= 65536
            seen += [j.id for j in page.jobs]
            token = page.next_page_token
            if not token:
                break
        job = c.call("GetJob", pb.GetJobRequest(id=big))
    assert seen == ids + [big]
    assert job.ByteSize() <= 65536 and "more arguments" in job.command[-1]
    listed = json.loads(d.ctl("-o", "json", "list").stdout)["jobs"]
    assert [j["id"] for j in listed] == ids + [big]


# -- bounded logs ------------------------------------------------------------------------

def test_a_job_writing_megabytes_keeps_at_most_the_cap_and_logs_shows_its_tail(daemons):
    cap = 1024 * 1024
    d = start(f"agent.log_max_bytes={cap}", "agent.log_check_interval=0.1")
    daemons.append(d)
    script = ("i=0; while [ $i -lt 8 ]; do head -c 1000000 /dev/zero | tr '\\0' x | "
              "fold -w 99; i=$((i+1)); done; echo THE-END")
    job = d.submit("/bin/sh", "-c", script)
    follow = subprocess.Popen([sys.executable, "-m", "elasticctl", "--socket", d.socket,
                               "logs", "-f", job], stdout=subprocess.PIPE, text=True,
                              cwd=d.root)
    try:
        assert d.wait_job(job).state == pb.SUCCEEDED
        followed, _ = follow.communicate(timeout=60)
    finally:
        follow.kill()
    job_dir = os.path.join(d.state_dir, "logs", job)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        on_disk = sum(os.path.getsize(os.path.join(job_dir, n)) for n in os.listdir(job_dir))
        if on_disk <= cap:
            break
        time.sleep(0.1)
    assert on_disk <= cap, {n: os.path.getsize(os.path.join(job_dir, n))
                            for n in os.listdir(job_dir)}
    assert mode(os.path.join(job_dir, "rank-0.log.1")) == 0o600
    shown = d.ctl("logs", job)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.rstrip().endswith("THE-END")
    assert f"==== elasticd: job {job} rank 0 start" in shown.stdout  # the marker kept
    assert "log rotated" in shown.stdout
    tail = d.ctl("logs", job, "--tail", "2")
    assert tail.returncode == 0 and tail.stdout.rstrip().endswith("THE-END")
    assert len(tail.stdout.splitlines()) == 2
    # The follower read across the rotations to the end, and the end once.
    assert followed.rstrip().endswith("THE-END") and followed.count("THE-END") == 1


# -- disk full -----------------------------------------------------------------------------

def test_a_full_state_filesystem_is_a_clean_submit_error_and_no_phantom_job(daemons):
    root = short_tmpdir()
    state = os.path.join(root, "state")
    os.makedirs(state)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "h15-state", state],
                   check=True)
    try:
        port = free_port()
        # Nothing the daemon may free makes room: retention frees space on a full
        # disk only by retiring finished jobs' logs (and a pass runs only at start,
        # when a job ends, and every retention.interval), so the job already here
        # runs while the disk is full, and the interval is longer than the test.
        d = start("limits.state_min_free_bytes=65536", f"metrics.port={port}",
                  "metrics.address=127.0.0.1", "retention.interval=3600", root=root)
        daemons.append(d)
        assert "elasticd_state_disk_full 0.0" in scrape(port)
        before = d.submit("/bin/sleep", "600")
        d.wait_state(before, "RUNNING")
        with open(os.path.join(state, "filler"), "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
        r = d.ctl("submit", "--", "/bin/true")
        assert r.returncode == 1
        assert "RESOURCE_EXHAUSTED" in r.stderr and "full" in r.stderr, r.stderr
        nodes = d.ctl("nodes")
        assert "problem on node-a: state dir" in nodes.stdout and "full" in nodes.stdout, \
            nodes.stdout
        assert "elasticd_state_disk_full 1.0" in scrape(port)
        listed = json.loads(d.ctl("-o", "json", "list").stdout)["jobs"]
        assert [j["id"] for j in listed] == [before]
        assert d.proc.poll() is None
        # Room again: the job that failed is not there after a restart either.
        os.unlink(os.path.join(state, "filler"))
        assert d.ctl("cancel", before).returncode == 0
        d.wait_job(before)
        d.stop()
        d.start()
        listed = json.loads(d.ctl("-o", "json", "list").stdout)["jobs"]
        assert [j["id"] for j in listed] == [before]
        assert d.ctl("submit", "--", "/bin/true").returncode == 0
        d.stop()
    finally:
        subprocess.run(["umount", "-l", state], capture_output=True)
