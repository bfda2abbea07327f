"""A daemon killed hard leaves no worker behind, and resumes its jobs."""
import os
import sys
import time

import psutil
import pytest

from elasticd.v1 import control_pb2 as pb

SLEEPER = ["python", "-c", "import time, os, subprocess;"
           "subprocess.Popen(['sleep', '300']);"  # a grandchild in the same process group
           "print('up', os.getpid(), flush=True); time.sleep(300)"]


def _alive(pids):
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _group_members(pgids):
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) in pgids and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (OSError, psutil.Error):
            pass
    return found


def test_sigkill_of_daemon_kills_workers_and_restart_resumes_the_job(daemon_factory):
    d = daemon_factory().start()
    job_id = d.submit(*SLEEPER, nproc=2, max_restarts=3)
    job = d.wait_state(job_id, "RUNNING", pred=lambda j: len(j.workers) == 2)
    pids = [w.pid for w in job.workers]
    deadline = time.monotonic() + 10
    while len(_group_members(set(pids))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)  # each worker has forked its sleep child

    d.kill()
    t0 = time.monotonic()
    while _alive(pids) and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    gone_after = time.monotonic() - t0
    assert not _alive(pids), "workers outlived a SIGKILLed daemon"
    assert gone_after < 2.0

    d.start()
    # Whatever the workers forked is cleaned up as the daemon returns: it resumes
    # the job (SIGKILLs the leftovers and waits for them to go) just after its
    # socket serves, so allow it that moment, bounded.
    deadline = time.monotonic() + 10
    while _group_members(set(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group_members(set(pids))
    job = d.wait_state(job_id, "RUNNING", pred=lambda j: j.restarts == 1 and len(j.workers) == 2
                       and all(w.state == "running" for w in j.workers))
    assert job.id == job_id and job.restarts == 1
    assert "daemon restarted" in " ".join(e.reason for e in d.events(job_id))
    assert not set(pids) & {w.pid for w in job.workers}
    d.ctl("cancel", job_id)
    d.wait_state(job_id, "CANCELLED", timeout=20)


def test_clean_stop_stops_workers_and_keeps_records(daemon_factory):
    d = daemon_factory().start()
    done = d.submit("/bin/true")
    assert d.wait_job(done).state == pb.SUCCEEDED
    live = d.submit(*SLEEPER, max_restarts=2)
    job = d.wait_state(live, "RUNNING", pred=lambda j: len(j.workers) == 1)
    pid = job.workers[0].pid

    assert d.stop() == 0
    assert not _alive([pid])
    assert not _group_members({pid})

    d.start()
    finished = d.job(done)
    assert finished.state == pb.SUCCEEDED  # finished jobs stay listed, unchanged
    resumed = d.wait_state(live, "RUNNING", pred=lambda j: j.restarts == 1)
    assert resumed.workers[0].pid != pid
    d.ctl("cancel", live)


def test_second_daemon_on_the_same_socket_refuses_to_start(daemon_factory):
    import subprocess
    import sys
    d = daemon_factory().start()
    twin = subprocess.run([sys.executable, "-m", "elasticd", "--standalone", "--socket", d.socket,
                           "--state-dir", d.state_dir + "-twin", "--metrics-port", "0",
                           "--set", f"snapshot.root={d.snapshot_dir}-twin"],
                          capture_output=True, text=True, timeout=30)
    assert twin.returncode == 1
    assert "another elasticd is already serving" in twin.stderr
    # The first one still serves.
    with d.client() as c:
        c.call("ListJobs", pb.ListJobsRequest())


def test_second_daemon_on_the_same_state_dir_refuses_to_start(daemon_factory):
    import subprocess
    import sys
    d = daemon_factory().start()
    twin = subprocess.run([sys.executable, "-m", "elasticd", "--standalone",
                           "--socket", d.socket + "-twin", "--state-dir", d.state_dir,
                           "--metrics-port", "0"], capture_output=True, text=True, timeout=30)
    assert twin.returncode == 1
    assert "already uses the state dir" in twin.stderr


@pytest.mark.slow   # ~20 s: three attempts 4 s apart and a daemon restart
def test_a_crash_loop_goes_on_counting_across_a_daemon_restart(daemon_factory, tmp_path):
    """agent.crash_loop_limit 3 means three attempts in all, not three more after each
    daemon restart: the count is kept in the job's record (JobRecord.crash_loop)."""
    (tmp_path / "train.py").write_text("import nowhere_crash_loop_h30\n")
    line = "ModuleNotFoundError: No module named 'nowhere_crash_loop_h30'"
    # A wait before each restart that leaves time to kill the daemon between attempts.
    d = daemon_factory(extra_args=("--set", "agent.restart_backoff_initial=4",
                                   "--set", "agent.restart_backoff_step=0",
                                   "--set", "agent.warm_spares=false")).start()
    job_id = d.submit(sys.executable, "train.py", cwd=str(tmp_path), max_restarts=20)
    d.wait_state(job_id, "RESTARTING", timeout=60, pred=lambda j: line in j.reason)
    d.kill()                               # within the 4 s wait after the first failure
    d.start()
    job = d.wait_job(job_id, timeout=120)
    assert job.state == pb.FAILED, job.reason
    assert "crash loop: it failed the same way in 3 attempts in a row" in job.reason, job.reason
    failed = [e for e in d.events(job_id) if line in e.reason
              and e.to_state in (pb.RESTARTING, pb.FAILED)]
    # Three failed attempts in all (without the kept count: 1 before the restart + 3 after).
    assert len(failed) == 3, [(pb.JobState.Name(e.to_state), e.reason[:80]) for e in failed]
