"""Shared pieces of the benchmarks: a real daemon on a temp socket, process
clean-up, and small statistics/table helpers.

Nothing here asserts a timing: the benchmarks print numbers, ratios and a
PASS/MISS against the design goals, and exit 0 unless the benchmark itself
could not run.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

from elasticd.v1 import control_pb2 as pb
from elasticctl.client import Client

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}

# -- clean-up ------------------------------------------------------------------
# Every process a benchmark starts is registered here (with its create time,
# so a recycled pid is never killed) and killed, with everything below it, at
# exit, on Ctrl-C and on SIGTERM.
_owned: dict[int, float] = {}
_dirs: list[str] = []


def own(proc) -> None:
    """Remember a process (Popen or pid) and, at clean-up, its descendants."""
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        _owned[pid] = psutil.Process(pid).create_time()
    except psutil.Error:
        pass


def own_tree(pid: int) -> None:
    """Remember a process and every descendant it has right now."""
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            _owned.setdefault(p.pid, p.create_time())
    except psutil.Error:
        pass


def kill_owned(grace: float = 0.0) -> None:
    """SIGKILL every remembered process still alive (same pid and create time)."""
    procs = []
    for pid, created in list(_owned.items()):
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 0.01:
                procs.append(p)
                procs.extend(p.children(recursive=True))
        except psutil.Error:
            pass
    seen = set()
    for p in procs:
        if p.pid in seen:
            continue
        seen.add(p.pid)
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=max(grace, 2.0))
    _owned.clear()


def tree(pid: int) -> list:
    """A process and its descendants right now (psutil objects; [] if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def kill_procs(procs: list) -> None:
    """SIGKILL these psutil processes (psutil refuses a pid that was reused) and reap."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def tempdir(prefix: str) -> str:
    """A short /tmp dir (unix socket paths are limited to 107 bytes), removed at exit."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(path, 0o755)
    _dirs.append(path)
    return path


def _cleanup() -> None:
    kill_owned()
    for path in _dirs:
        shutil.rmtree(path, ignore_errors=True)
    _dirs.clear()


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)


atexit.register(_cleanup)
signal.signal(signal.SIGTERM, _on_signal)


