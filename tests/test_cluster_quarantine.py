"""A node's memory of its faults (cluster/faults.py, cluster/quarantine.py).

The decisions without I/O first; then two real daemons on a real etcd: a
job's own failures do not count, a node whose workers keep dying of SIGBUS is
quarantined, `nodes` shows why, a running job with nowhere else to go keeps
it, a new 2-node job does not take it, the quarantine outlives a kill -9 of
its daemon, and `uncordon` brings it back (the waiting job then runs on both).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

import pytest

from elasticd import config
from elasticd.agent.gpu_gate import leaves_job
from elasticd.cluster.faults import (MAX_FAULTS, Fault, FaultBook, FaultKind, fault_key, judge,
                                     node_owned, reasons)
from elasticd.cluster.node import Cluster
from elasticd.cluster.quarantine import FaultMemory
from elasticd.gpus.health import HealthGate
from elasticd.gpus.inventory import discover
from elasticd.jobs.jobevent import JobEvent
from elasticd.jobs.registry import JobRegistry
from elasticd.store import MemoryStore, open_store
from elasticd.trust.refusals import Refusals
from elasticd.trust.sealed import MAX_BODY, Kind, SealedRecords
from etcd_cluster import cluster_daemon, ctl_json, fresh_prefix, scrape, states, wait_for
from etcd_server import EtcdServer, etcd_binary
from elasticd.v1 import control_pb2 as pb

W = FaultKind.WORKER_EXIT


def faults(*times, kind=W):
    return [Fault(t, kind, f"j{i}", "exit 3", 0) for i, t in enumerate(times)]


# ---------------------------------------------------------------- the decision

def test_quarantined_at_the_threshold_within_the_window():
    v = judge(faults(10, 20, 30), now=40, window=60, threshold=3)
    assert v.quarantine and len(v.faults) == 3
    assert "3 faults in the last 60s (3 worker_exit" in v.reason
    assert not judge(faults(10, 20), now=40, window=60, threshold=3).quarantine


def test_faults_older_than_the_window_or_in_the_future_do_not_count():
    v = judge(faults(1, 50, 55, 100), now=60, window=20, threshold=3)
    assert not v.quarantine and [f.time for f in v.faults] == [50, 55]


def test_threshold_zero_is_off():
    assert not judge(faults(*range(1, 50)), now=50, window=100, threshold=0).quarantine


def test_a_release_forgives_the_faults_before_it():
    fs = faults(10, 20, 30, 40)
    assert judge(fs, now=41, window=100, threshold=3).quarantine
    assert not judge(fs, now=41, window=100, threshold=3, released_at=30).quarantine
    assert judge(fs + faults(41, 42), now=43, window=100, threshold=3,
                 released_at=30).quarantine


def test_causes_and_reasons_name_kinds_and_newest_faults():
    fs = faults(1, 2) + faults(3, kind=FaultKind.LEASE_LOST) + faults(4, 5, kind=FaultKind.HANG)
    v = judge(fs, now=6, window=10, threshold=5)
    assert v.causes() == {"worker_exit": 2, "lease_lost": 1, "hang": 2}
    said = reasons(v)
    assert said[0] == v.reason and len(said) == 5 and said[-1].startswith("hang (job j")


def test_the_book_ages_out_bounds_and_reads_back_what_it_wrote():
    book = FaultBook()
    for t in range(MAX_FAULTS + 20):
        book = book.add(Fault(float(t), W, "job", "x" * 300, t), now=float(t), window=1e6)
    assert len(book.faults) == MAX_FAULTS and book.faults[0].time == 20.0
    assert len(book.add(Fault(1e6, W), now=1e6 + 10, window=100).faults) == 1
    body = book.to_json(MAX_BODY[Kind.FAULTS])
    assert len(body) <= MAX_BODY[Kind.FAULTS]
    again = FaultBook.from_doc(json.loads(body))
    assert again.faults[-1].detail == "x" * 200 and again.faults[-1].attempt == MAX_FAULTS + 19
    small = book.to_json(2000)   # too many to fit: the oldest are left out
    assert len(small) <= 2000 and json.loads(small)["faults"][-1]["attempt"] == MAX_FAULTS + 19


@pytest.mark.parametrize("doc", [{"faults": "no"}, {"faults": [{"kind": "boom", "time": 1}]},
                                 {"faults": [{"kind": "hang", "time": -1}]},
                                 {"faults": [], "quarantined": 1},
                                 {"reasons": ["x"] * 6}, {"reasons": ["x" * 501]}])
def test_a_bad_record_is_refused_by_field(doc):
    with pytest.raises(ValueError):
        FaultBook.from_doc(doc)


def test_one_fault_per_kind_per_job_attempt():
    assert Fault(1, W, "j", "a", 2).key() == Fault(9, W, "j", "b", 2).key()
    assert Fault(1, W, "j", "a", 2).key() != Fault(1, W, "j", "a", 3).key()
    lost = FaultKind.LEASE_LOST
    assert Fault(1, lost).key() != Fault(2, lost).key()


def test_only_the_faults_a_node_owns_count():
    assert node_owned(FaultKind.GPU_HEALTH) and node_owned(FaultKind.LEASE_LOST)
    assert node_owned(W, int(signal.SIGBUS))          # the kernel's memory error
    for sig in (0, signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV, signal.SIGABRT):
        assert not node_owned(W, int(sig))            # the job's: its exception, a kill
    assert not node_owned(FaultKind.HANG)             # a stuck collective: whose, unknown


def test_a_quarantined_node_leaves_a_job_only_if_it_keeps_its_min_nodes():
    assert leaves_job({"b", "c"}, set(), 2)
    assert not leaves_job({"b", "c"}, {"c"}, 2)       # c is drained or quarantined too
    assert not leaves_job(set(), set(), 1)            # a job pinned to this node
    assert leaves_job({"b"}, {"x"}, 1)


# ------------------------------------------- the memory, in process, on the memory store

RECORDS = SealedRecords(b"k" * 32, "/elasticd")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def node_parts(tmp_path):
    """(cfg, store, cluster, registry, rejected) of one node, quarantined at 3 faults."""
    state = os.path.join(tmp_path, "n1")
    cfg = config.load(env={}, overrides={
        "daemon.node_id": "n1", "daemon.state_dir": state, "daemon.socket": "/tmp/x.sock",
        "membership.watch_retry": 0.05, "cluster.quarantine_faults": 3,
        "cluster.quarantine_window": 600})
    store = MemoryStore()
    rejected = []
    cluster = Cluster(cfg, store, records=RECORDS,
                      refusals=Refusals("n1", lambda k, r: rejected.append((k, r))))
    cluster.capacity_from(lambda: (4, []))
    cluster.start()
    try:
        yield cfg, store, cluster, JobRegistry(state, "n1"), rejected
    finally:
        cluster.stop()


def test_lost_leases_quarantine_the_node_the_record_outlives_it_uncordon_forgives(node_parts):
    cfg, store, cluster, registry, rejected = node_parts
    clock = Clock()
    memory = FaultMemory(cfg, store, RECORDS, cluster, registry, Refusals("n1"), clock=clock)
    cluster.keeper.lease_lost_listeners.append(memory.lease_lost)
    wait_for(cluster.drains_loaded, 5, what="the drain watch's first read")
    for _ in range(3):   # the lease keeper finds its lease gone, and registers again
        store.revoke_lease(cluster.keeper.lease)
        assert cluster.keeper.tick() == "registered again after losing the lease"
        memory.tick()
    said = memory.quarantined()
    assert said[0].startswith("3 faults in the last 600s (3 lease_lost")
    assert cluster.drain_states()["n1"]["reasons"] == said
    assert memory.causes() == {"worker_exit": 0, "hang": 0, "gpu_health": 0, "lease_lost": 3}
    sealed = store.get(fault_key("n1")).value
    assert sealed.startswith("e1.")
    assert RECORDS.open(Kind.FAULTS, fault_key("n1"), sealed).doc["quarantined"] is True

    # A new daemon of the node (the record is all it has): still quarantined.
    again = FaultMemory(cfg, store, RECORDS, cluster, registry, Refusals("n1"), clock=clock)
    again.tick()
    assert again.quarantined() == said

    # Uncordoned: the release is recorded, the faults before it no more count.
    cluster.set_drain("n1", False, "root")
    again.tick()
    assert again.quarantined() == () and "n1" not in cluster.drain_states()
    again.lease_lost()
    again.tick()
    assert again.quarantined() == () and again.causes()["lease_lost"] == 1
    book = FaultBook.from_doc(RECORDS.open(Kind.FAULTS, fault_key("n1"),
                                           store.get(fault_key("n1")).value).doc)
    assert not book.quarantined and book.released_at > 0 and len(book.faults) == 4

    # A record moved from another node's key does not verify: refused, counted, new.
    store.put(fault_key("n1"), RECORDS.seal(Kind.FAULTS, fault_key("n2"), book.to_json(4096)))
    refusals = Refusals("n1", lambda k, r: rejected.append((k, r)))
    fresh = FaultMemory(cfg, store, RECORDS, cluster, registry, refusals, clock=clock)
    fresh.tick()
    assert rejected == [("faults", "bad_mac")] and fresh.causes()["lease_lost"] == 0


def test_a_jobs_own_worker_failures_do_not_count_a_machine_signal_does(node_parts):
    cfg, store, cluster, registry, _ = node_parts
    memory = FaultMemory(cfg, store, RECORDS, cluster, registry, Refusals("n1"), clock=Clock())
    wait_for(cluster.drains_loaded, 5, what="the drain watch's first read")
    # (the clock starts at 1000: these faults are all within the window)
    for attempt, sig in enumerate((0, 9, 15, 11, 9, 9)):    # one broken job: not the node
        memory.on_event(JobEvent("j", 900.0 + attempt, "worker_exit", node_id="n1",
                                 restart=attempt, signal=sig))
    memory.on_event(JobEvent("j", 901.0, "hang", node_id="n1"))
    memory.tick()
    assert memory.quarantined() == () and sum(memory.causes().values()) == 0
    for attempt in range(3):                        # SIGBUS: the machine's memory error
        memory.on_event(JobEvent("j", 910.0 + attempt, "worker_exit", node_id="n1",
                                 restart=attempt, signal=int(signal.SIGBUS)))
    memory.on_event(JobEvent("k", 911.0, "worker_exit", node_id="n2",
                             signal=int(signal.SIGBUS)))     # another node's: not ours
    memory.tick()
    assert memory.causes()["worker_exit"] == 3 and memory.quarantined()


def test_with_health_release_a_node_whose_gpus_pass_returns_by_itself(node_parts, tmp_path):
    cfg, store, cluster, registry, _ = node_parts
    fake = os.path.join(tmp_path, "gpus.json")
    doc = {"gpus": [{"index": 0, "uuid": "GPU-fake-0", "memory_mib": 81920, "numa_node": 0}],
           "healthy": False, "problem": "GPU 0: XID 79 (fell off the bus)"}
    with open(fake, "w") as fh:
        json.dump(doc, fh)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, quarantine_health_release=True, quarantine_recheck=5.0),
        daemon=dataclasses.replace(cfg.daemon, fake_gpus_file=fake))
    gate = HealthGate(cfg, discover("auto", fake), registry, drain=lambda why: None)
    clock = Clock()
    memory = FaultMemory(cfg, store, RECORDS, cluster, registry, Refusals("n1"), gate,
                         clock=clock)
    wait_for(cluster.drains_loaded, 5, what="the drain watch's first read")
    for _ in range(3):
        memory.lease_lost()
    memory.tick()
    assert memory.quarantined()
    memory.tick()                                 # its GPUs still fail: it stays
    assert memory.quarantined() and "n1" in cluster.drain_states()
    doc.update(healthy=True, problem="")
    with open(fake, "w") as fh:
        json.dump(doc, fh)
    memory.tick()                                 # within quarantine_recheck: not checked
    assert memory.quarantined()
    clock.now += 5
    memory.tick()
    assert memory.quarantined() == () and "n1" not in cluster.drain_states()
    book = FaultBook.from_doc(RECORDS.open(Kind.FAULTS, fault_key("n1"),
                                           store.get(fault_key("n1")).value).doc)
    assert not book.quarantined and book.released_at > 0


# ---------------------------------------------------------------- real daemons

pytestmark_etcd = pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary")

QUARANTINE = ("--set", "cluster.quarantine_faults=3", "--set", "cluster.quarantine_window=600",
              "--set", "cluster.quarantine_recheck=0.3", "--set", "agent.restart_backoff_step=0",
              "--set", "agent.warm_spares=false")

# A worker that fails once, when the test says (file GO), and succeeds when run again.
FAIL_ON_CUE = """import os, sys, time
if os.path.exists("again"):
    sys.exit(0)
