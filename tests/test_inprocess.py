"""In-process restart (elasticd.inprocess): real torch gloo ranks, a real store process.

The ranks are started here with the environment the daemon gives them and
the job store elasticd hosts outside the ranks (jobstore/server.py); the daemon
side of ``--inprocess`` is not wired up yet.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from elasticd.jobstore import address as jobstore_env
from elasticd.inprocess.coord import BarrierTimeout, IterationStore
from elasticd.inprocess.records import RecordSealer
from elasticd.v1 import control_pb2 as pb

from daemons import free_port

PY = sys.executable
JOBSTORE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "daemon", "elasticd", "jobstore/server.py")


class DictStore:
    def __init__(self):
        self.d = {}

    def add(self, key, n):
        self.d[key] = int(self.d.get(key, 0)) + n
        return self.d[key]

    def set(self, key, value):
        self.d[key] = value

    def get(self, key):
        return self.d[key]

    def check(self, keys):
        return all(k in self.d for k in keys)

    def multi_get(self, keys):
        return [self.d[k] for k in keys]

    def compare_set(self, key, expected, desired):
        if self.d.get(key, "") == expected:
            self.d[key] = desired
        return self.d[key]


SECRET = jobstore_env.new_secret()


def sealer(secret=SECRET, scope="r0a0/it0/"):
    return RecordSealer(jobstore_env.record_key(secret), scope)


def coord(store, rank=0, world=2, clock=None, seal=None):
    t = [0.0]
    return IterationStore(store, rank, world, poll=0.5, beat=lambda: None,
                          sealer=seal or sealer(), clock=clock or (lambda: t[0]),
                          sleep=lambda s: t.__setitem__(0, t[0] + s))


def test_the_first_fault_wins_and_sets_the_verdict():
    s = DictStore()
    assert coord(s, 1).report_fault("rank 1: boom") == "rank 1: boom"
    assert coord(s, 0).report_fault("rank 0: connection reset") == "rank 1: boom"
    assert coord(s, 0).finish(5) == "rank 1: boom"


def test_finish_is_ok_only_when_every_rank_returned():
    s = DictStore()
    with pytest.raises(BarrierTimeout, match="1 of 2 ranks finished"):
        coord(s, 0).finish(2)
    assert coord(s, 1).finish(2) is None
    assert coord(s, 0).finish(2) is None  # every rank reads the same verdict


# ---------------------------------------------------------------- records someone else wrote

def test_planted_faults_and_markers_are_ignored_and_a_genuine_fault_still_wins():
    s = DictStore()
    for slot in range(5):
        s.d[f"fault/{slot}"] = "PWNED"                        # plain text
    s.d["fault/5"] = "v1." + "0" * 64 + ".PWNED"              # the format, a wrong MAC
    s.d["done/r1"] = s.d["start/r1"] = "v1." + "0" * 64 + ".done"
    me = coord(s, 0)
    assert me.fault() is None
    assert not me.opened("start") and not me.opened("done")
    with pytest.raises(BarrierTimeout, match="finished within 2s and none reported a fault"):
        me.finish(2)                                         # a forged done opens nothing
    assert me.sealer.rejected["fault"] == 6
    assert coord(s, 1).report_fault("rank 1: real") == "rank 1: real"  # takes slot 6
    assert me.fault() == "rank 1: real" and me.finish(2) == "rank 1: real"


def test_a_genuine_record_copied_to_another_key_does_not_verify():
    s = DictStore()
    coord(s, 1).report_fault("rank 1: boom")
    with pytest.raises(BarrierTimeout):  # rank 0 never comes; rank 1's marker is written
        coord(s, 1).barrier("start", 1)
    nxt, other_job = DictStore(), DictStore()
    # The next iteration's (or another rank's) keys, with iteration 0's genuine values.
    nxt.d["fault/0"] = other_job.d["fault/0"] = s.d["fault/0"]
    nxt.d["start/r0"] = s.d["start/r1"]
    nxt.d["done/r0"] = nxt.d["done/r1"] = s.d["start/r1"]
    assert coord(nxt, 0, seal=sealer(scope="r0a0/it1/")).fault() is None
    assert not coord(nxt, 1, seal=sealer(scope="r0a0/it1/")).opened("start")
    assert not coord(nxt, 1, seal=sealer(scope="r0a0/it1/")).opened("done")
    assert coord(other_job, 0, seal=sealer(jobstore_env.new_secret())).fault() is None
    assert coord(s, 0).fault() == "rank 1: boom"  # where it was written, it is genuine


def test_a_huge_value_is_refused_before_hashing():
    s = DictStore()
    s.d["fault/0"] = b"v1." + b"0" * 64 + b"." + b"x" * (10 << 20)
    assert coord(s, 0).fault() is None


def test_the_first_rejection_of_each_kind_is_told_once():
    told = []
    seal = RecordSealer(jobstore_env.record_key(SECRET), "r0a0/", on_first_reject=told.append)
    s = DictStore()
    s.d["fault/0"] = s.d["fault/1"] = "PWNED"
    s.d["start/r1"] = "PWNED"
    s.d["start/r0"] = seal.within("it0/").seal("start/r0", b"start")
    for _ in range(3):
        c = coord(s, 0, seal=seal.within("it0/"))
        assert c.fault() is None and not c.opened("start")
    assert told == ["fault", "start marker"]
    assert seal.rejected == {"fault": 6, "start marker": 3}
    from elasticd.workers.inprocess_reports import parse_line
    assert parse_line(json.dumps({"kind": "forged", "record": "x" * 500}).encode()).to_dict() \
        == {"kind": "forged", "record": "x" * 40}


@pytest.mark.parametrize("line", [
    b"[" * 50000, b'{"kind": "restart", "iteration": 1e999}',
    b'{"kind": "restart", "iteration": 1, "fault_time": NaN}',
    b'{"kind": "restart", "iteration": ' + b"9" * 100 + b"}",
    b'{"kind": "restart", "iteration": "1"}', b"\xff{}", b'{"kind": "restart"}'])
def test_a_report_line_a_rank_could_write_is_a_record_or_none(line):
    """The report file is the job's: its lines are the user's word (issue 29)."""
    from elasticd.workers.inprocess_reports import parse_line
    assert parse_line(line) is None


def test_the_store_names_neither_the_secret_nor_the_record_key():
    prefix = jobstore_env.key_prefix(SECRET, "0", "0")
    assert SECRET not in prefix and jobstore_env.record_key(SECRET).hex() not in prefix
    assert jobstore_env.key_prefix(SECRET, "0", "0") == prefix  # every rank derives the same
    assert not jobstore_env.valid_secret("") and not jobstore_env.valid_secret("ab" * 8)


def test_barrier_times_out_naming_how_many_arrived():
    with pytest.raises(BarrierTimeout, match="1 of 3 ranks reached barrier 'start' within 3s"):
        coord(DictStore(), 0, 3).barrier("start", 3)


# ---------------------------------------------------------------- real ranks

@pytest.fixture
def job_store():
    proc = subprocess.Popen([PY, JOBSTORE, "--host", "127.0.0.1"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line[:1] == ["ELASTICD_STORE"], line
    yield line[1], line[2]
    proc.stdin.close()
    proc.wait(60)  # it exits once stdin closes; generous: a loaded machine took over 10s


def run_ranks(store, world, args, tmp_path, **extra_env):
    procs = []
    snaps = tmp_path / "snapshots"  # the ranks' elasticd.snapshot dir, as a daemon makes it
    snaps.mkdir(mode=0o700)
    extra_env.setdefault("ELASTICD_SNAPSHOT_DIR", str(snaps))
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   ELASTICD_STORE_ADDR=store[0], ELASTICD_STORE_PORT=store[1],
                   ELASTICD_STORE_SECRET=SECRET,
                   TORCHELASTIC_RESTART_COUNT="0", ELASTICD_INPROCESS_SOFT_TIMEOUT="10",
                   ELASTICD_INPROCESS_HARD_TIMEOUT="20", ELASTICD_INPROCESS_BARRIER_TIMEOUT="30",
                   **extra_env)
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([PY, "-m", "elasticd.examples.train_inprocess", *args],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(120))
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
    return codes, [(tmp_path / f"rank{r}.log").read_text() for r in range(world)]


def test_a_rank_raising_at_step_k_recovers_in_process(job_store, tmp_path):
    t0 = time.time()
    codes, logs = run_ranks(job_store, 2, ["--steps", "60", "--crash-at-step", "25",
                                           "--checkpoint-every", "10"], tmp_path)
    assert codes == [0, 0], "\n".join(logs)
    for rank, text in enumerate(logs):
        starts = re.findall(r"INPROCESS_ITERATION (\d+) rank=\d+ pid=(\d+)", text)
        assert [it for it, _ in starts] == ["0", "1"], text
        assert len({pid for _, pid in starts}) == 1  # the same process in both iterations
        done = re.search(r"rank \d: done: 60 steps, iteration (\d+), pid (\d+), all_reduce sum "
                         r"(\S+) ok", text)
        assert done and done.group(1) == "1" and done.group(2) == starts[0][1], text
        assert done.group(3) == "1"  # 0 + 1
    assert "CRASH" in logs[1] and "injected failure on rank 1 at step 25" in logs[1]
    # Rank 0 resumed from the snapshot both ranks held (step 20), not from scratch.
    assert "attempt 0 iteration 1: world size 2, starting at step 20" in logs[0]
    crash = float(re.search(r"CRASH (\S+)", logs[1]).group(1))
    first = float(re.search(r"FIRST_STEP (\S+) attempt=0 iteration=1", logs[0]).group(1))
    assert 0 < first - crash < 5.0, f"recovery took {first - crash:.2f}s"
    assert time.time() - t0 < 100


def test_without_a_store_the_wrapper_runs_the_function_once(tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    env.pop("ELASTICD_STORE_ADDR", None)
    out = subprocess.run([PY, "-m", "elasticd.examples.train_inprocess", "--steps", "5"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    assert "rank 0: done: 5 steps, iteration 0" in out.stdout
    assert "no ELASTICD_STORE_ADDR" in out.stderr


def test_settings_must_keep_soft_below_hard_below_barrier():
    from elasticd.inprocess import InProcessSettings
    with pytest.raises(ValueError, match="soft_timeout < hard_timeout < barrier_timeout"):
        InProcessSettings(soft_timeout=5, hard_timeout=5, barrier_timeout=10)
    with pytest.raises(ValueError, match="ELASTICD_INPROCESS_HARD_TIMEOUT: not a number"):
        InProcessSettings.resolve(env={"ELASTICD_INPROCESS_HARD_TIMEOUT": "soon"})
    assert InProcessSettings.resolve(env={"ELASTICD_INPROCESS_SOFT_TIMEOUT": "30"},
                                     hard_timeout=40).soft_timeout == 30


def test_daemon_job_submitted_inprocess_recovers_without_new_processes(daemon_factory):
    """Through the real daemon: `elasticctl submit --inprocess`, a rank raises, the
    same worker processes carry on (no process restart), and the job succeeds."""
    d = daemon_factory().start()
    r = d.ctl("-o", "json", "submit", "--inprocess", "--nproc-per-node", "2", "--",
              PY, "-m", "elasticd.examples.train_inprocess", "--steps", "60",
              "--crash-at-step", "25", "--checkpoint-every", "10")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["id"]
    job = d.wait_job(job_id, timeout=180)
    assert pb.JobState.Name(job.state) == "SUCCEEDED", d.log()[-3000:]
    assert job.inprocess and job.restarts == 0       # no process restart was needed
    for rank in range(2):
        text = d.rank_log(job_id, rank)
        assert text.count("==== elasticd:") == 1      # started once
        starts = re.findall(r"INPROCESS_ITERATION (\d+) rank=\d+ pid=(\d+)", text)
        assert [it for it, _ in starts] == ["0", "1"], text
        assert len({pid for _, pid in starts}) == 1
    assert "injected failure on rank 1 at step 25" in d.rank_log(job_id, 1)


# ---------------------------------------------------------------- the ladder, through the daemon

def _submit_inprocess(d, *train_args, env=(), max_restarts=3):
    env_args = [a for kv in env for a in ("--env", kv)]
    r = d.ctl("-o", "json", "submit", "--inprocess", "--nproc-per-node", "2",
              "--max-restarts", str(max_restarts), *env_args, "--",
              PY, "-m", "elasticd.examples.train_inprocess", *train_args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["id"]


def _iterations(text):
    return [(int(it), int(pid)) for it, pid in
            re.findall(r"INPROCESS_ITERATION (\d+) rank=\d+ pid=(\d+)", text)]


def test_a_rank_that_exits_is_replaced_and_joins_the_next_iteration(daemon_factory):
    """A rank calling os._exit: the daemon starts a new process for that rank alone, it
    joins the survivors' next iteration, and the job finishes with the right sums and no
    process restart; status and events say the in-process layer recovered it."""
    d = daemon_factory().start()
    job_id = _submit_inprocess(d, "--steps", "60", "--crash-at-step", "25",
                               "--checkpoint-every", "10", "--crash-mode", "exit")
    job = d.wait_job(job_id, timeout=180)
    assert pb.JobState.Name(job.state) == "SUCCEEDED", d.log()[-3000:]
    assert job.restarts == 0                              # no process restart
    assert dict(job.restarts_by_layer)["inprocess"] == 1
    assert dict(job.restart_budget)["inprocess"] == 8
    survivor, replaced = d.rank_log(job_id, 0), d.rank_log(job_id, 1)
    assert [it for it, _ in _iterations(survivor)] == [0, 1]
    assert len({pid for _, pid in _iterations(survivor)}) == 1     # rank 0 never restarted
    assert "replacing pid" in replaced and replaced.count("==== elasticd:") == 2
    # The new process is forked from the job's worker template (on by default).
    assert "from the worker template" in replaced.split("replacing pid", 1)[1].splitlines()[0]
    assert any(e.kind == "replace" and "(template)" in e.reason for e in d.events(job_id))
    its = _iterations(replaced)
    assert [it for it, _ in its] == [0, 1] and its[0][1] != its[1][1]  # a new process
    for text in (survivor, replaced):
        assert "done: 60 steps, iteration 1" in text and "all_reduce sum 1 ok" in text
    attempt = job.attempts[-1]
    assert (attempt.layer, attempt.outcome, attempt.rank) == ("inprocess", "recovered", 1)
    assert "rank 1 exited with exit code 3" in attempt.cause
    assert 0 < attempt.duration_seconds < 60
    kinds = {(e.kind, e.layer) for e in d.events(job_id)}
    assert ("replace", "inprocess") in kinds and ("restart", "inprocess") in kinds
    status = d.ctl("status", job_id).stdout
    assert "in-process 1 (up to 8 per process attempt), process 0/3" in status
    assert "in-process  recovered in" in status


def test_repeated_faults_fall_down_the_ladder_and_fail_with_the_cause_chain(daemon_factory):
    """A rank that raises every time: in-process restarts until the repeat limit, then a
    process restart, the same again, and the job FAILS naming every layer it went through."""
    d = daemon_factory().start()
    job_id = _submit_inprocess(d, "--steps", "60", "--crash-at-step", "25",
                               "--checkpoint-every", "10", "--crash-always", max_restarts=1)
    job = d.wait_job(job_id, timeout=240)
    assert pb.JobState.Name(job.state) == "FAILED", d.log()[-3000:]
    assert job.restarts == 1 and job.exit_code == 1
    assert dict(job.restarts_by_layer) == {"inprocess": 4, "process": 1}
    layers = [(a.layer, a.outcome) for a in job.attempts]
    assert layers == [("inprocess", "recovered")] * 2 + [("process", "recovered")] + \
        [("inprocess", "recovered")] * 2 + [("process", "failed")], layers
    assert "in-process restart gave up" in job.attempts[2].cause
    assert "3 faults within 30s" in job.attempts[2].cause
    assert "cause chain: inprocess x2 (" in job.reason
    assert "-> process x1 (in-process restart gave up" in job.reason
    assert job.reason.count("->") == 3
    r = d.ctl("wait", job_id)
    assert r.returncode == 1


def test_a_hung_rank_is_dumped_killed_and_replaced_in_process(daemon_factory):
    """A rank stuck in time.sleep inside the loop of an --inprocess job: its stacks land in
    its log after the soft timeout, elasticd kills it after the hard one and replaces it;
    the other rank never restarts and the job succeeds. (The wrapper's own end of a stuck
    rank comes later here: inprocess.hard_timeout - soft_timeout = 18 s.)"""
    settings = {"agent.hang_soft_timeout": 3, "agent.hang_hard_timeout": 6,
                "agent.first_step_timeout": 60, "inprocess.soft_timeout": 2,
                "inprocess.hard_timeout": 20, "inprocess.barrier_timeout": 30}
    d = daemon_factory(extra_args=tuple(a for k, v in settings.items()
                                        for a in ("--set", f"{k}={v}"))).start()
    job_id = _submit_inprocess(d, "--steps", "60", "--crash-at-step", "25",
                               "--checkpoint-every", "10", "--crash-mode", "hang")
    job = d.wait_job(job_id, timeout=180)
    assert pb.JobState.Name(job.state) == "SUCCEEDED", d.log()[-3000:]
    assert job.restarts == 0 and dict(job.restarts_by_layer)["inprocess"] == 1
    hung = d.rank_log(job_id, 1)
    assert "time.sleep" in hung or "in train" in hung, hung[-2000:]   # its stacks, dumped
    events = d.events(job_id)
    assert any(e.kind == "hang" and "killed" in e.reason and e.rank == 1 for e in events)
    replace = [e for e in events if e.kind == "replace"]
    assert len(replace) == 1 and "rank 1 hang" in replace[0].reason
    assert len({pid for _, pid in _iterations(d.rank_log(job_id, 0))}) == 1
    assert "all_reduce sum 1 ok" in d.rank_log(job_id, 0)


def test_a_rank_stuck_in_c_ends_itself_at_the_inprocess_hard_timeout_and_is_replaced(
        daemon_factory):
    """The wrapper's own hang handling, long before the daemon's (agent hard timeout 60 s):
    the hung rank's monitor stops the iteration at the soft timeout (2 s); its main thread,
    asleep in C, is not back in Python hard - soft = 3 s later, so the rank dumps its stacks
    and ends itself; the daemon counts a hang, replaces the rank, and the job succeeds."""
    settings = {"agent.hang_soft_timeout": 30, "agent.hang_hard_timeout": 60,
                "agent.first_step_timeout": 60, "inprocess.soft_timeout": 2,
                "inprocess.hard_timeout": 5, "inprocess.barrier_timeout": 90}
    d = daemon_factory(extra_args=tuple(a for k, v in settings.items()
                                        for a in ("--set", f"{k}={v}"))).start()
    job_id = _submit_inprocess(d, "--steps", "60", "--crash-at-step", "25",
                               "--checkpoint-every", "10", "--crash-mode", "hang")
    job = d.wait_job(job_id, timeout=180)
    assert pb.JobState.Name(job.state) == "SUCCEEDED", d.log()[-3000:]
    assert job.restarts == 0 and dict(job.restarts_by_layer)["inprocess"] == 1
    hung = d.rank_log(job_id, 1)
    assert "not back in Python 3s after the fault" in hung, hung[-3000:]
    assert "most recent call first" in hung      # faulthandler: every thread's stack
    events = d.events(job_id)
    # recovered by the wrapper, not by the daemon's kill: no kill, the stuck report came first
    assert not any(e.kind == "hang" and "killed" in e.reason for e in events)
    # The wrapper's own report (layer inprocess). On a loaded machine the daemon may
    # also dump rank 1's stacks (its soft timeout, no kill) before that: not this one.
    stuck = [e for e in events if e.kind == "hang" and e.rank == 1 and e.layer == "inprocess"]
    assert stuck and "not back in Python" in stuck[0].reason, [e.reason for e in events]
    replace = [e for e in events if e.kind == "replace"]
    assert len(replace) == 1 and replace[0].reason.startswith("rank 1: hang: not back"), replace
    f = job.last_failure
    assert f.rank == 1 and f.cause.startswith("rank 1: hang: not back in Python"), f
    assert "time.sleep" in f.traceback or "in train" in f.traceback, f.traceback
    assert len({pid for _, pid in _iterations(d.rank_log(job_id, 0))}) == 1
    assert "all_reduce sum 1 ok" in d.rank_log(job_id, 0)
