"""Jobs end to end: the real elasticctl against a real elasticd, real torch gloo workers.

Each test drives the daemon the way a user does (``elasticctl submit / wait /
status / logs / events / cancel`` as subprocesses) and checks what that user
would see: exit codes, the state and cause ``status`` prints, the log lines.
Most tests share one daemon (``shared``) so the suite pays for one start, and
the jobs that need no interaction (``launched``) are submitted together so
their torch start-ups overlap.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import grpc
import psutil
import pytest

from daemons import DaemonProc, short_tmpdir, worker_pids_under
from elasticd.v1 import control_pb2 as pb

PY = sys.executable
TRAIN = [PY, "-m", "elasticd.examples.train"]
START_MARKER = "==== elasticd:"


@pytest.fixture(scope="module")
def shared():
    """One daemon for the tests that do not need a special configuration."""
    d = DaemonProc(short_tmpdir(), node_id="e2e", slots=16)
    d.start()
    yield d
    d.cleanup()


# ---------------------------------------------------------------- helpers

def ctl_ok(d: DaemonProc, *args: str, **kw) -> subprocess.CompletedProcess:
    res = d.ctl(*args, **kw)
    assert res.returncode == 0, (f"elasticctl {' '.join(args)} exited {res.returncode}\n"
                                 f"stdout: {res.stdout}\nstderr: {res.stderr}")
    return res


def submit(d: DaemonProc, *args: str, **kw) -> str:
    """`elasticctl submit ARGS` -> the job id it prints."""
    out = ctl_ok(d, "submit", *args, **kw).stdout.strip()
    assert out and len(out.split()) == 1, f"submit should print just the job id, got {out!r}"
    return out


def status_json(d: DaemonProc, job_id: str) -> dict:
    return json.loads(ctl_ok(d, "-o", "json", "status", job_id).stdout)


def events_json(d: DaemonProc, job_id: str) -> list[dict]:
    out = ctl_ok(d, "-o", "json", "events", job_id).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def moves(events: list[dict]) -> list[tuple]:
    return [(e["from_state"], e["to_state"]) for e in events if e["kind"] == "state"]


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


# ---------------------------------------------------------------- interactive

def test_logs_follow_returns_when_the_job_ends_with_its_last_line(shared):
    job_id = submit(shared, "--nproc-per-node", "2", "--", *TRAIN, "--steps", "50",
                    "--step-time", "0.02")
    shared.wait_state(job_id, "RUNNING")
    follower = subprocess.Popen(
        [PY, "-m", "elasticctl", "--socket", shared.socket, "logs", job_id, "--rank", "0", "-f"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=shared.root)
    try:
        job = shared.wait_job(job_id, timeout=120)
        assert pb.JobState.Name(job.state) == "SUCCEEDED"
        out, err = follower.communicate(timeout=10)  # must end by itself, soon after the job
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err
    assert out.startswith(START_MARKER)  # followed from the beginning of the log
    assert out.rstrip().splitlines()[-1].startswith("done: 50 steps")
    assert "[rank" not in out  # one rank asked for: no prefixes


def _nice(pid: int, tid: int | None = None) -> int:
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


def test_the_daemon_runs_above_its_jobs_and_their_processes_start_at_nice_0(shared):
    """daemon.nice (-5): every thread of the daemon; the job's ranks are back at 0."""
    job_id = submit(shared, "--nproc-per-node", "2", "--", *TRAIN, "--steps", "100000",
                    "--step-time", "0.05")
    try:
        job = shared.wait_state(job_id, "RUNNING", timeout=60,
                                pred=lambda j: len(j.workers) == 2)
        daemon = shared.proc.pid
        threads = {int(t): _nice(daemon, int(t)) for t in os.listdir(f"/proc/{daemon}/task")}
        assert set(threads.values()) == {-5}, threads
        assert [_nice(w.pid) for w in job.workers] == [0, 0]
    finally:
        ctl_ok(shared, "cancel", job_id)
        shared.wait_state(job_id, "CANCELLED", timeout=30)


