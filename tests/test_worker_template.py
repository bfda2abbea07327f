"""The worker template: ranks forked from one pre-imported process per job.

Real root daemon, a real unprivileged user made here (``h16_tmpl``), real
elasticctl dropping to that user (tests/run_as.py), real torch gloo workers.
Each job's script writes what it sees of itself at the top, before it
imports torch: whether torch was already there (forked from the template),
its environment, cwd, ids, ``sys.argv``, ``sys.path[0]``, ``__name__``, umask
and signal dispositions; a cold start of the same script (a command the
template does not take: ``python -X utf8 SCRIPT``) is the reference.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import textwrap
import time

import psutil
import pytest

from daemons import short_tmpdir
from test_local_trust import real_users
from elasticd.v1 import control_pb2 as pb

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: a real user is created and the daemon "
                                       "switches to it (CI runs as root)")

PY = sys.executable
NOGROUP = 65534        # the daemon's socket group here: the test user is in it
USER = "h16_tmpl"

SCRIPT = textwrap.dedent("""\
    import json, os, signal, sys
    PRE = "torch" in sys.modules
    PRE_PSUTIL = "psutil" in sys.modules
    MASK = os.umask(0); os.umask(MASK)
    SIGS = {n: repr(signal.getsignal(getattr(signal, n)))
            for n in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE", "SIGHUP", "SIGUSR2")}
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    RANK = int(os.environ["RANK"])
    RESTART = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


    @record
    def main():
        mode, out = sys.argv[1], sys.argv[2]
        seen = {"pre": PRE, "pre_psutil": PRE_PSUTIL, "name": __name__, "argv": sys.argv, "path0": sys.path[0],
                "cwd": os.getcwd(), "uid": os.getuid(), "gid": os.getgid(),
                "groups": sorted(os.getgroups()), "env": dict(os.environ),
                "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
                "sid": os.getsid(0),
                "umask": MASK, "stdin": os.readlink("/proc/self/fd/0"), "sigs": SIGS,
                "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}
        name = "%s-rank%d-restart%d.json" % (mode, RANK, RESTART)
        with open(os.path.join(out, name), "w") as fh:
            json.dump(seen, fh)
        if mode == "crash" and RESTART == 0 and RANK == 1:
            os._exit(13)  # a fault in the first second of the round
        if mode == "raise":
            raise ValueError("h16 boom from rank %d" % RANK)
        if mode == "sleep" or (mode == "learn" and RESTART == 0):
            if mode == "learn":  # a module of its own, then its first step
                import psutil
                opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
                opt.step()
            import time
            time.sleep(600)
        if mode == "learn":
            return
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == int(os.environ["WORLD_SIZE"])
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
    """)

# A daemon thread started by the user's own sitecustomize: harmless to a cold
# rank, but a template that runs it is not safe to fork.
THREADED_SITE = textwrap.dedent("""\
    import threading, time
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    """)

# The user's own code runs in the template (here a sitecustomize; a preload
# module would do as well), so it can say anything on the template's channel:
# this one answers each fork request with another process's pid.
LYING_SITE = textwrap.dedent("""\
    import json, os, socket
    _victim = int(os.environ.get("H16_VICTIM", "0"))
    _sendall = socket.socket.sendall

    def _lying_sendall(self, data, *args):
        try:
            msg = json.loads(data)
        except ValueError:
            msg = None
        if _victim and isinstance(msg, dict) and "id" in msg and "pid" in msg:
            data = (json.dumps(dict(msg, pid=_victim)) + "\\n").encode()
        return _sendall(self, data, *args)

    socket.socket.sendall = _lying_sendall
    """)

# A python that refuses to be a template (a wrapper that cannot run it): the
# template cannot be made, the ranks start cold.
BAD_PYTHON = "#!/bin/sh\ncase \"$1\" in */warmstart.py) exit 3;; esac\nexec {py} \"$@\"\n"


@pytest.fixture(scope="module")
def user():
    with real_users((USER,), "h16-home-") as made:
        yield made[USER.split("_", 1)[1]]


@pytest.fixture
def work(user):
    base = short_tmpdir("h16-")
    work = user.mkdir(os.path.join(base, "work"))
    with open(os.path.join(work, "train.py"), "w") as fh:
        fh.write(SCRIPT)
    out = user.mkdir(os.path.join(work, "out"), 0o777)
    yield work, out
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def node(daemon_factory):
    return daemon_factory(slots=8, extra_args=(
        "--set", f"daemon.socket_group={NOGROUP}", "--set", "agent.warm_spares=false")).start()


def submit(d, user: User, *args: str, cwd: str) -> str:
    r = d.ctl("-o", "json", "submit", *args, cwd=cwd, user=user.creds)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["id"]


def status(d, job_id: str) -> dict:
    r = d.ctl("-o", "json", "status", job_id)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def events(d, job_id: str) -> list[dict]:
    r = d.ctl("-o", "json", "events", job_id)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def starts(d, job_id: str) -> list[dict]:
    return [e for e in events(d, job_id) if e["kind"] == "start"]


def seen(out: str, mode: str, rank: int, restart: int = 0) -> dict:
    with open(os.path.join(out, f"{mode}-rank{rank}-restart{restart}.json")) as fh:
        return json.load(fh)


def both_wrote(out: str, mode: str, restart: int) -> bool:
    """Ranks 0 and 1 wrote what they see (in whichever order they got the CPU)."""
    return all(os.path.exists(os.path.join(out, f"{mode}-rank{r}-restart{restart}.json"))
               for r in (0, 1))


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout}s")


def state(job: pb.Job) -> str:
    return pb.JobState.Name(job.state)


def _neutral(env: dict, job_id: str) -> dict:
    """A rank's environment with what differs between two jobs taken out (the snapshot
    budget: what the node's budget leaves after the other job's)."""
    return {k: v.replace(job_id, "<job>") for k, v in env.items()
            if k not in ("MASTER_PORT", "ELASTICD_SNAPSHOT_BUDGET_BYTES")}


# ---------------------------------------------------------------- the contract

def test_ranks_forked_from_the_template_are_what_a_cold_start_is(node, user, work):
    cwd, out = work
    script = os.path.join(cwd, "train.py")
    forked = submit(node, user, "--nproc-per-node", "2", "--", PY, script, "same", out,
                    cwd=cwd)
    cold = submit(node, user, "--nproc-per-node", "2", "--", PY, "-X", "utf8", script,
                  "cold", out, cwd=cwd)
    for job_id in (forked, cold):
        job = node.wait_job(job_id, timeout=240)
        assert state(job) == "SUCCEEDED", (node.rank_log(job_id, 0), node.rank_log(job_id, 1))
    for rank in (0, 1):
        f, c = seen(out, "same", rank), seen(out, "cold", rank)
        assert f["pre"] is True and c["pre"] is False  # forked: torch was there already
        assert f["env"]["RANK"] == str(rank) and f["env"]["LOCAL_RANK"] == str(rank)
        assert "ELASTICD_WARM_PRELOAD" not in f["env"]
        assert _neutral(f["env"], forked) == _neutral(c["env"], cold)
        assert f["argv"] == [script, "same", out] and c["argv"] == [script, "cold", out]
        for key in ("name", "path0", "cwd", "uid", "gid", "groups", "umask", "stdin",
                    "sigs", "blocked"):
            assert f[key] == c[key], (key, f[key], c[key])
        assert f["name"] == "__main__" and f["path0"] == cwd and f["uid"] == user.uid
        assert f["pid"] == f["pgid"] == f["sid"]  # its own session and process group
    assert [e["start_path"] for e in starts(node, forked)] == ["template"]
    assert [e["start_path"] for e in starts(node, cold)] == ["cold"]
    job = status(node, forked)
    assert job["template_state"] in ("ready", "stopped", "pooled") and job["start_path"] == "template"
    assert {w["start_path"] for w in job["workers"]} == {"template"}
    log = node.rank_log(forked, 0)
    assert "from the worker template" in log


def test_a_crash_in_the_first_second_restarts_from_the_template(node, user, work):
    cwd, out = work
    job_id = submit(node, user, "--nproc-per-node", "2", "--max-restarts", "1", "--",
                    PY, os.path.join(cwd, "train.py"), "crash", out, cwd=cwd)
    job = node.wait_job(job_id, timeout=240)
    assert state(job) == "SUCCEEDED" and job.restarts == 1, node.rank_log(job_id, 1)
    assert [e["start_path"] for e in starts(node, job_id)] == ["template", "template"]
    again = seen(out, "crash", 1, restart=1)
    assert again["pre"] is True and again["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    exits = [e["reason"] for e in events(node, job_id) if e["kind"] == "worker_exit"]
    assert any("exit code 13" in r for r in exits), exits  # the exact code, via the template


def test_a_record_traceback_of_a_forked_rank_reaches_status(node, user, work):
    cwd, out = work
    job_id = submit(node, user, "--max-restarts", "0", "--",
                    PY, os.path.join(cwd, "train.py"), "raise", out, cwd=cwd)
    job = node.wait_job(job_id, timeout=240)
    assert state(job) == "FAILED"
    assert seen(out, "raise", 0)["pre"] is True
    shown = node.ctl("status", job_id).stdout
    assert "h16 boom from rank 0" in job.last_failure.traceback, job.last_failure
    assert "ValueError" in shown and "h16 boom" in shown, shown


def test_killing_the_daemon_leaves_no_template_and_no_rank(node, user, work):
    cwd, out = work
    job_id = submit(node, user, "--nproc-per-node", "2", "--",
                    PY, os.path.join(cwd, "train.py"), "sleep", out, cwd=cwd)
    wait_for(lambda: both_wrote(out, "sleep", 0), 240, "both ranks running")
    tree = psutil.Process(node.proc.pid).children(recursive=True)
    template = [p for p in tree if "--template" in " ".join(p.cmdline())
                and p.ppid() == node.proc.pid]
    ranks = [seen(out, "sleep", r)["pid"] for r in (0, 1)]
    assert len(template) == 1 and all(psutil.Process(r).ppid() == template[0].pid
                                      for r in ranks)
    node.kill()  # SIGKILL: no chance to clean up

    def all_gone():
        return not [p for p in tree if _alive(p)]
    wait_for(all_gone, 30, "the template and its ranks to die with the daemon")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_template_killed_takes_its_ranks_and_the_restart_forks_from_a_new_one(
        node, user, work):
    cwd, out = work
    job_id = submit(node, user, "--nproc-per-node", "2", "--max-restarts", "1", "--",
                    PY, os.path.join(cwd, "train.py"), "sleep", out, cwd=cwd)
    wait_for(lambda: both_wrote(out, "sleep", 0), 240, "both ranks running")
    (template,) = [p for p in psutil.Process(node.proc.pid).children()
                   if "--template" in " ".join(p.cmdline())]
    ranks = [psutil.Process(seen(out, "sleep", r)["pid"]) for r in (0, 1)]
    template.kill()
    wait_for(lambda: not any(_alive(p) for p in ranks), 30, "the ranks to die with it")
    wait_for(lambda: both_wrote(out, "sleep", 1), 240, "the restarted ranks")
    assert seen(out, "sleep", 0, restart=1)["pre"] is True
    assert seen(out, "sleep", 1, restart=1)["pid"] != ranks[1].pid
    job = status(node, job_id)
    assert job["restarts"] == 1 and "SIGKILL" in job["last_failure"]["cause"], job
    reasons = [e["reason"] for e in events(node, job_id) if e["kind"] == "template"]
    assert any(r.startswith("starting a new worker template") for r in reasons), reasons
    assert [e["start_path"] for e in starts(node, job_id)] == ["template", "template"]
    node.ctl("cancel", job_id)
    node.wait_job(job_id, timeout=60)


def test_the_next_template_preloads_what_the_first_step_imported(node, user, work):
    cwd, out = work
    job_id = submit(node, user, "--max-restarts", "1", "--",
                    PY, os.path.join(cwd, "train.py"), "learn", out, cwd=cwd)

    def learned():
        return [e["reason"] for e in events(node, job_id)
                if e["kind"] == "template" and e["reason"].startswith("learned preload")]
    (reason,) = wait_for(learned, 240, "the learned preload")
    assert "psutil" in reason and "torch," not in reason, reason
    assert seen(out, "learn", 0)["pre_psutil"] is False
    (template,) = [p for p in psutil.Process(node.proc.pid).children()
                   if "--template" in " ".join(p.cmdline())]
    template.kill()  # its rank dies with it; the restart starts a new template
    job = node.wait_job(job_id, timeout=240)
    assert state(job) == "SUCCEEDED", node.rank_log(job_id, 0)
    again = seen(out, "learn", 0, restart=1)
    assert again["pre"] is True and again["pre_psutil"] is True
    assert "psutil" in status(node, job_id)["learned_preload"]


# ---------------------------------------------------------------- fallbacks

def test_a_template_that_cannot_be_made_or_forked_falls_back_to_cold(node, user, work):
    cwd, out = work
    script = os.path.join(cwd, "train.py")
    site = user.mkdir(os.path.join(cwd, "site"))
    with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
        fh.write(THREADED_SITE)
    bin_dir = user.mkdir(os.path.join(cwd, "bin"))
    bad = os.path.join(bin_dir, "python3")
    with open(bad, "w") as fh:
        fh.write(BAD_PYTHON.format(py=PY))
    os.chmod(bad, 0o755)
    threaded = submit(node, user, "--env", f"PYTHONPATH={site}", "--",
                      PY, script, "threaded", out, cwd=cwd)
    broken = submit(node, user, "--", bad, script, "broken", out, cwd=cwd)
    for job_id in (threaded, broken):
        job = node.wait_job(job_id, timeout=240)
        assert state(job) == "SUCCEEDED", node.rank_log(job_id, 0)
    assert seen(out, "threaded", 0)["pre"] is False and seen(out, "broken", 0)["pre"] is False
    for job_id, why in ((threaded, r"unsafe to fork: the template runs 2 Python threads"),
                        (broken, r"exited \(exit code 3\)")):
        evs = events(node, job_id)
        assert [e["start_path"] for e in evs if e["kind"] == "start"] == ["cold"]
        template = [e["reason"] for e in evs if e["kind"] == "template"]
        assert any(re.search(why, r) for r in template), template
        job = status(node, job_id)
        assert job["template_state"] == "failed" and re.search(why, job["template_reason"])


def test_a_template_naming_another_process_as_its_rank_is_dropped_and_that_process_untouched(
        node, user, work):
    """A template answers a fork request with the pid of root's process (its own
    session and group, as a daemon's is). The daemon must not take it for the
    rank: a rank's pid is what the job's stop, the hang detector and a
    replacement signal, as root, with its whole process group."""
    import subprocess
    cwd, out = work
    script = os.path.join(cwd, "train.py")
    site = user.mkdir(os.path.join(cwd, "site"))
    with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
        fh.write(LYING_SITE)
    victim = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        job_id = submit(node, user, "--env", f"PYTHONPATH={site}", "--env",
                        f"H16_VICTIM={victim.pid}", "--", PY, script, "lied", out, cwd=cwd)
        job = node.wait_job(job_id, timeout=240)
        assert state(job) == "SUCCEEDED", node.rank_log(job_id, 0)
        assert node.ctl("cancel", job_id).returncode in (0, 1)  # ended: nothing to stop
        assert victim.poll() is None, "root's process was signalled as the job's rank"
        evs = events(node, job_id)
        template = [e["reason"] for e in evs if e["kind"] == "template"]
        assert any(f"pid {victim.pid} is not its child run by uid {user.uid}" in r
                   for r in template), template
        # The template is dropped, not kept for the user's next job; the ranks ran cold.
        assert {e["start_path"] for e in evs if e["kind"] == "start"} == {"cold"}
        assert status(node, job_id)["template_state"] == "failed"
    finally:
        victim.kill()
        victim.wait()


def test_a_command_the_template_cannot_run_starts_cold_and_says_why(node, user, work):
    cwd, out = work
    job_id = submit(node, user, "--", "/bin/sh", "-c", "exit 0", cwd=cwd)
    job = node.wait_job(job_id, timeout=120)
    assert state(job) == "SUCCEEDED"
    (start,) = starts(node, job_id)
    assert start["start_path"] == "cold" and "not `python SCRIPT`" in start["reason"], start
    assert status(node, job_id)["template_state"] == "off"
