"""A root daemon on a shared machine against local users who attack each other.

Real root daemon, real unprivileged users made here (``h14b_alice`` the
victim, ``h14b_bob`` who keeps a private directory, ``h14b_mallory`` the
attacker), real torch workers, real elasticctl dropping to those users
(tests/run_as.py). Each test is one way main gave a user's secrets or job
away (issue 14, reproductions 3-7):

* a ``torch.py`` planted in a shared cwd is never imported, cold or by a
  warm spare;
* a cwd under another user's 0700 directory is refused at submit with the
  message a missing path gets, and a job whose cwd became unenterable
  fails with that reason instead of running there;
* an error file turned into a symlink to a root-only JSON leaks nothing,
  and one turned into a FIFO neither blocks cancel nor keeps the slots;
* the in-process job store listens on loopback only, under a secret key
  prefix: another user who connects and plants faults does not fail the job;
* elasticctl refuses a socket someone else owns (exit 3), and no longer
  uses a /tmp path anyone can create first.
"""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from daemons import REPO, short_tmpdir

# What a user's own python needs to import this checkout's elasticd: the
# caller's PYTHONPATH if the run has one, then the checkout itself.
_PYTHONPATH = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""),
                                           os.path.join(REPO, "daemon"),
                                           os.path.join(REPO, "ctl")) if p)
from elasticd.v1 import control_pb2 as pb

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: real users are created and the daemon "
                                       "switches to them (CI runs as root)")

PY = sys.executable            # the venv's python: other users can run it
NOGROUP = 65534                # the daemon's socket group here: every test user is in it
USERS = ("h14b_alice", "h14b_bob", "h14b_mallory")