def test_cancel_stops_a_running_job_and_its_workers(shared):
    job_id = submit(shared, "--nproc-per-node", "2", "--", *TRAIN, "--steps", "100000",
                    "--step-time", "0.05")
    job = shared.wait_state(job_id, "RUNNING", timeout=60,
                            pred=lambda j: len(j.workers) == 2)
    pids = [w.pid for w in job.workers]
    # Training is really under way (not just processes started).
    deadline = time.monotonic() + 60
    while "FIRST_STEP" not in shared.rank_log(job_id, 0):
        assert time.monotonic() < deadline, shared.rank_log(job_id, 0)
        time.sleep(0.1)
    assert len(alive(pids)) == 2

    res = ctl_ok(shared, "cancel", job_id)
    assert job_id in res.stdout
    shared.wait_state(job_id, "CANCELLED", timeout=10)
    # Workers that honour SIGTERM end within the stop grace period (5 s), with no
    # SIGKILL: timed by the daemon, from the cancel it took to the job's end (the
    # client's own start-up is not the daemon's stopping).
    events = shared.events(job_id)
    asked = next(e.time for e in events if e.reason.startswith("cancel requested by"))
    ended = next(e.time for e in events if e.to_state == pb.CANCELLED)
    assert 0 <= ended - asked < 5.0, f"cancel took {ended - asked:.1f}s"
    assert alive(pids) == []
    assert job_id not in {_job_of(pid) for pid in worker_pids_under(shared.state_dir)}

    waited = shared.ctl("wait", job_id, timeout=30)
    assert waited.returncode == 1  # not a success; no exit code of its own
    assert "CANCELLED" in waited.stdout
    job = status_json(shared, job_id)
    assert job["state"] == "CANCELLED"
    assert all(w["state"] == "stopped" for w in job["workers"])
    reasons = [e["reason"] for e in events_json(shared, job_id)]
    assert any("cancel requested" in r for r in reasons)


def _job_of(pid: int) -> str | None:
    try:
        return psutil.Process(pid).environ().get("ELASTICD_JOB_ID")
    except psutil.Error:
        return None


def test_unknown_command_fails_the_job_with_command_not_found(shared):
    job_id = submit(shared, "--nproc-per-node", "2", "--", "no-such-binary-xyz", "--flag")
    waited = shared.ctl("wait", job_id, timeout=30)
    assert waited.returncode == 127, waited.stdout + waited.stderr
    job = status_json(shared, job_id)
    assert job["state"] == "FAILED"
    assert "command not found: no-such-binary-xyz" in job["reason"]
    assert "command not found" in job["last_failure"]["cause"]
    assert "command not found" in ctl_ok(shared, "status", job_id).stdout
    # The daemon is fine and takes the next job.
    assert shared.proc.poll() is None
    assert job_id in ctl_ok(shared, "list").stdout
    ok = submit(shared, "--", "/bin/true")
    assert shared.ctl("wait", ok, timeout=30).returncode == 0


# ---------------------------------------------------------------- environment

ENV_KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "ELASTICD_JOB_ID", "FOO",
            "FROM_SUBMITTER"]

DUMP_ENV = textwrap.dedent(f"""
    import json, os
    keys = {ENV_KEYS!r}
    data = {{k: os.environ.get(k) for k in keys}}
    data["cwd"] = os.getcwd()
    # the error file's dir (the job's run dir) as the worker sees it while it runs
    err_dir = os.path.dirname(data["TORCHELASTIC_ERROR_FILE"] or "")
    data["err_dir_is_dir"] = os.path.isdir(err_dir)
    data["err_dir_writable"] = os.access(err_dir, os.W_OK)
    with open("env-" + os.environ["RANK"] + ".json", "w") as fh:
        json.dump(data, fh)
""")


