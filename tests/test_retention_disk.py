"""A node's disk does not fill (issue 29, item 7): a real root daemon on a small tmpfs
state dir, real unprivileged users (made here with useradd, names prefixed ``h29d``,
removed on teardown) submitting many jobs that each write more than the per-rank
log cap and end within a second. Retention keeps the logs within
``retention.log_bytes``, every user can still submit and read their newest logs,
and run dirs go with their jobs, also those a restarted daemon finds."""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from daemons import REPO, DaemonProc, real_users, short_tmpdir

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: real users (useradd), a root daemon, "
                                       "a tmpfs mount (CI runs as root)")

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
GROUP = f"h29d_ctl{_WORKER}"
USERS = (f"h29d_alice{_WORKER}", f"h29d_bob{_WORKER}")
MiB = 1 << 20
TMPFS = 16 * MiB
LOG_BUDGET = 3 * MiB
RANK_CAP = MiB            # agent.log_max_bytes (its least)
JOBS_PER_USER = 6
MAX_JOBS = 8


@pytest.fixture(scope="module")
def users():
    with real_users(USERS, GROUP) as made:
        yield [tuple(made[n][:2]) + (tuple(made[n][2]),) for n in USERS]


class Session:
    """elasticctl as a real user, many commands in one process (tests/run_as.py
    --session); ``ctl`` is safe to call from several threads."""

    def __init__(self, d: DaemonProc, who: tuple, cwd: str):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "run_as.py"), str(who[0]), str(who[1]),
             ",".join(map(str, who[2])), "--", "--session"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=cwd)
        self.socket = d.socket
        self._lock = threading.Lock()

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        with self._lock:
            self.proc.stdin.write(json.dumps(["--socket", self.socket, *args]) + "\n")
            self.proc.stdin.flush()
            got = json.loads(self.proc.stdout.readline())
        return subprocess.CompletedProcess(args, got["rc"], got["stdout"], got["stderr"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


class Usage:
    """Samples what the state dir's filesystem and its logs take, every 10 ms."""

    def __init__(self, state: str):
        self.state = state
        self.peak_used = self.peak_logs = self.peak_db = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def logs(self) -> int:
        total = 0
        for d, _, files in os.walk(os.path.join(self.state, "logs")):
            for f in files:
                try:
                    total += os.lstat(os.path.join(d, f)).st_blocks * 512
                except FileNotFoundError:
                    pass
        return total

    def used(self) -> int:
        st = os.statvfs(self.state)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak_used = max(self.peak_used, self.used())
            self.peak_logs = max(self.peak_logs, self.logs())
            self.peak_db = max(self.peak_db, self.db())

    def db(self) -> int:
        total = 0
        for name in ("jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm"):
            try:
                total += os.lstat(os.path.join(self.state, name)).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_a_small_state_dir_stays_within_budget_while_every_user_submits_and_reads(users):
    root = short_tmpdir()
    state = os.path.join(root, "state")
    os.makedirs(state)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS},mode=0700", "h29d-state",
                    state], check=True)
    d = DaemonProc(root, slots=4, extra_args=(
        "--set", f"daemon.socket_group={GROUP}",
        "--set", f"agent.log_max_bytes={RANK_CAP}", "--set", "agent.log_check_interval=60",
        "--set", f"retention.log_bytes={LOG_BUDGET}", "--set", f"retention.max_jobs={MAX_JOBS}",
        "--set", "retention.interval=5", "--set", f"limits.state_min_free_bytes={MiB}"))
    try:
        d.start()
        work = {}
        for who in users:
            work[who] = os.path.join(root, f"work-{who[0]}")
            os.makedirs(work[who])
            os.chown(work[who], who[0], who[1])

        # Four sessions, two per user, each running its jobs one after another.
        sessions = [(who, Session(d, who, work[who])) for _ in range(2) for who in users]

        def run(k: int) -> list[tuple[tuple, str, int]]:
            who, ses = sessions[k]
            done = []
            for i in range(k // 2, JOBS_PER_USER, 2):
                # 1.5 MB in well under a second, then the job ends: between two checks.
                script = f"yes {'x' * 99} | head -c 1500000; echo; echo END-{who[0]}-{i}"
                r = ses.ctl("-o", "json", "submit", "--", "/bin/sh", "-c", script)
                assert r.returncode == 0, r.stderr
                job = json.loads(r.stdout)["id"]
                w = ses.ctl("wait", job)
                assert w.returncode == 0, (w.stdout, w.stderr, d.log()[-3000:])
                shown = ses.ctl("logs", job, "--tail", "1")
                assert shown.returncode == 0, shown.stderr  # read at once: the newest stay
                assert shown.stdout.strip() == f"END-{who[0]}-{i}", shown.stdout[-200:]
                done.append((who, job, i))
            return done

        t0 = time.monotonic()
        with Usage(state) as usage, concurrent.futures.ThreadPoolExecutor(4) as pool:
            jobs = [j for f in [pool.submit(run, k) for k in range(4)] for j in f.result()]
            deadline = time.monotonic() + 30  # the pass after the last job's end
            while time.monotonic() < deadline and (usage.logs() > LOG_BUDGET or len(json.loads(
                    d.ctl("-o", "json", "list").stdout)["jobs"]) > MAX_JOBS):
                time.sleep(0.05)
            settled = usage.logs()
        took = time.monotonic() - t0
        print(f"\n{len(jobs)} jobs x 1.5 MB in {took:.1f} s on a {TMPFS // MiB} MiB tmpfs: "
              f"peak used {usage.peak_used / MiB:.2f} MiB, peak logs "
              f"{usage.peak_logs / MiB:.2f} MiB, peak database {usage.peak_db / MiB:.2f} MiB, "
              f"logs after {settled / MiB:.2f} MiB "
              f"(retention.log_bytes {LOG_BUDGET / MiB:.0f} MiB)")
        assert settled <= LOG_BUDGET
        # Beside the budget: up to 4 running jobs' logs (each past the cap until it
        # ends), and one just ended per session until the pass its end wakes. The jobs
        # wrote 18 MB in all: without retention and the last cap the tmpfs fills.
        assert usage.peak_logs <= LOG_BUDGET + 8 * 1_600_000
        assert usage.peak_used < TMPFS - MiB
        assert "ENOSPC" not in d.log() and "No space left" not in d.log()

        # The newest jobs' logs are there; older ones' records say their logs were
        # retired; the oldest are retired whole (beyond retention.max_jobs).
        listed = json.loads(d.ctl("-o", "json", "list").stdout)["jobs"]
        assert len(listed) == MAX_JOBS
        kept = {j["id"] for j in listed}
        retired_logs = 0
        mine = {who: ses for who, ses in sessions}
        for who, job, i in jobs:
            status = mine[who].ctl("-o", "json", "status", job)
            if job not in kept:
                assert status.returncode == 1 and "NOT_FOUND" in status.stderr
                continue
            assert json.loads(status.stdout)["state"] == "SUCCEEDED"
            shown = mine[who].ctl("logs", job)
            if shown.returncode:
                assert "were retired" in shown.stderr and "retention.log_bytes" in shown.stderr
                retired_logs += 1
            else:  # 1.5 MB written between two size checks, cut at the job's end
                assert shown.stdout.rstrip().endswith(f"END-{who[0]}-{i}")
                assert "log rotated" in shown.stdout
                job_dir = os.path.join(state, "logs", job)
                assert sum(os.path.getsize(os.path.join(job_dir, n))
                           for n in os.listdir(job_dir)) <= RANK_CAP
        assert 1 <= retired_logs < MAX_JOBS
        for _, ses in sessions:
            ses.close()
        assert os.listdir(os.path.join(root, "run", "jobs")) == []

        # A daemon that starts finds run dirs of ended jobs (one holding a link a user
        # planted to a root file): it removes them, never what the link points to.
        d.stop()
        alice = users[0]
        precious = os.path.join(root, "root-only")
        with open(precious, "w") as fh:
            fh.write("root's")
        for name in (jobs[-1][1], "nosuchjob"):
            run_dir = os.path.join(root, "run", "jobs", name)
            os.makedirs(os.path.join(run_dir, "sub"))
            os.symlink(precious, os.path.join(run_dir, "sub", "error.json"))
            os.symlink(root, os.path.join(run_dir, "up"))
            for p in (run_dir, os.path.join(run_dir, "sub")):
                os.chown(p, alice[0], alice[1])
        d.start()
        deadline = time.monotonic() + 20
        while os.listdir(os.path.join(root, "run", "jobs")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.listdir(os.path.join(root, "run", "jobs")) == []
        assert open(precious).read() == "root's" and os.path.isdir(state)
        again = d.ctl("-o", "json", "submit", "--", "/bin/echo", "after", cwd=work[alice],
                      user=alice)
        assert again.returncode == 0, again.stderr
    finally:
        d.cleanup()
        subprocess.run(["umount", "-l", state], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
