"""`elasticctl status/wait/events/cancel JOB` on a node that never ran the job.

The pure part (control/remote_jobs.py: the record the cluster's keys make of a job,
the round status as a job state, resolving a live name) is tested on its
own; then three real daemons on one real etcd, driven with the real
``elasticctl``: a 2-node job on n1 and n2 whose rank on n2 fails once, seen
from n3 (status with both nodes' ranks, events of both nodes, logs naming
where they are, who may see it, an unknown id), cancelled from n3; and a
job on n2 alone that n3 waits for.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from elasticd.control.remote_jobs import AmbiguousName, find, job_state, nodes_of, record_from_keys
from elasticd.jobs.spec import JobSpec
from elasticd.jobs.registry import JobRecord
from elasticd.rendezvous.protocol import Join, Member, RoundState
from elasticd.rendezvous.view import JobKeys
from elasticd.jobs.states import JobState
from etcd_cluster import (NO_SPARES_NOBODY_MAY_CALL as NO_SPARES, cluster_daemon, ctl_json,
                          fresh_prefix, wait_for)
from etcd_server import EtcdServer, etcd_binary
from elasticd.v1 import control_pb2 as pb

PY = sys.executable
NOBODY = (65534, 65534, [65534])
NOW = 1_700_000_100.0


# ---------------------------------------------------------------- pure parts

def spec(job_id: str = "j1", name: str = "bert", uid: int = 0) -> JobSpec:
    rec = JobRecord(id=job_id, name=name, command=["python", "train.py"], cwd="/w", uid=uid,
                    gid=uid, user="root" if uid == 0 else "alice", min_nodes=2, max_nodes=2,
                    nproc_per_node=1, max_restarts=3, created_at=NOW - 100, node_id="n1")
    return JobSpec.of_record(rec, ("n1", "n2"))


def member(node: str) -> Member:
    return Member(node, f"10.0.0.{node[-1]}", 1, 29500)


def join(node: str) -> Join:
    return Join(node, f"10.0.0.{node[-1]}", 1, 29500)


def row(rank: int, node: str, state: str = "running") -> dict:
    return {"rank": rank, "local_rank": 0, "pid": 100 + rank, "state": state, "exit_code": 0,
            "node_id": node, "create_time": 0.0}


def running_keys(**state) -> JobKeys:
    rs = RoundState(round=2, status="closed", members=(member("n1"), member("n2")),
                    restarts=1, reason="round 2 closed with 2 node(s) (max reached)",
                    opened_at=NOW - 10, closed_at=NOW - 5)
    if state:
        rs = RoundState(**{**rs.__dict__, **state})
    keys = JobKeys(spec=spec(), state=rs)
    keys.put_workers("n2", [row(1, "n2")], {})
    keys.put_workers("n1", [row(0, "n1")], {})
    return keys


def test_a_running_job_shows_round_restarts_every_nodes_ranks_and_where_it_runs():
    rec = record_from_keys(running_keys(), NOW)
    assert rec.state is JobState.RUNNING
    assert (rec.id, rec.name, rec.uid, rec.node_id) == ("j1", "bert", 0, "n1")
    assert (rec.round, rec.restarts, rec.max_restarts) == (2, 1, 3)
    assert rec.reason == ("this node does not run it; running on n1, n2: "
                          "round 2 closed with 2 node(s) (max reached)")
    assert [(w.rank, w.node_id, w.state.value) for w in rec.workers] == \
        [(0, "n1", "running"), (1, "n2", "running")]
    assert rec.state_since == NOW - 5 and rec.finished_at == 0


def test_every_nodes_recovery_summary_makes_the_layers_last_failure_and_history():
    keys = running_keys()
    f1 = {"rank": 0, "exit_code": 1, "signal": 0, "cause": "older", "traceback": "tb0",
          "time": NOW - 50, "restart": 0, "node_id": "n1"}
    f2 = dict(f1, rank=1, exit_code=3, cause="rank 1 exited with exit code 3", time=NOW - 9,
              traceback="x" * 10_000, node_id="n2")
    step = {"layer": "inprocess", "cause": "c", "time": NOW - 8, "duration": 0.05,
            "outcome": "recovered", "rank": 1, "node_id": "n2"}
    published = {
        "n1": {"restarts_by_layer": {"inprocess": 2, "process": 1}, "last_failure": f1,
               "restart_budget": {"inprocess": 8, "process": 3, "rendezvous": -1},
               "attempts": [dict(step, layer="process", time=NOW - 50, node_id="n1")]},
        "n2": {"restarts_by_layer": {"inprocess": 3, "process": 1}, "last_failure": f2,
               "restart_budget": {"inprocess": 8, "process": 3, "rendezvous": -1},
               "attempts": [step]},
        "n9": {"restarts_by_layer": {"process": "many"}, "last_failure": "garbage"},
        "n8": {"attempts": "not a list of dicts", "last_failure": {"time": "soon"}},
    }
    for node, summary in published.items():
        keys.put_workers(node, [row(0, "n1")] if node == "n1" else
                         [row(1, "n2")] if node == "n2" else [], summary)
    rec = record_from_keys(keys, NOW)
    assert rec.restarts_by_layer == {"inprocess": 3, "process": 1}   # the most any node saw
    assert rec.restart_budget == {"inprocess": 8, "process": 3, "rendezvous": -1}
    assert (rec.last_failure.rank, rec.last_failure.node_id) == (1, "n2")  # the newest
    assert len(rec.last_failure.traceback) == 4000
    assert [(a.layer.value, a.node_id) for a in rec.attempts] == [("process", "n1"),
                                                                  ("inprocess", "n2")]
    from elasticd.control.messages import job_to_proto
    assert job_to_proto(rec).last_failure.exit_code == 3  # what status sends, from n3


@pytest.mark.parametrize("status,rnd,restarts,joined,want", [
    ("open", 1, 0, (), JobState.PENDING),
    ("open", 1, 0, ("n1",), JobState.RENDEZVOUS),
    ("open", 2, 1, ("n1",), JobState.RESTARTING),
    ("open", 3, 0, (), JobState.RESTARTING),       # a scale-up round
    ("closed", 1, 0, ("n1", "n2"), JobState.RUNNING),
    ("succeeded", 1, 0, (), JobState.SUCCEEDED),
    ("failed", 4, 3, (), JobState.FAILED),
    ("cancelled", 1, 0, (), JobState.CANCELLED),
])
def test_the_round_status_maps_onto_the_job_states(status, rnd, restarts, joined, want):
    members = (member("n1"), member("n2")) if status != "open" else ()
    keys = JobKeys(spec=spec(), state=RoundState(round=rnd, status=status, restarts=restarts,
                                                 members=members),
                   joins={rnd: {n: join(n) for n in joined}})
    assert job_state(keys) is want


def test_an_open_round_names_the_nodes_joined_so_far_and_a_final_one_where_it_ran():
    keys = running_keys(status="open", members=(), round=3, reason="node n2 lost")
    keys.joins = {3: {"n1": join("n1")}}
    rec = record_from_keys(keys, NOW)
    assert rec.state is JobState.RESTARTING
    assert rec.reason == "this node does not run it; joined so far: n1: node n2 lost"
    assert nodes_of(JobKeys(spec=spec(), state=keys.state)) == []
    failed = record_from_keys(running_keys(status="failed", reason="no restarts left"), NOW)
    assert failed.reason == "this node does not run it; ran on n1, n2: no restarts left"
    assert (failed.exit_code, failed.finished_at) == (1, NOW - 5)
    assert record_from_keys(running_keys(status="succeeded"), NOW).exit_code == 0


@pytest.mark.parametrize("keys", [
    JobKeys(spec=None, state=RoundState()),
    JobKeys(spec=spec(), state=None),
    JobKeys(spec={"id": "j1", "name": "no command"}, state=RoundState()),
    JobKeys(spec={**spec().to_wire(), "uid": "root"}, state=RoundState()),
])
def test_keys_without_a_usable_spec_and_state_make_no_job(keys):
    assert record_from_keys(keys, NOW) is None


def test_worker_rows_that_do_not_parse_are_left_out():
    keys = running_keys()
    keys.put_workers("n3", [{"rank": "x"}, "garbage", row(2, "n3")], {})
    assert [w.node_id for w in record_from_keys(keys, NOW).workers] == ["n1", "n2", "n3"]


class FakeView:
    def __init__(self, jobs: dict[str, JobKeys]):
        self.jobs = jobs

    def job(self, job_id: str) -> JobKeys | None:
        return self.jobs.get(job_id)

    def job_ids(self) -> list[str]:
        return list(self.jobs)


def test_an_id_or_a_live_name_resolves_and_the_callers_own_job_wins_a_shared_name():
    done = running_keys(status="succeeded")
    view = FakeView({"j1": running_keys(), "j0": JobKeys(spec=spec("j0"), state=done.state)})
    anyone = lambda uid: True  # noqa: E731
    assert find(view, "j0", anyone)[0] == "j0", "an id resolves whatever its state"
    assert find(view, "bert", anyone)[0] == "j1", "a name only among live jobs"
    assert find(view, "nope", anyone) is None
    view.jobs["j2"] = JobKeys(spec=spec("j2", uid=1000), state=running_keys().state)
    assert find(view, "bert", lambda uid: uid == 1000)[0] == "j2"
    with pytest.raises(AmbiguousName, match="j1, j2"):
        find(view, "bert", anyone)


# ---------------------------------------------------------------- real daemons, real etcd

# The rank on n2 exits 3 at its first start; then every rank runs until cancelled.
FAIL_ON_N2_ONCE_THEN_RUN = [PY, "-c", (
    "import os, sys, time\n"
    "first = os.environ['TORCHELASTIC_RESTART_COUNT'] == '0'\n"
    "if first and os.environ['ELASTICD_NODE_ID'] == 'n2':\n"
    "    time.sleep(0.5); sys.exit(3)\n"
    "time.sleep(300)\n")]


@pytest.fixture
def trio(daemon_factory):
    if etcd_binary() is None:
        pytest.skip("needs an etcd binary")
    with EtcdServer() as etcd:
        prefix = fresh_prefix()
        nodes = [cluster_daemon(daemon_factory, etcd.url, n, prefix, *NO_SPARES)
                 for n in ("n1", "n2", "n3")]
        for d in nodes:
            d.start()
        yield nodes
        for d in nodes:  # before etcd goes: a clean stop
            d.stop()


def refused(res, code: str) -> str:
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert code in res.stderr and "Traceback" not in res.stderr, res.stderr
    return res.stderr


def test_a_job_on_n1_and_n2_seen_waited_for_and_cancelled_from_n3(trio):
    n1, n2, n3 = trio
    res = n1.ctl("submit", "--name", "bert", "--nnodes", "2", "--nodes", "n1,n2",
                 "--max-restarts", "2", "--", *FAIL_ON_N2_ONCE_THEN_RUN)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip()
    n1.wait_state(job, "RUNNING", 60, pred=lambda j: j.restarts == 1)

    # status on n3, which never ran it: state, round, restarts, both nodes' ranks.
    st = wait_for(lambda: (s := ctl_json(n3, "status", job)) and
                  len([w for w in s["workers"] if w["state"] == "running"]) == 2 and s, 20,
                  what="both nodes' running ranks in status on n3")
    assert (st["id"], st["name"], st["state"], st["node_id"]) == (job, "bert", "RUNNING", "n1")
    assert (st["round"], st["restarts"], st["max_restarts"]) == (2, 1, 2), st
    assert sorted((w["rank"], w["node_id"]) for w in st["workers"]) == [(0, "n1"), (1, "n2")]
    assert "this node does not run it; running on n1, n2" in st["reason"], st["reason"]
    assert ctl_json(n3, "status", "bert")["id"] == job, "a live name resolves cluster-wide"
    assert n3.ctl("list", "-o", "json").stdout.count(job) == 0, "list stays this node's"
    table = n3.ctl("status", job).stdout
    assert "RUNNING" in table and "n2" in table, table
    # ... and the recovery, as the nodes that ran it published it: n2's exit 3.
    f = st["last_failure"]
    assert (f["rank"], f["exit_code"], f["node_id"]) == (1, 3, "n2"), st
    assert st["restarts_by_layer"]["process"] == 1, st
    assert "last failure: rank 1 exit code 3" in table and "process 1/2" in table, table

    # events on n3: both nodes' transitions and n2's worker exit.
    def both_nodes_events():
        res = n3.ctl("-o", "json", "events", job)
        assert res.returncode == 0, res.stderr
        evs = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
        got = {(e["node_id"], e["kind"], e.get("to_state") or "") for e in evs}
        want = {(n, "state", s) for n in ("n1", "n2") for s in ("RESTARTING", "RUNNING")}
        return want <= got and ("n2", "worker_exit", "") in got and evs
    evs = wait_for(both_nodes_events, 20, what="both nodes' transitions in events on n3")
    assert all(e["job_id"] == job for e in evs)
    assert not [e for e in evs if e["node_id"] == "n3"], "n3 has no events of its own for it"

    # What n3 cannot do, or not for this user, says so.
    assert "n1" in refused(n3.ctl("logs", job), "FAILED_PRECONDITION")
    err = refused(n3.ctl("status", job, user=NOBODY), "PERMISSION_DENIED")
    assert job in err and "root" in err
    refused(n3.ctl("events", job, user=NOBODY), "PERMISSION_DENIED")
    refused(n3.ctl("cancel", job, user=NOBODY), "PERMISSION_DENIED")
    assert "no job 'zzzzzzzz'" in refused(n3.ctl("status", "zzzzzzzz"), "NOT_FOUND")
    # Another user's name, of a job only other nodes run, tells nothing: as a name nobody has.
    theirs = refused(n3.ctl("status", "bert", user=NOBODY), "NOT_FOUND")
    assert theirs == refused(n3.ctl("status", "ernie", user=NOBODY),
                             "NOT_FOUND").replace("ernie", "bert"), theirs
    res = n3.ctl("wait", job, "--timeout", "0.5")
    assert res.returncode == 1 and "still running" in res.stderr, res.stderr

    # cancel from n3 goes through the round state: n1 and n2 stop their workers.
    # It answers at once; `wait` on n3 then sees the job ended everywhere.
    res = n3.ctl("-o", "json", "cancel", job)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["id"] == job
    res = n3.ctl("-o", "json", "wait", job, "--timeout", "30")
    out = json.loads(res.stdout)
    assert out["state"] == "CANCELLED" and "cancelled by root on n3" in out["reason"], out
    assert not [w for w in out["workers"] if w["state"] == "running"], out["workers"]
    for d in (n1, n2):
        final = d.wait_job(job, 30)
        assert final.state == pb.CANCELLED and "cancelled by root on n3" in final.reason, final


def test_n3_waits_for_a_job_that_runs_on_n2_alone(trio):
    n1, n2, n3 = trio
    job = n1.ctl("submit", "--nodes", "n2", "--", PY, "-c",
                 "import time; time.sleep(1.5)").stdout.strip()
    res = n3.ctl("-o", "json", "wait", job, "--timeout", "60")
    assert res.returncode == 0, (res.stdout, res.stderr)
    out = json.loads(res.stdout)
    assert out["state"] == "SUCCEEDED" and "ran on n2" in out["reason"], out
    assert [(w["rank"], w["node_id"], w["state"]) for w in out["workers"]] == \
        [(0, "n2", "succeeded")]
    assert os.path.isdir(os.path.join(n2.state_dir, "logs", job))
    assert not os.path.exists(os.path.join(n3.state_dir, "logs", job))