def test_workers_get_the_torchrun_environment_and_the_submitters(shared):
    workdir = os.path.join(shared.root, "envjob")
    os.mkdir(workdir)
    job_id = submit(shared, "--nproc-per-node", "2", "--max-restarts", "2", "--env", "FOO=bar",
                    "--", PY, "-c", DUMP_ENV, cwd=workdir, env={"FROM_SUBMITTER": "inherited"})
    assert shared.ctl("wait", job_id, timeout=60).returncode == 0

    seen = {}
    for rank in (0, 1):
        with open(os.path.join(workdir, f"env-{rank}.json")) as fh:
            seen[rank] = json.load(fh)
    for rank, env in seen.items():
        missing = [k for k in ENV_KEYS if env.get(k) is None]
        assert not missing, f"rank {rank} lacks {missing}"
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == "default"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == env["ELASTICD_JOB_ID"] == job_id
        assert env["FOO"] == "bar"
        assert env["FROM_SUBMITTER"] == "inherited"
        assert env["cwd"] == workdir  # the submitter's working directory
        assert 0 < int(env["MASTER_PORT"]) < 65536
        err = env["TORCHELASTIC_ERROR_FILE"]
        assert os.path.isabs(err) and env["err_dir_is_dir"]  # while the job ran
        assert env["err_dir_writable"]
    assert seen[0]["MASTER_ADDR"] == seen[1]["MASTER_ADDR"] != ""
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    assert seen[0]["TORCHELASTIC_ERROR_FILE"] != seen[1]["TORCHELASTIC_ERROR_FILE"]
    # the job's run dir goes once the job has ended (retention's pass on a job's end)
    run_dir = os.path.dirname(seen[0]["TORCHELASTIC_ERROR_FILE"])
    assert os.path.dirname(seen[1]["TORCHELASTIC_ERROR_FILE"]) == run_dir
    deadline = time.monotonic() + 30
    while os.path.lexists(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.lexists(run_dir), f"{run_dir} is still there after the job ended"


def test_submit_works_from_a_shell_that_exports_functions(shared):
    env = {"BASH_FUNC_module%%": "() {  echo module\n}"}
    res = shared.ctl("submit", "--", "/bin/true", env=env)
    assert res.returncode == 0, res.stderr
    assert shared.ctl("wait", res.stdout.strip(), timeout=30).returncode == 0


def test_submit_works_with_a_non_utf8_variable_in_the_environment(shared):
    env = dict(os.environ)
    env_b = {k.encode(): v.encode() for k, v in env.items()}
    env_b[b"LEGACY_LATIN1"] = b"caf\xe9"
    res = subprocess.run([PY, "-m", "elasticctl", "--socket", shared.socket, "submit", "--",
                          "/bin/true"], capture_output=True, env=env_b, cwd=shared.root,
                         timeout=60)
    assert b"Traceback" not in res.stderr, res.stderr.decode(errors="replace")
    assert res.returncode == 0, res.stderr.decode(errors="replace")


HOSTILE_ERROR_FILE = textwrap.dedent("""
    import os, sys
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        # A worker may write anything to its error file; this is valid JSON, nested deep.
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
            fh.write('{"message": ' + "[" * 100000 + "]" * 100000 + "}")
        sys.exit(1)
""")


def test_worker_error_file_nested_too_deep_is_an_ordinary_failure(shared):
    job_id = submit(shared, "--nproc-per-node", "2", "--", PY, "-c", HOSTILE_ERROR_FILE)
    shared.ctl("wait", job_id, timeout=60)
    job = status_json(shared, job_id)
    assert "internal error" not in job["reason"]
    assert job["state"] == "SUCCEEDED" and job["restarts"] == 1
    assert job["last_failure"]["rank"] == 1 and job["last_failure"]["exit_code"] == 1


# ---------------------------------------------------------------- slots

SLEEP = [PY, "-c", "import time; time.sleep(1.5)"]


def test_second_job_waits_pending_until_slots_free_up(daemon_factory):
    d = daemon_factory(slots=2).start()
    # The first job holds both slots until the test lets it go (a file), not
    # for a fixed time: on a loaded machine the second submit alone can take
    # longer than any sleep the first would do.
    release = os.path.join(d.root, "release-first")
    hold = f"import os, time\nwhile not os.path.exists({release!r}): time.sleep(0.05)"
    first = submit(d, "--nproc-per-node", "2", "--", PY, "-c", hold)
    second = submit(d, "--nproc-per-node", "2", "--", *SLEEP)

    d.wait_state(first, "RUNNING")
    # While the first holds both slots, the second must not start.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert pb.JobState.Name(d.job(first).state) == "RUNNING"
        assert pb.JobState.Name(d.job(second).state) == "PENDING"
        time.sleep(0.05)
    open(release, "w").close()
    while pb.JobState.Name(d.job(first).state) == "RUNNING":
        time.sleep(0.05)
    assert status_json(d, first)["state"] == "SUCCEEDED"

    assert d.ctl("wait", second, timeout=60).returncode == 0
    a, b = status_json(d, first), status_json(d, second)
    assert b["state"] == "SUCCEEDED"
    assert b["started_at"] >= a["finished_at"]
    # PENDING from its submission until the first job freed the slots (not a fixed
    # 1 s: on a loaded machine the second submit itself may take most of the first
    # job's run).
    pending = b["seconds_in_state"]["PENDING"]
    assert pending >= a["finished_at"] - b["created_at"] - 0.05, (b["seconds_in_state"], a, b)


def test_job_larger_than_the_node_is_refused_at_submit(daemon_factory):
    d = daemon_factory(slots=2).start()
    res = d.ctl("submit", "--nproc-per-node", "3", "--", "/bin/true")
    assert res.returncode == 1
    assert "FAILED_PRECONDITION" in res.stderr and "--slots" in res.stderr
    with pytest.raises(grpc.RpcError) as exc:
        d.submit("/bin/true", nproc=3)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert json.loads(ctl_ok(d, "-o", "json", "list").stdout)["jobs"] == []


# ---------------------------------------------------------------- batch

LAUNCH = {  # name: (nproc, max_restarts, train.py arguments)
    "crash_once": (2, -1, ["--steps", "60", "--crash-at-step", "20"]),
    "always_fails": (2, 2, ["--steps", "60", "--crash-at-step", "0", "--crash-every-attempt"]),
    # One rank: with two, the peer's own connection error races the kill for the blame
    # (see test_rank_killed_by_sigkill_is_blamed_not_the_peer_that_lost_it).
    "sigkill": (1, 0, ["--steps", "60", "--crash-at-step", "5", "--crash-rank", "0",
                       "--crash-mode", "kill"]),
}


@pytest.fixture(scope="module")
def launched(shared) -> dict[str, str]:
    """Job ids of the batch jobs, all submitted at once so their torch start-ups overlap.

    The healthy job goes through `elasticctl submit` as a user would; the others
    straight through the API (elasticctl's start-up is not what they test).
    """
    ids = {"healthy": submit(shared, "--nproc-per-node", "2", "--", *TRAIN, "--steps", "60")}
    for key, (nproc, max_restarts, args) in LAUNCH.items():
        ids[key] = shared.submit(*TRAIN, *args, nproc=nproc, max_restarts=max_restarts)
    return ids


# ---------------------------------------------------------------- success

def test_submitted_job_succeeds_and_wait_status_logs_say_so(shared, launched):
    job_id = launched["healthy"]

    waited = shared.ctl("wait", job_id, timeout=120)
    assert waited.returncode == 0, waited.stderr
    assert "SUCCEEDED" in waited.stdout

    job = status_json(shared, job_id)
    assert job["id"] == job_id
    assert job["state"] == "SUCCEEDED"
    assert job["restarts"] == 0
    assert job["exit_code"] == 0
    assert job["last_failure"] is None
    assert job["nproc_per_node"] == 2
    assert sorted(w["state"] for w in job["workers"]) == ["succeeded", "succeeded"]

    logs = ctl_ok(shared, "logs", job_id).stdout
    assert "all_reduce check ok" in logs
    assert "[rank 0]" in logs and "[rank 1]" in logs  # several ranks: each line says whose


# ---------------------------------------------------------------- failures

def test_worker_that_crashes_once_is_restarted_and_the_cause_is_recorded(shared, launched):
    job_id = launched["crash_once"]
    waited = shared.ctl("wait", job_id, timeout=120)
    assert waited.returncode == 0, waited.stdout + waited.stderr

    job = status_json(shared, job_id)
    assert job["state"] == "SUCCEEDED"
    assert job["restarts"] == 1
    f = job["last_failure"]
    assert f is not None
    assert f["rank"] == 1
    assert f["exit_code"] == 1
    assert f["signal"] == 0
    assert f["restart"] == 0  # it happened on the first attempt
    assert "RuntimeError" in f["cause"] and "injected failure on rank 1 at step 20" in f["cause"]
    # The traceback comes from the error file torch's @record wrote.
    assert f["traceback"].startswith("Traceback (most recent call last)")
    assert "injected failure" in f["traceback"]
    assert "in crash" in f["traceback"]

    table = ctl_ok(shared, "status", job_id).stdout
    assert "exit code 1" in table
    assert "injected failure" in table

    rank1 = shared.rank_log(job_id, 1)
    markers = [line for line in rank1.splitlines() if line.startswith(START_MARKER)]
    assert len(markers) == 2, rank1[-3000:]
    assert "(restart 0," in markers[0] and "(restart 1," in markers[1]
    assert "crashing on purpose at step 20" in rank1
    assert "all_reduce check ok" in shared.rank_log(job_id, 0)

    assert moves(events_json(shared, job_id)).count(("RUNNING", "RESTARTING")) == 1


def test_job_that_always_fails_ends_failed_after_max_restarts_with_the_cause(shared, launched):
    job_id = launched["always_fails"]
    waited = shared.ctl("wait", job_id, timeout=120)
    assert waited.returncode == 1, waited.stdout + waited.stderr  # the job's exit code
    assert "FAILED" in waited.stdout and "injected failure" in waited.stdout

    job = status_json(shared, job_id)
    assert job["state"] == "FAILED"
    assert job["restarts"] == 2
    assert job["max_restarts"] == 2
    assert job["exit_code"] == 1
    assert "no restarts left" in job["reason"]
    assert job["last_failure"]["rank"] == 1
    assert job["last_failure"]["restart"] == 2  # the third attempt failed too
    assert "injected failure" in job["last_failure"]["cause"]

    table = ctl_ok(shared, "status", job_id).stdout
    assert "FAILED" in table and "exit code 1" in table and "injected failure" in table

    m = moves(events_json(shared, job_id))
    assert m.count(("RUNNING", "RESTARTING")) == 2
    assert m[-1] == ("RUNNING", "FAILED")
    assert len(shared.rank_log(job_id, 1).split(START_MARKER)) - 1 == 3  # three attempts


def test_worker_killed_by_sigkill_is_reported_as_killed_by_signal_9(shared, launched):
    job_id = launched["sigkill"]
    waited = shared.ctl("wait", job_id, timeout=120)
    assert waited.returncode == 128 + 9, waited.stdout + waited.stderr

    job = status_json(shared, job_id)
    assert job["state"] == "FAILED"
    f = job["last_failure"]
    assert f["rank"] == 0
    assert f["signal"] == 9
    assert f["exit_code"] == -1
    assert f["cause"] == "rank 0 killed by SIGKILL"
    # A SIGKILLed process writes no error file: its last lines of output stand in, as the
    # lead-up (not the cause: the signal is).
    assert f["traceback"].endswith("rank 0: crashing on purpose at step 5 (kill)\n"), \
        f["traceback"]
    assert "killed by signal SIGKILL" in ctl_ok(shared, "status", job_id).stdout


# Rank 1 is SIGKILLed (as the OOM killer would); its peer, rank 0, notices at
# once, writes a torch-format error file about the lost connection and exits 1
# -- all within microseconds, so the agent sees both dead in the same look.
KILLED_PEER = textwrap.dedent("""
    import json, os, signal, sys, time
    pidfile = "rank1.pid"
    if os.environ["RANK"] == "1":
        with open(pidfile + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.rename(pidfile + ".tmp", pidfile)
        time.sleep(60)
    else:
        while not os.path.exists(pidfile):
            time.sleep(0.01)
        peer = int(open(pidfile).read())
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
            json.dump({"message": {"message": "RuntimeError: Connection reset by peer",
                                   "extraInfo": {"py_callstack": "Traceback ...",
                                                 "timestamp": str(int(time.time()))}}}, fh)
        os.kill(peer, signal.SIGKILL)
        os._exit(1)
""")


def test_rank_killed_by_sigkill_is_blamed_not_the_peer_that_lost_it(shared):
    workdir = os.path.join(shared.root, "killedpeer")
    os.mkdir(workdir)
    job_id = submit(shared, "--nproc-per-node", "2", "--max-restarts", "0", "--", PY, "-c",
                    KILLED_PEER, cwd=workdir)
    shared.ctl("wait", job_id, timeout=60)
    f = status_json(shared, job_id)["last_failure"]
    assert (f["rank"], f["signal"]) == (1, 9), f
    assert "SIGKILL" in f["cause"]