class User:
    def __init__(self, name: str, home: str):
        pw = pwd.getpwnam(name)
        self.name, self.uid, self.gid, self.home = name, pw.pw_uid, pw.pw_gid, home

    @property
    def creds(self) -> tuple:
        return (self.uid, self.gid, [self.gid, NOGROUP])

    def run(self, argv: list, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` as this user for real (setpriv drops uid, gid and groups)."""
        cmd = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
               f"--groups={self.gid},{NOGROUP}", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, **kw)

    def mkdir(self, path: str, mode: int = 0o755) -> str:
        os.makedirs(path, exist_ok=True)
        os.chown(path, self.uid, self.gid)
        os.chmod(path, mode)
        return path


@contextlib.contextmanager
def real_users(names: tuple, home_prefix: str):
    """Real unprivileged users ``PREFIX_ROLE`` for the block, each with a private home,
    as ``{role: User}``; deleted after it (and before: left from an interrupted run)."""
    def drop() -> None:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True)

    base = short_tmpdir(home_prefix)
    drop()
    made = {}
    try:
        for name in names:
            home = os.path.join(base, name)
            subprocess.run(["useradd", "-M", "-U", "-d", home, "-s", "/usr/sbin/nologin", name],
                           check=True, capture_output=True)
            made[name.split("_", 1)[1]] = User(name, home)
            made[name.split("_", 1)[1]].mkdir(home, 0o700)
        yield made
    finally:
        drop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def users():
    with real_users(USERS, "h14b-home-") as made:
        yield made


@pytest.fixture
def node(daemon_factory):
    """A root daemon whose socket the test users may use (group nogroup)."""
    return daemon_factory(slots=2, extra_args=("--set", f"daemon.socket_group={NOGROUP}",
                                               "--set", "agent.warm_spare_delay=0.5")).start()


def submit_as(d, user: User, *args: str, cwd: str) -> subprocess.CompletedProcess:
    return d.ctl("-o", "json", "submit", *args, cwd=cwd, user=user.creds,
                 env={"HOME": user.home})


def submitted(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["id"]


def status(d, job_id: str) -> dict:
    r = d.ctl("-o", "json", "status", job_id)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def everything_shown(d, job_id: str) -> str:
    """What anyone may see of a job: status, events and the daemon's own log."""
    events = d.ctl("-o", "json", "events", job_id)
    return "\n".join([json.dumps(status(d, job_id)), events.stdout, d.log()])


def wait_for(pred, timeout: float, what: str, why=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout}s: {why()}")


# ---------------------------------------------------------------- 3. sys.path of spares

PLANTED_TORCH = """\
import os
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "PWNED"), "a") as fh:
    fh.write("imported by uid %d pid %d\\n" % (os.getuid(), os.getpid()))
"""

TRAIN_ONCE_FAILING = """\
import os, sys, time
import torch
print("TORCH_FILE", torch.__file__, flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    deadline = time.time() + 240
    while not os.path.exists(sys.argv[1]) and time.time() < deadline:
        time.sleep(0.1)
    sys.exit(1)
"""


def _maps_torch(proc: psutil.Process) -> bool:
    try:
        return any("libtorch" in m.path for m in proc.memory_maps(grouped=True))
    except psutil.Error:
        return False


@pytest.mark.parametrize("warm", ["spare", "template"])
def test_a_torch_py_planted_in_a_shared_cwd_is_never_imported(daemon_factory, users, warm):
    # Two warm paths import torch ahead of the job: a warm spare (the template off)
    # and the worker template (which then forks both attempts).
    node = daemon_factory(slots=2, extra_args=(
        "--set", f"daemon.socket_group={NOGROUP}", "--set", "agent.warm_spare_delay=0.5",
        "--set", f"agent.worker_template={'false' if warm == 'spare' else 'true'}")).start()
    alice, mallory = users["alice"], users["mallory"]
    shared = os.path.join(node.root, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    planted = os.path.join(shared, "torch.py")
    assert mallory.run(["sh", "-c", f"cat > {planted}"], input=PLANTED_TORCH).returncode == 0
    work = alice.mkdir(os.path.join(node.root, "alice-work"))
    script = os.path.join(work, "train.py")
    with open(script, "w") as fh:
        fh.write(TRAIN_ONCE_FAILING)
    go = os.path.join(work, "go")

    job_id = submitted(submit_as(node, alice, "--max-restarts", "1", "--",
                                 PY, script, go, cwd=shared))
    # The first attempt (a cold start, or forked from the template) runs; a spare
    # starts beside it (the template was there before it).
    warm_procs = wait_for(lambda: [
        p for p in psutil.process_iter(["cmdline", "uids"])
        if "workers/warmstart.py" in " ".join(p.info["cmdline"] or [])
        and p.info["uids"] and p.info["uids"].real == alice.uid], 120,
        f"a warm {warm} for alice's job")
    log_path = os.path.join(node.state_dir, "logs", job_id, "rank-0.log")
    wait_for(lambda: os.path.exists(log_path) and "TORCH_FILE" in node.rank_log(job_id, 0),
             120, "the first attempt")
    # Witness that the warm process got past its torch import (where a planted torch.py
    # would have run) before the second attempt needs it: torch's library is mapped.
    wait_for(lambda: any(map(_maps_torch, warm_procs)), 120, f"the warm {warm} to import torch")
    open(go, "w").close()  # the first attempt fails; the spare/template makes the second
    job = node.wait_job(job_id, timeout=240)
    log = node.rank_log(job_id, 0)
    assert pb.JobState.Name(job.state) == "SUCCEEDED", log
    marks = {"spare": "from a warm spare", "template": "from the worker template"}
    assert job.restarts == 1 and marks[warm] in log, log
    files = re.findall(r"TORCH_FILE (\S+)", log)
    assert len(files) == 2 and all("site-packages" in f for f in files), log
    assert not os.path.exists(os.path.join(shared, "PWNED")), \
        open(os.path.join(shared, "PWNED")).read()


# ---------------------------------------------------------------- 4. cwd as the user

def _cwd_message(result: subprocess.CompletedProcess, path: str) -> str:
    assert result.returncode != 0, result.stdout
    return result.stderr.replace(path, "<cwd>")


def test_a_cwd_the_user_cannot_enter_reads_like_a_missing_one(node, users):
    alice, bob = users["alice"], users["bob"]
    private = bob.mkdir(os.path.join(node.root, "bob-private"), 0o700)
    hidden = bob.mkdir(os.path.join(private, "project"))
    missing = os.path.join(node.root, "no-such-dir")
    hidden_msg = _cwd_message(_submit_with_cwd(node, alice, hidden), hidden)
    missing_msg = _cwd_message(_submit_with_cwd(node, alice, missing), missing)
    assert hidden_msg == missing_msg
    assert f"does not exist or is not accessible to uid {alice.uid}" in hidden_msg
    # Root's own submits keep working, in any directory.
    root_job = node.submit("/bin/true", cwd=hidden)
    assert pb.JobState.Name(node.wait_job(root_job).state) == "SUCCEEDED"


def _submit_with_cwd(d, user: User, cwd: str) -> subprocess.CompletedProcess:
    """Submit as ``user`` with ``cwd`` as the job's directory, whatever it is (the
    request is made through the real client library, as that user)."""
    code = textwrap.dedent(f"""
        import sys
        from elasticctl.client import Client, CtlError
        from elasticd.v1 import control_pb2 as pb
        try:
            with Client({d.socket!r}) as c:
                c.call("Submit", pb.SubmitRequest(command=["/bin/true"], cwd={cwd!r}))
        except CtlError as exc:
            print(exc, file=sys.stderr)
            sys.exit(1)
    """)
    path = os.path.join(d.root, f"submit-{user.name}.py")
    with open(path, "w") as fh:
        fh.write(code)
    return user.run(["env", f"HOME={user.home}", f"PYTHONPATH={_PYTHONPATH}",
                     PY, path], cwd="/", timeout=120)


def test_a_job_whose_cwd_became_unenterable_fails_and_does_not_run_there(node, users):
    alice, bob = users["alice"], users["bob"]
    work = alice.mkdir(os.path.join(node.root, "alice-later"))
    blocker = node.submit("/bin/sleep", "600", nproc=2)  # holds both slots
    node.wait_state(blocker, "RUNNING")
    marker = os.path.join(alice.home, "ran-in-cwd")  # alice may write there
    job_id = submitted(submit_as(node, alice, "--", "/bin/sh", "-c", f"pwd > {marker}",
                                 cwd=work))
    # Accepted as alice; before it starts the directory goes to bob, 0700.
    os.chown(work, bob.uid, bob.gid)
    os.chmod(work, 0o700)
    assert node.ctl("cancel", blocker).returncode == 0
    job = node.wait_job(job_id, timeout=60)
    assert pb.JobState.Name(job.state) == "FAILED"
    assert f"does not exist or is not accessible to uid {alice.uid}" in job.reason, job
    assert not os.path.exists(marker)


# ---------------------------------------------------------------- 5. error files

def test_a_symlinked_error_file_leaks_nothing(node, users):
    alice = users["alice"]
    secret_dir = os.path.join(node.root, "root-only")
    os.mkdir(secret_dir, 0o700)
    secret = os.path.join(secret_dir, "error.json")
    with open(secret, "w") as fh:
        json.dump({"message": {"message": "TOPSECRET-4711 root's own words",
                               "extraInfo": {"py_callstack": "TOPSECRET-4711 traceback"}}}, fh)
    os.chmod(secret, 0o600)
    work = alice.mkdir(os.path.join(node.root, "alice-link"))
    job_id = submitted(submit_as(
        node, alice, "--max-restarts", "0", "--", PY, "-c",
        f"import os; os.symlink({secret!r}, os.environ['TORCHELASTIC_ERROR_FILE']); "
        "raise SystemExit(1)", cwd=work))
    job = node.wait_job(job_id, timeout=60)
    assert pb.JobState.Name(job.state) == "FAILED"
    assert "unreadable error file" in job.last_failure.cause, job
    assert "TOPSECRET" not in everything_shown(node, job_id)


def test_a_fifo_error_file_neither_blocks_cancel_nor_keeps_the_slots(node, users):
    alice = users["alice"]
    work = alice.mkdir(os.path.join(node.root, "alice-fifo"))
    # Each attempt exits with a code of its own: the same failure three times in a row
    # would end the job as a crash loop (agent.crash_loop_limit) before the cancel.
    job_id = submitted(submit_as(
        node, alice, "--nproc-per-node", "2", "--max-restarts", "1000", "--", PY, "-c",
        "import os, time; os.mkfifo(os.environ['TORCHELASTIC_ERROR_FILE']); time.sleep(0.5); "
        "raise SystemExit(1 + int(os.environ['TORCHELASTIC_RESTART_COUNT']) % 100)", cwd=work))
    wait_for(lambda: status(node, job_id)["restarts"] >= 2, 60, "two restarts")
    assert "unreadable error file" in status(node, job_id)["last_failure"]["cause"]
    r = node.ctl("cancel", job_id, timeout=30)  # root's cancel, as in the report
    assert r.returncode == 0, r.stderr
    node.wait_state(job_id, "CANCELLED", timeout=30)
    # Both slots are free again: a job needing both runs.
    after = node.submit("/bin/true", nproc=2)
    assert pb.JobState.Name(node.wait_job(after, timeout=60).state) == "SUCCEEDED"


# ---------------------------------------------------------------- 6. the job store

ATTACK = """\
import datetime, sys
from torch.distributed import TCPStore
s = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,
             timeout=datetime.timedelta(seconds=10))
n = 0
for rnd in range(4):
    for attempt in range(3):
        for it in range(12):
            # PrefixStore joins with "/": where main's ranks look for a fault.
            p = "elasticd/inprocess/r%da%d//it%d//" % (rnd, attempt, it)
            for key, value in (("fault", "PWNED by mallory"), ("verdict", "restart")):
                for prefix in ("", "/"):
                    s.set(prefix + p + key, value)
                    n += 1
print("planted", n)
"""


def job_store_process(node, job_id: str, uid: int) -> "psutil.Process | None":
    """The job's store process (jobstore/server.py: forked from the job's worker template,
    or started on its own): the process of ``uid`` that listens on the port the daemon's
    log names for the job's store; None until there is one."""
    ports = re.findall(rf"job={re.escape(job_id)}\b.*job store for in-process restart on "
                       r"\S+:(\d+)", node.log())
    if not ports:
        return None
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == int(ports[-1]) and conn.pid \
                and conn.status == psutil.CONN_LISTEN:
            try:
                proc = psutil.Process(conn.pid)
                if proc.uids().real == uid:
                    return proc
            except psutil.Error:
                pass
    return None


def _listening(pid: int) -> list[tuple[str, int]]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            local = line.split()[3]
            host, _, port = local.rpartition(":")
            found.append((host.strip("[]"), int(port)))
    return found


@pytest.mark.slow  # 60-80 s of a real attack; test_jobstore_auth.py covers forging by default
def test_the_job_store_listens_on_loopback_and_another_user_cannot_fail_the_job(node, users):
    alice, mallory = users["alice"], users["mallory"]
    work = alice.mkdir(os.path.join(node.root, "alice-inproc"))
    job_id = submitted(submit_as(
        node, alice, "--inprocess", "--nproc-per-node", "2", "--max-restarts", "0", "--",
        PY, "-m", "elasticd.examples.train_inprocess", "--steps", "1200", "--step-time", "0.05",
        "--log-every", "20", cwd=work))
    store = wait_for(lambda: job_store_process(node, job_id, alice.uid), 120,
                     "alice's job store")
    addrs = wait_for(lambda: _listening(store.pid), 60, "the job store listening")
    assert [host for host, _ in addrs] == ["127.0.0.1"], addrs
    port = addrs[0][1]
    # Once the ranks train, mallory connects and plants faults where main kept them.
    wait_for(lambda: "INPROCESS_ITERATION 0" in _log(node, job_id, 1), 180,
             f"the ranks training ({job_id})", lambda: (status(node, job_id),
                                                     _log(node, job_id, 1)[-2000:]))
    secret = _secret_of(status(node, job_id)["workers"][0]["pid"])
    script = os.path.join(node.root, "attack.py")
    with open(script, "w") as fh:
        fh.write(ATTACK)
    os.chmod(script, 0o644)
    r = mallory.run(["env", f"PYTHONPATH={_PYTHONPATH}", PY, script,
                     "127.0.0.1", str(port)], cwd="/", timeout=120)
    assert "planted" in r.stdout, r.stderr
    assert status(node, job_id)["state"] == "RUNNING"  # planted while it trains
    job = node.wait_job(job_id, timeout=240)
    logs = node.rank_log(job_id, 0) + node.rank_log(job_id, 1)
    assert pb.JobState.Name(job.state) == "SUCCEEDED", logs[-3000:]
    assert job.restarts == 0
    assert re.findall(r"INPROCESS_ITERATION (\d+)", logs) == ["0", "0"], logs[-3000:]
    shown = everything_shown(node, job_id)
    assert "PWNED" not in shown and "PWNED" not in logs
    # The secret prefix (128 bits) is in no status, event or log line.
    assert len(secret) >= 32
    assert secret not in shown and secret not in logs


def _log(d, job_id: str, rank: int) -> str:
    try:
        return d.rank_log(job_id, rank)
    except FileNotFoundError:  # not started yet
        return ""


def _secret_of(pid: int) -> str:
    """The store secret in a rank's environment, as root reads it: /proc/PID/environ for
    a rank started cold; for one forked from the worker template (whose start-up
    environment, the one /proc shows, never holds a job's secret) the ``NAME=value``
    string its os.environ put into the C environment, found in the rank's heap."""
    with open(f"/proc/{pid}/environ", "rb") as fh:
        env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
    if env.get(b"ELASTICD_STORE_SECRET"):
        return env[b"ELASTICD_STORE_SECRET"].decode()
    pattern = re.compile(rb"ELASTICD_STORE_SECRET=([0-9a-f]{32,})\0")
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or fields[5] != "[heap]":
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            mem.seek(start)
            found = pattern.search(mem.read(end - start))
            if found:
                return found.group(1).decode()
    return ""


# ---------------------------------------------------------------- 7. socket squatting

class Squatter:
    """mallory's fake daemon: sockets at ``path`` (and .cred) that note any caller."""

    def __init__(self, path: str, owner: User):
        self.path, self.calls = path, []
        self._socks = []
        for p in (path, path + ".cred"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(p)
            s.listen(8)
            s.settimeout(0.2)
            os.chown(p, owner.uid, owner.gid)
            os.chmod(p, 0o777)  # so that a victim can connect
            self._socks.append(s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            for s in self._socks:
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                self.calls.append(s.getsockname())
                conn.sendall(b"squatted-token\n")
                conn.close()

    def close(self):
        self._stop.set()
        self._thread.join(5)
        for s in self._socks:
            s.close()


def ctl_as(user: User, args: list, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("XDG_RUNTIME_DIR", "ELASTICD_SOCKET", "ELASTICD_DAEMON_SOCKET")}
    uid, gid, groups = user.creds
    return subprocess.run([PY, os.path.join(REPO, "tests", "run_as.py"), str(uid), str(gid),
                           ",".join(map(str, groups)), "--", *args], capture_output=True,
                          text=True, timeout=60, cwd="/", env={**base, **env})


def test_a_squatted_socket_is_refused(users):
    alice, mallory = users["alice"], users["mallory"]
    # main's fallback without XDG_RUNTIME_DIR: mallory creates it first.
    tmp_dir = f"/tmp/elasticd-{alice.uid}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    mallory.mkdir(tmp_dir, 0o755)
    squat = Squatter(mallory.mkdir(os.path.join(tmp_dir, "elasticd")) + "/control.sock",
                     mallory)
    mine = mallory.mkdir(short_tmpdir("h14b-mallory-"), 0o755)
    there = Squatter(os.path.join(mine, "control.sock"), mallory)
    try:
        # No XDG_RUNTIME_DIR (as under su): the /tmp path is not used at all.
        r = ctl_as(alice, ["list"], {"HOME": alice.home})
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert tmp_dir not in r.stderr
        # Pointed at mallory's socket (a shared script's ELASTICD_SOCKET): refused.
        r = ctl_as(alice, ["list"], {"HOME": alice.home, "ELASTICD_SOCKET": there.path})
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert f"belongs to uid {mallory.uid}" in r.stderr
        # A link to it in alice's own directory: refused too.
        link = os.path.join(alice.mkdir(os.path.join(alice.home, "run"), 0o700), "ctl.sock")
        os.symlink(there.path, link)
        r = ctl_as(alice, ["--socket", link, "list"], {"HOME": alice.home})
        assert r.returncode == 3 and "symbolic link" in r.stderr, (r.stdout, r.stderr)
        assert squat.calls == [] and there.calls == []
    finally:
        squat.close()
        there.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
        shutil.rmtree(mine, ignore_errors=True)


def test_the_own_socket_in_a_directory_others_can_write_is_refused(users):
    alice = users["alice"]
    shared = short_tmpdir("h14b-shared-")
    os.chmod(shared, 0o777)  # not sticky: anyone could swap the socket
    try:
        sock_path = os.path.join(shared, "control.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(sock_path)
        os.chown(sock_path, alice.uid, alice.gid)
        r = ctl_as(alice, ["--socket", sock_path, "list"], {"HOME": alice.home})
        assert r.returncode == 3 and "writable by others" in r.stderr, (r.stdout, r.stderr)
        s.close()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_the_non_root_default_socket_lives_under_home_without_a_runtime_dir(monkeypatch):
    from elasticd import config
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    sock, state = config.default_paths(1234)
    assert sock == "/home/someone/.local/state/elasticd/control.sock"
    assert state == "/home/someone/.local/state/elasticd"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert config.default_paths(1234)[0] == "/run/user/1234/elasticd/control.sock"
