"""Backoff only where there was no progress, and the budget over a window, end to end.

Real daemons, real torch workers (gloo on CPU). The wait the daemon decided
before each restart is read from its events (restart_rule,
restart_delay_seconds): that is exact; wall-clock gaps get generous bounds.
"""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from elasticd.v1 import control_pb2 as pb

PY = sys.executable

# Trains with an optimizer (every step beats, see hangs/detector.py), then rank 1
# SIGKILLs itself after ``STEPS`` steps, on each of the first ``FAULTS`` attempts. Run
# as a script, as users' jobs are, so each restart forks from the job's worker template
# (a ``-c`` command always starts cold: seconds of imports per rank and attempt).
KILLED_AFTER_PROGRESS = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    FAULTS, STEPS, STEP_TIME = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    for step in range(STEPS):
        loss = model(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        time.sleep(STEP_TIME)
    if attempt < FAULTS and os.environ["RANK"] == "1":
        os.kill(os.getpid(), 9)
    dist.barrier()
    os._exit(0)
""")

DIES_AT_START = [PY, "-c", "import sys; sys.exit(1)"]


@pytest.fixture
def killed_after_progress(tmp_path) -> str:
    path = tmp_path / "killed_after_progress.py"
    path.write_text(KILLED_AFTER_PROGRESS)
    path.chmod(0o644)
    return str(path)


def submit(d, *args: str) -> str:
    res = d.ctl("-o", "json", "submit", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["id"]


def status(d, job_id: str) -> dict:
    res = d.ctl("-o", "json", "status", job_id)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def restarting(d, job_id: str) -> list:
    """The RESTARTING transitions of process restarts: those that carry a plan."""
    return [e for e in d.events(job_id) if e.restart_rule]


def gaps_to_next_round(d, job_id: str) -> list[float]:
    """Seconds from each planned RESTARTING to the job's next move (rejoining)."""
    events = [e for e in d.events(job_id) if e.kind == "state"]
    gaps = []
    for i, e in enumerate(events):
        if e.restart_rule and i + 1 < len(events):
            gaps.append(events[i + 1].time - e.time)
    return gaps


@pytest.mark.slow
def test_worker_killed_after_progress_restarts_at_once_every_time(daemon_factory,
                                                                killed_after_progress):
    d = daemon_factory().start()
    job_id = submit(d, "--nproc-per-node", "2", "--max-restarts-per-window", "20", "--",
                    PY, killed_after_progress, "10", "12", "0.05")
    job = d.wait_job(job_id, timeout=420)
    assert job.state == pb.SUCCEEDED, (job.reason, d.log()[-3000:])
    plans = restarting(d, job_id)
    assert len(plans) == 10 and job.restarts == 10
    assert {e.restart_rule for e in plans} == {"at_once"}
    assert {e.restart_delay_seconds for e in plans} == {0.0}   # what the daemon decided
    assert all("restart at once: " in e.reason and "progress beats" in e.reason for e in plans)
    assert max(gaps_to_next_round(d, job_id)) < 3.0   # wall clock, generous under load
    st = status(d, job_id)
    assert st["last_restart_plan"]["rule"] == "at_once"
    assert st["last_restart_plan"]["summary"].startswith("restart at once: ")
    assert st["restarts_in_window"] == 10 and st["max_restarts_per_window"] == 20
    assert st["max_restarts"] == -1   # no lifetime limit by default
    text = d.ctl("status", job_id).stdout
    assert "restarts:     10 in total (no lifetime limit), 10 in the last hour of 20 allowed" \
        in text, text
    assert "last wait:  restart at once: " in text, text


# A job that dies at start the same way each time is a crash loop (agent.crash_loop_limit,
# tests/test_first_errors.py) and fails after 3 attempts; these cases are about the backoff
# and the budgets it would otherwise spend, so the crash-loop rule is off here.
BACKOFF_ENV = {"ELASTICD_AGENT_RESTART_BACKOFF_STEP": "0.1",
               "ELASTICD_AGENT_RESTART_BACKOFF_MAX": "0.8",
               "ELASTICD_AGENT_CRASH_LOOP_LIMIT": "0"}


def test_job_that_dies_at_start_backs_off_and_fails_when_the_window_budget_ends(
        daemon_factory):
    d = daemon_factory(env=BACKOFF_ENV).start()
    job_id = submit(d, "--max-restarts-per-window", "5", "--", *DIES_AT_START)
    job = d.wait_job(job_id, timeout=120)
    assert job.state == pb.FAILED
    assert "no restarts left in the window (5 in the last hour of 5 allowed)" in job.reason, \
        job.reason
    plans = restarting(d, job_id)
    assert [e.restart_rule for e in plans] == ["backoff"] * 5
    assert [e.restart_delay_seconds for e in plans] == [0.0, 0.1, 0.2, 0.4, 0.8]
    assert "backing off 0.8s: no progress in the last 5 attempts" in plans[-1].reason
    # the wait was kept: each gap at least what was decided (and not wildly more)
    for gap, e in zip(gaps_to_next_round(d, job_id), plans):
        assert e.restart_delay_seconds - 0.05 <= gap < e.restart_delay_seconds + 5.0
    st = status(d, job_id)
    assert st["last_restart_plan"]["rule"] == "backoff"
    assert st["last_restart_plan"]["no_progress_streak"] == 5


def test_job_that_dies_at_start_fails_when_its_lifetime_budget_ends(daemon_factory):
    d = daemon_factory(env=BACKOFF_ENV).start()
    job_id = submit(d, "--max-restarts", "3", "--", *DIES_AT_START)
    job = d.wait_job(job_id, timeout=120)
    assert job.state == pb.FAILED and "no restarts left (3 of 3 used)" in job.reason
    assert [e.restart_delay_seconds for e in restarting(d, job_id)] == [0.0, 0.1, 0.2]
    assert "restarts:     3/3 used/allowed in total, 3 in the last hour of 10 allowed" \
        in d.ctl("status", job_id).stdout


@pytest.mark.slow
def test_window_budget_keeps_a_job_failing_now_and_then_alive(daemon_factory,
                                                            killed_after_progress):
    # A window of 6 s allowing 2: faults about 4 s apart never spend it, five of them
    # in all; a job failing continuously (above) ends within its first window.
    d = daemon_factory(env={"ELASTICD_AGENT_RESTART_WINDOW": "6"}).start()
    job_id = submit(d, "--nproc-per-node", "2", "--max-restarts-per-window", "2", "--",
                    PY, killed_after_progress, "5", "40", "0.1")
    job = d.wait_job(job_id, timeout=300)
    assert job.state == pb.SUCCEEDED, job.reason
    assert job.restarts == 5
    assert {e.restart_rule for e in restarting(d, job_id)} == {"at_once"}
    assert status(d, job_id)["restart_window_seconds"] == 6.0


def test_submit_refuses_a_job_without_any_restart_budget(daemon):
    res = daemon.ctl("submit", "--max-restarts-per-window", "-1", "--", *DIES_AT_START)
    assert res.returncode == 1
    assert "no restart budget" in res.stderr and "--max-restarts" in res.stderr
