"""Real elasticd daemons as subprocesses on real unix sockets, for tests.

``DaemonProc`` starts ``python -m elasticd --standalone`` with its own socket
and state dir under a short /tmp path (unix socket paths are limited to 107
bytes) and talks to it with the real elasticctl. Tests import from here
(``from daemons import ...``); the fixtures live in conftest.py.
"""
from __future__ import annotations

import atexit
import contextlib
import grp
import os
import pwd
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

from elasticd.v1 import control_pb2 as pb
from elasticctl.client import Client

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
# elasticctl runs by DaemonProc.ctl in this process: [calls, CPU seconds they took]
# (tests/conftest.py's ELASTICD_TEST_CPU_LOG records them per case).
CTL_CALLS = [0, 0.0]


class DaemonProc:
    def __init__(self, root: str, node_id: str = "node-a", slots: int = 4,
                 extra_args: tuple = (), env: dict | None = None, etcd: str | None = None):
        self.root = root
        self.node_id = node_id
        self.socket = os.path.join(root, "run", "control.sock")
        self.state_dir = os.path.join(root, "state")
        # Its own snapshot root: daemons side by side never remove each other's jobs' dirs.
        self.snapshot_dir = os.path.join(root, "shm")
        self.log_path = os.path.join(root, f"daemon-{node_id}.log")
        where = ["--etcd", etcd, *cluster_key_args()] if etcd else ["--standalone"]
        self.args = [*where, "--node-id", node_id, "--socket", self.socket,
                     "--state-dir", self.state_dir, "--metrics-port", "0",
                     "--slots", str(slots), "--set", f"snapshot.root={self.snapshot_dir}",
                     *extra_args]
        self.env = dict(os.environ, **(env or {}))
        self.proc: subprocess.Popen | None = None
        # Argv put before the daemon's own (e.g. ``ip netns exec NS``, which
        # execs, so ``proc.pid`` is still the daemon's).
        self.wrap: list[str] = []

    # -- life cycle ----------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "DaemonProc":
        # How long the harness waits to be served, not a bound on the daemon (a daemon
        # that cannot start exits, which ends the wait at once): on a loaded machine
        # its imports alone have taken over 15 s.
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen([*self.wrap, sys.executable, "-m", "elasticd", *self.args],
                                     stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.root)
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"elasticd exited {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket) and os.path.exists(self.socket + ".cred"):
                try:
                    with self.client() as c:
                        c.call("ListNodes", pb.ListNodesRequest())
                    return self
                except Exception:  # not serving yet
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"elasticd not ready after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def cleanup(self) -> None:
        """Stop the daemon, kill any worker it left, remove its directory:
        nothing a test started may outlive it."""
        self.stop()
        kill_process_tree_of(worker_pids_under(self.state_dir))
        shutil.rmtree(self.root, ignore_errors=True)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def lose_node(self) -> None:
        """The node lost at once: its daemon and every worker it runs frozen together
        (SIGSTOP: no rank trains a step past the daemon's last replication), then killed.
        Killing the daemon first and then looking for its workers (a walk of /proc, a
        second on a loaded machine) let the workers and their peers train on for tens of
        steps the dead daemon never replicated."""
        assert self.proc is not None
        workers = worker_pids_under(self.state_dir)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            self.proc.send_signal(sig)
            kill_process_tree_of(workers, sig)
        self.proc.wait()
        kill_process_tree_of(worker_pids_under(self.state_dir))   # one started meanwhile

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

    # -- talking to it -------------------------------------------------------
    def client(self) -> Client:
        return Client(self.socket)

    def ctl(self, *args: str, cwd: str | None = None,
            timeout: float = 60.0, env: dict | None = None,
            user: tuple | None = None) -> subprocess.CompletedProcess:
        """Run the real elasticctl against this daemon."""
        cmd = [sys.executable, "-m", "elasticctl", "--socket", self.socket, *args]
        if user is not None:  # (uid, gid, [groups])
            uid, gid, groups = user
            cmd = [sys.executable, os.path.join(REPO, "tests", "run_as.py"), str(uid), str(gid),
                   ",".join(map(str, groups)), "--", "--socket", self.socket, *args]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  cwd=cwd or self.root, env=dict(os.environ, **(env or {})))
        finally:
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            CTL_CALLS[0] += 1
            CTL_CALLS[1] += (after.ru_utime + after.ru_stime) - (before.ru_utime
                                                                 + before.ru_stime)

    def submit(self, *command: str, nproc: int = 1, max_restarts: int = -1,
               name: str = "", cwd: str | None = None, env: dict | None = None) -> str:
        req = pb.SubmitRequest(command=list(command), cwd=cwd or self.root,
                               env=dict(os.environ, **(env or {})), nproc_per_node=nproc,
                               max_restarts=max_restarts, name=name)
        with self.client() as c:
            return c.call("Submit", req).job.id

    def job(self, job_id: str) -> pb.Job:
        with self.client() as c:
            return c.call("GetJob", pb.GetJobRequest(id=job_id))

    def wait_job(self, job_id: str, timeout: float = 90.0) -> pb.Job:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                left = deadline - time.monotonic()
                job = c.call("WaitJob", pb.WaitJobRequest(id=job_id, timeout_seconds=max(
                    0.1, min(left, 5.0))), wait=5.0)
                if pb.JobState.Name(job.state) in TERMINAL:
                    return job
                if left <= 0:
                    raise AssertionError(f"job {job_id} still {pb.JobState.Name(job.state)} "
                                         f"after {timeout}s:\n{self.log()[-4000:]}")

    def wait_state(self, job_id: str, state: str, timeout: float = 60.0,
                   pred=lambda job: True) -> pb.Job:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if pb.JobState.Name(job.state) == state and pred(job):
                return job
            time.sleep(0.05)
        raise AssertionError(f"job {job_id} never reached {state}; it is "
                             f"{pb.JobState.Name(job.state)}:\n{self.log()[-4000:]}")

    def rank_log(self, job_id: str, rank: int) -> str:
        path = os.path.join(self.state_dir, "logs", job_id, f"rank-{rank}.log")
        with open(path, errors="replace") as fh:
            return fh.read()

    def events(self, job_id: str) -> list[pb.Event]:
        with self.client() as c:
            return list(c.stream("Events", pb.EventsRequest(id=job_id)))