# -- a real daemon -------------------------------------------------------------
class BenchDaemon:
    """``python -m elasticd --standalone`` on its own temp socket and state dir."""

    def __init__(self, root: str | None = None, slots: int = 8, extra_args: tuple = (),
                 node_id: str = "bench", env: dict | None = None):
        self.root = root or tempdir("edb-")
        self.env = env
        self.socket = os.path.join(self.root, "run", "control.sock")
        self.state_dir = os.path.join(self.root, "state")
        self.log_path = os.path.join(self.root, "daemon.log")
        # Its own snapshot root (a later --set in extra_args wins: /dev/shm/... for tmpfs):
        # daemons side by side never remove each other's jobs' snapshot dirs.
        self.args = ["--standalone", "--node-id", node_id, "--socket", self.socket,
                     "--state-dir", self.state_dir, "--metrics-port", "0",
                     "--slots", str(slots),
                     "--set", f"snapshot.root={os.path.join(self.root, 'shm')}", *extra_args]
        self.proc: subprocess.Popen | None = None
        self._client: Client | None = None

    def start(self, timeout: float = 30.0, poll: float = 0.005) -> float:
        """Start the daemon; returns seconds from exec to the first answered ListNodes."""
        with open(self.log_path, "ab") as logf:
            t0 = time.monotonic()
            self.proc = subprocess.Popen([sys.executable, "-m", "elasticd", *self.args],
                                         stdout=logf, stderr=subprocess.STDOUT,
                                         cwd=self.root, env=self.env)
        own(self.proc)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"elasticd exited {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket) and os.path.exists(self.socket + ".cred"):
                try:
                    with Client(self.socket) as c:
                        c.call("ListNodes", pb.ListNodesRequest())
                    return time.monotonic() - t0
                except Exception:  # not serving yet
                    pass
            time.sleep(poll)
        raise RuntimeError(f"elasticd not ready after {timeout}s:\n{self.log()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self) -> Client:
        """One long-lived client (one channel, one token) for this daemon."""
        if self._client is None:
            self._client = Client(self.socket)
        return self._client

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, wait; then kill whatever it started that is still alive."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is None:
            return
        procs = tree(self.proc.pid)[1:]  # its workers and warm spares right now
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Anything it started that outlived it (it should not: PDEATHSIG).
        for pid in worker_pids_under(self.state_dir):
            procs.extend(tree(pid))
        kill_procs(procs)

    def log(self) -> str:
        return read_text(self.log_path)

    # -- calls -----------------------------------------------------------------
    def submit(self, command: list, cwd: str, nproc: int = 1, max_restarts: int = -1,
               env: dict | None = None, inprocess: bool = False) -> str:
        req = pb.SubmitRequest(command=list(command), cwd=cwd,
                               env=dict(env if env is not None else os.environ),
                               nproc_per_node=nproc, max_restarts=max_restarts,
                               inprocess=inprocess)
        return self.client().call("Submit", req).job.id

    def get_job(self, job_id: str) -> pb.Job:
        return self.client().call("GetJob", pb.GetJobRequest(id=job_id))

    def cancel(self, job_id: str) -> None:
        self.client().call("CancelJob", pb.CancelJobRequest(id=job_id), wait=30)

    def wait_job(self, job_id: str, timeout: float = 120.0) -> pb.Job:
        deadline = time.monotonic() + timeout
        c = self.client()
        while True:
            left = deadline - time.monotonic()
            job = c.call("WaitJob", pb.WaitJobRequest(id=job_id, timeout_seconds=max(
                0.1, min(left, 5.0))), wait=5.0)
            if pb.JobState.Name(job.state) in TERMINAL:
                return job
            if left <= 0:
                raise TimeoutError(f"job {job_id} still {pb.JobState.Name(job.state)} "
                                   f"after {timeout}s")

    def events(self, job_id: str) -> list:
        return list(self.client().stream("Events", pb.EventsRequest(id=job_id)))

    def rank_log(self, job_id: str, rank: int) -> str:
        return read_text(os.path.join(self.state_dir, "logs", job_id, f"rank-{rank}.log"))


def worker_pids_under(state_dir: str) -> list[int]:
    """Live processes that are workers of jobs in this state dir (by ELASTICD_JOB_ID)."""
    try:
        job_ids = set(os.listdir(os.path.join(state_dir, "logs")))
    except FileNotFoundError:
        return []
    if not job_ids:
        return []
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("ELASTICD_JOB_ID") in job_ids:
            found.append(proc.pid)
    return found


# -- the sample job's marks -------------------------------------------------------
# The sample scripts print 'CRASH <unix time> rank=R ...' just before the fault
# and, on rank 0, 'FIRST_STEP <unix time> attempt=A [iteration=I]' after the
# first step of each process attempt / in-process iteration (workers' clock).
CRASH_LINE = re.compile(r"^CRASH (\d+\.\d+) rank=(\d+)", re.M)
FIRST_STEP_LINE = re.compile(r"^FIRST_STEP (\d+\.\d+) attempt=(\d+)(?: iteration=(\d+))?", re.M)


def fault_marks(text: str) -> tuple:
    """(crash time, first FIRST_STEP after it, its attempt, its iteration) from worker output.

    Any part not found is None; iteration is None for a script that has none.
    """
    crashes = [float(t) for t, _ in CRASH_LINE.findall(text)]
    crash = min(crashes) if crashes else None
    if crash is None:
        return None, None, None, None
    after = sorted((float(t), int(a), int(i) if i else None)
                   for t, a, i in FIRST_STEP_LINE.findall(text) if float(t) > crash)
    return (crash, *after[0]) if after else (crash, None, None, None)


# -- torchrun --------------------------------------------------------------------
def torchrun_bin() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if os.path.exists(beside):
        return [beside]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def torchrun_env(shared_store: bool = False) -> dict:
    """The environment the benchmarks give torchrun (and, for fairness, elasticd jobs).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless ``shared_store``: with torch
    2.13's default the restarted gloo workers read the previous attempt's
    addresses from the shared store and fail or hang (pytorch#135712); see
    bench/README.md.
    """
    env = dict(os.environ, LOGLEVEL="INFO")
    if not shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def start_torchrun(args: list, cwd: str, base: str, env: dict | None = None):
    """torchrun ARGS in its own session, stdout/stderr to BASE.out/.err; owned."""
    with open(base + ".out", "wb") as out, open(base + ".err", "wb") as err:
        proc = subprocess.Popen([*torchrun_bin(), *args], cwd=cwd,
                                env=env if env is not None else torchrun_env(),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
    own(proc)
    return proc


def stop_torchrun(proc) -> None:
    """SIGTERM torchrun (it stops its workers), then kill what is left of its tree."""
    procs = tree(proc.pid)  # hung workers are still its children
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    kill_procs(procs)
    proc.wait()


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def last_error(text: str) -> str:
    """The last '...Error: ' line of a log (why a torchrun run failed), or ''."""
    last = [ln for ln in text.splitlines() if re.search(r"\w+Error: ", ln)][-1:]
    return last[0].strip()[:300] if last else ""


# -- statistics and printing -----------------------------------------------------
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def percentile(xs, q: float):
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ms(seconds, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f} ms"


def secs(seconds, digits: int = 3) -> str:
    return "-" if seconds is None else f"{seconds:.{digits}f} s"


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [line(cells[0]), line(["-" * w for w in widths])]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def machine() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} CPUs, load average {load}, Python {sys.version.split()[0]}, "
            f"{os.uname().sysname} {os.uname().release}")