while not os.path.exists("GO"):
    time.sleep(0.05)
open("again", "w").close()
sys.exit(3)
"""


SIGBUS = "import os, signal; os.kill(os.getpid(), signal.SIGBUS)"


def _submit(d, command, *, nodes=(), min_nodes=1, max_nodes=1, max_restarts=0) -> str:
    req = pb.SubmitRequest(command=list(command), cwd=d.root, env=dict(os.environ),
                           nproc_per_node=1, min_nodes=min_nodes, max_nodes=max_nodes,
                           nodes=list(nodes), max_restarts=max_restarts)
    with d.client() as c:
        return c.call("Submit", req).job.id


def _node(d, node_id) -> dict:
    return next(n for n in ctl_json(d, "nodes")["nodes"] if n["node_id"] == node_id)


@pytest.mark.slow   # 12-25 s of two daemons and real workers; the default suite is at its budget
@pytestmark_etcd
def test_a_node_whose_workers_keep_dying_of_sigbus_is_quarantined_until_uncordoned(daemon_factory):
    with EtcdServer() as etcd:
        prefix = fresh_prefix()
        a = cluster_daemon(daemon_factory, etcd.url, "q-a", prefix, *QUARANTINE).start()
        b = cluster_daemon(daemon_factory, etcd.url, "q-b", prefix, *QUARANTINE,
                           metrics=True).start()
        wait_for(lambda: states(a) == {"q-a": "ready", "q-b": "ready"}, 10, what="both ready")

        # A job running on q-b before the quarantine, pinned to it: with nowhere else to
        # go it keeps q-b at its next round.
        with open(os.path.join(b.root, "cue.py"), "w") as fh:
            fh.write(FAIL_ON_CUE)
        running = _submit(b, [sys.executable, "cue.py"], nodes=("q-b",), max_restarts=1)
        b.wait_state(running, "RUNNING")
        # A job's own failures are not the node's: three attempts exit 3, no fault.
        own = _submit(b, [sys.executable, "-c", "import sys; sys.exit(3)"], nodes=("q-b",),
                      max_restarts=2)
        assert b.wait_job(own).state == pb.FAILED
        # Three attempts of a job pinned to q-b die of SIGBUS (how the kernel ends a
        # process that touched broken memory): three faults, the threshold.
        bad = _submit(b, [sys.executable, "-c", SIGBUS], nodes=("q-b",), max_restarts=2)
        assert b.wait_job(bad).state == pb.FAILED
        wait_for(lambda: states(a).get("q-b") == "quarantined", 10, what="q-b quarantined")
        seen = _node(a, "q-b")   # every node reads the reasons from etcd
        assert seen["state"] == "quarantined"
        assert "3 faults in the last 600s (3 worker_exit" in seen["quarantine"][0]
        assert any(bad in r for r in seen["quarantine"][1:])
        table = a.ctl("nodes").stdout
        assert "quarantined: q-b: 3 faults" in table and "elasticctl uncordon q-b" in table
        events = [e for e in b.events(bad) if e.kind == "quarantine"]
        assert len(events) == 1 and "node q-b quarantined" in events[0].reason, events
        m = scrape(b.metrics_port)
        assert m["elasticd_node_quarantined"] == 1
        assert m['elasticd_node_faults{cause="worker_exit"}'] == 3
        assert m["elasticd_cluster_nodes_quarantined"] == 1
        assert b.log().count("quarantined: 3 faults") == 1

        assert own not in " ".join(seen["quarantine"])

        # The running job's next round: q-b stays in it (the job has no other node).
        open(os.path.join(b.root, "GO"), "w").close()
        assert b.wait_job(running, timeout=30).state == pb.SUCCEEDED
        kept = [e.reason for e in b.events(running) if e.kind == "quarantine"]
        assert any("is quarantined but stays in this job" in r for r in kept), kept

        # Its own daemon killed and started again: still quarantined, from etcd.
        b.kill()
        b.start()
        wait_for(lambda: states(a).get("q-b") == "quarantined", 10, what="q-b back, quarantined")
        store = open_store("etcd3", [etcd.url], prefix=prefix)
        try:
            assert store.get(fault_key("q-b")).value.startswith("e1.")   # sealed
        finally:
            store.close()

        # A new 2-node job does not take it: it waits for a second node.
        two = _submit(a, [sys.executable, "-c", "pass"], min_nodes=2, max_nodes=2)
        wait_for(lambda: a.job(two).state == pb.RENDEZVOUS, 10, what="the 2-node job waiting")
        time.sleep(1.0)   # time for q-b's dispatcher to look at it (it wakes on the change)
        assert a.job(two).state == pb.RENDEZVOUS
        with b.client() as c:
            assert two not in {j.id for j in c.call("ListJobs", pb.ListJobsRequest()).jobs}

        # uncordon brings it back: it takes the waiting job, which runs on both.
        assert ctl_json(a, "uncordon", "q-b")["state"] == "ready"
        done = a.wait_job(two, timeout=60)
        assert done.state == pb.SUCCEEDED, done
        wait_for(lambda: scrape(b.metrics_port)["elasticd_node_quarantined"] == 0, 10,
                 what="q-b's record released")
        assert b.log().count("quarantine lifted") == 1