_cluster_key: list = []


def cluster_key_path() -> str:
    """One cluster key for every cluster daemon this test process starts (the daemons
    of a cluster must share one), made with the real `elasticd keygen`, removed at exit."""
    if not _cluster_key:
        directory = tempfile.mkdtemp(prefix="ed-key-", dir="/tmp")
        path = os.path.join(directory, "cluster.key")
        subprocess.run([sys.executable, "-m", "elasticd", "keygen", "--out", path],
                       check=True, capture_output=True)
        atexit.register(shutil.rmtree, directory, True)
        _cluster_key.append(path)
    return _cluster_key[0]


def cluster_key_args() -> list[str]:
    """What a daemon on etcd is started with in the tests: the shared cluster key, and
    cluster.allow_root_jobs on, because the test process is root and so are the jobs
    most cluster tests submit and expect other nodes to run. The tests of the
    refusal itself (test_cluster_trust.py) turn it off again with a later --set."""
    return ["--set", f"cluster.key_file={cluster_key_path()}",
            "--set", "cluster.allow_root_jobs=true"]


def wait_logged(pred, timeout: float, what: str, daemons: dict) -> object:
    """``pred()``'s first truthy value within ``timeout`` seconds; otherwise an
    AssertionError naming ``what``, with the tail of each daemon's log (name -> DaemonProc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    logs = "\n".join(f"--- {n}\n{d.log()[-3000:]}" for n, d in daemons.items())
    raise AssertionError(f"{what} within {timeout}s\n{logs}")


def short_tmpdir(prefix: str = "ed-") -> str:
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(path, 0o755)  # other users (the cross-user tests) must traverse it
    return path


def kill_process_tree_of(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """``sig`` to each pid's process group, and to the pid itself (one that leads no
    group of its own)."""
    for pid in pids:
        for send in (os.killpg, os.kill):
            try:
                send(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def worker_pids_under(state_dir: str) -> list[int]:
    """PIDs of live processes that are workers of jobs in this state dir."""
    try:
        job_ids = set(os.listdir(os.path.join(state_dir, "logs")))
    except FileNotFoundError:
        return []
    logs = os.path.join(os.path.realpath(state_dir), "logs") + os.sep
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("ELASTICD_JOB_ID") in job_ids or _output_under(proc.pid, logs):
            found.append(proc.pid)
    return found


def _output_under(pid: int, logs: str) -> bool:
    """Whether the process writes its stdout into ``logs``: a worker template, or a rank
    it forked (their /proc/PID/environ is the template's, which names no job)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/1").startswith(logs)
    except OSError:
        return False


def free_port() -> int:
    """A port free on loopback now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    """The daemon's /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def start_with_metrics(tries: int = 3, extra_args: tuple = ()) -> tuple[DaemonProc, int]:
    """A started daemon serving metrics on a free port, and the port; a port taken
    between finding and binding it (the daemon then says so in `nodes` and goes on
    without metrics) is tried again with another."""
    for attempt in range(tries):
        port = free_port()
        d = DaemonProc(short_tmpdir(), extra_args=(*extra_args, "--metrics-port", str(port)))
        d.start()
        with d.client() as c:
            me = [n for n in c.call("ListNodes", pb.ListNodesRequest()).nodes
                  if n.node_id == d.node_id][0]
        if not any("metrics endpoint" in p for p in me.problems):
            return d, port
        if attempt == tries - 1:
            raise AssertionError(f"no free metrics port in {tries} tries: {list(me.problems)}")
        d.cleanup()
    raise AssertionError("unreachable")


@contextlib.contextmanager
def real_users(names: tuple, group: str):
    """Real unprivileged users (useradd, no home, no shell), each in its own group and
    in ``group`` (the one that may use the control socket); removed on exit.
    Yields name -> (uid, gid, groups) as run_as.py takes it."""
    subprocess.run(["groupadd", "-f", group], check=True)
    made = {}
    try:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True)
            subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                            "--user-group", "-G", group, name], check=True)
            pw = pwd.getpwnam(name)
            made[name] = (pw.pw_uid, pw.pw_gid, [pw.pw_gid, grp.getgrnam(group).gr_gid])
        yield made
    finally:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