def _cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        vals = [int(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals[:8]), idle


def busy_percent(window: float = 0.5) -> float:
    """Share of all CPUs busy over ``window`` seconds, whoever uses them."""
    t0, i0 = _cpu_jiffies()
    time.sleep(window)
    t1, i1 = _cpu_jiffies()
    return 100.0 * (1 - (i1 - i0) / max(1, t1 - t0))


def wait_quiet(threshold: float, max_wait: float) -> float:
    """Wait (up to max_wait s) until the machine is under ``threshold`` % busy.

    On a shared machine other work skews start-up times by seconds; this
    keeps each run from starting in the middle of someone else's burst.
    Returns the last busy % seen (printed with each run).
    """
    deadline = time.monotonic() + max_wait
    while True:
        busy = busy_percent()
        if busy < threshold or time.monotonic() >= deadline:
            return busy


def run_each(names: list[str], reps: int, run_one, quiet_wait: float = 0.0,
             quiet_threshold: float = 30.0, rotate: bool = True) -> list:
    """``run_one(name, rep, busy)`` for each name, ``reps`` times; prints each result's line().

    With ``rotate`` the order turns by one each repetition, so no launcher is
    always first; with ``quiet_wait`` each run waits for a quiet machine
    first (``busy`` is the % busy it saw, else None).
    """
    runs = []
    for rep in range(1, reps + 1):
        k = (rep - 1) % len(names) if rotate else 0
        for name in names[k:] + names[:k]:
            busy = wait_quiet(quiet_threshold, quiet_wait) if quiet_wait > 0 else None
            run = run_one(name, rep, busy)
            runs.append(run)
            print(run.line(), flush=True)
    return runs


def _code_repo() -> str:
    """The checkout whose daemon code this process imports: REPO, or another tree's
    when PYTHONPATH names its daemon/ (a before/after run of the same bench script)."""
    try:
        import elasticd
    except ImportError:
        return REPO
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(elasticd.__file__))))
    return root if os.path.exists(os.path.join(root, ".git")) else REPO


def revision() -> str:
    """The elasticd commit measured (of the daemon code imported), and whether its
    daemon/ or ctl/ differ from it."""
    repo = _code_repo()
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--",
                                "daemon", "ctl"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + uncommitted changes in daemon/ or ctl/" if dirty else "")
