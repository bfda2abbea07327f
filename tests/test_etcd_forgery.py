"""Nothing an etcd writer without the cluster key puts steers a job (issue 29, item 1).

Two real root daemons on a real etcd run a 2-node job of real torch ranks;
the attacker writes the daemons' prefix with etcdctl and reads what they
wrote. Reproduced on the code before this change: a closed round whose
members name the attacker's address and port (``hosted: true``) was adopted
by both daemons, and every rank connected to the attacker's TCPStore; an
old closed round replayed as is stopped the job for good; a forged node
record showed in ``nodes``, a forged drain mark drained a node, a forged
event showed in ``events``. Each now fails to verify (or is older than what
the daemons hold), is counted in ``elasticd_etcd_records_rejected_total``
and is never acted on.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import time
from collections import Counter

import pytest

from daemons import cluster_key_path
from elasticd.config import ControlSettings
from elasticd.trust import clusterkey
from elasticd.trust.sealed import Kind, SealedRecords
from elasticd.trust.specs import SpecCodec
from etcd_cluster import ctl_json, wait_for
from etcd_server import EtcdServer, etcd_binary
from hostile_etcd import TrainingPair, Trap, steady, wait_metric

pytestmark = [
    pytest.mark.skipif(etcd_binary() is None or shutil.which("etcdctl") is None,
                       reason="needs etcd and etcdctl (apt etcd-server etcd-client)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real root daemons"),
]


@pytest.fixture(scope="module")
def pair():
    with EtcdServer() as etcd:
        p = TrainingPair(etcd.url)
        try:
            p.job = p.start_training()
            # What the attacker reads before writing anything: the genuine closed round
            # and n1's genuine join of it.
            p.round = p.running(p.job)["n1"][1]
            p.genuine_state = p.attacker.get(f"/v1/rounds/{p.job}/state")
            p.genuine_join = p.attacker.get(f"/v1/joins/{p.job}/round/{p.round}/n1")
            assert '"closed"' in p.genuine_state and p.genuine_join, p.genuine_state
            yield p
        finally:
            p.close()


def _member(node: str, port: int) -> dict:
    return {"node_id": node, "address": "127.0.0.1", "nproc": 1, "port": port,
            "store_port": 0, "hosted": True}


KINDS = {"state": Kind.STATE, "joins": Kind.JOIN, "decider": Kind.DECIDER, "done": Kind.DONE,
         "workers": Kind.WORKERS, "phases": Kind.PHASES, "phasedigests": Kind.PHASES,
         "nodes": Kind.NODE, "drain": Kind.DRAIN, "events": Kind.EVENT,
         "witnesses": Kind.WITNESS, "lost": Kind.LOST}


def _kind(key: str) -> Kind | None:
    parts = key.split("/")   # /v1/jobs/J/spec, /v1/rounds/J/state, /v1/nodes/N, /v1/events/J/N/S,
                             # /v1/joins/J/round/R/N, /v1/joins/J/done/R/N
    if parts[2] in ("jobs", "rounds"):
        return None if parts[4] == "spec" else KINDS[parts[4]]
    if parts[2] == "joins" and parts[4] == "done":
        return Kind.DONE
    return KINDS[parts[2]]


def test_every_value_the_daemons_write_is_sealed_with_the_cluster_key(pair):
    """Before any attack: every key under the prefix (a job that ran to its end, the
    training job, both nodes, a drain mark, the events) verifies with the key."""
    pair.run_short_job()
    assert pair["n1"].ctl("drain", "n2").returncode == 0
    try:
        dump = json.loads(pair.attacker.etcdctl("get", "--prefix", pair.prefix + "/",
                                                "-w", "json"))
    finally:
        assert pair["n1"].ctl("uncordon", "n2").returncode == 0
    keys = clusterkey.load(cluster_key_path())
    records = SealedRecords(keys.records, pair.prefix)
    specs = SpecCodec(keys, ControlSettings())
    seen = Counter()
    for kv in dump["kvs"]:
        key = base64.b64decode(kv["key"]).decode()[len(pair.prefix):]
        value = base64.b64decode(kv["value"]).decode()
        kind = _kind(key)
        if kind is None:
            specs.open(key.split("/")[3], value)      # raises if it does not verify
            seen["spec"] += 1
        else:
            assert records.open(kind, key, value).seq > 0, key
            seen[kind.value] += 1
    assert {"spec", "state", "join", "done", "workers", "phases", "node", "drain",
            "event", "witness"} <= set(seen), seen


def test_a_forged_round_with_the_attackers_store_is_never_joined(pair):
    job = pair.job
    before = pair.running(job)
    rnd = before["n1"][1]
    trap = Trap()
    try:
        forged = rnd + 9
        for i, node in enumerate(("n1", "n2")):
            pair.attacker.put(f"/v1/joins/{job}/round/{forged}/{node}", json.dumps(
                dict(_member(node, trap.port), prev_rank=i, time=time.time())))
        pair.attacker.put(f"/v1/rounds/{job}/state", json.dumps({
            "round": forged, "status": "closed", "restarts": 0, "restart_times": [],
            "members": [_member("n1", trap.port), _member("n2", trap.port)],
            "expected": [], "reason": "forged", "opened_at": time.time(),
            "closed_at": time.time(), "cause": "fault", "rejoining": []}))
        steady(pair, job, before, 4.0)
        assert trap.connections == 0, "a rank connected to the attacker's store"
    finally:
        trap.close()
    # The joins reach the closed round's first member (n1) alone: n2 watches their deletes.
    for node, joins in (("n1", 2), ("n2", 0)):
        wait_metric(pair, node, lambda r: r.get(("state", "unsigned"), 0) >= 1
                    and r.get(("join", "unsigned"), 0) >= joins, f"{node} counts the forgeries")
    for node in ("n1", "n2"):
        log = pair[node].log()
        assert "refused" in log and f"/v1/rounds/{job}/state" in log, log[-3000:]


def test_genuine_records_under_another_key_or_an_old_round_are_refused(pair):
    job, a, rnd, join_n1 = pair.job, pair.attacker, pair.round, pair.genuine_join
    before = pair.running(job)
    # The genuine join of n1, put where it would say n1 joined the next round and
    # under n2's name (another job's rounds reach only that job's nodes: none here);
    # the job's round state as the job list's copy of it, and as another job's.
    for key in (f"/v1/joins/{job}/round/{rnd + 1}/n1", f"/v1/joins/other/round/{rnd}/n1",
                f"/v1/joins/{job}/round/{rnd}/n2-ghost"):
        a.put(key, join_n1)
    a.put(f"/v1/jobs/{job}/state", pair.genuine_state)
    a.put("/v1/jobs/other/state", pair.genuine_state)
    steady(pair, job, before, 2.0)
    for node, joins in (("n1", 2), ("n2", 0)):    # the joins reach n1, the first member
        wait_metric(pair, node, lambda r: r.get(("join", "bad_mac"), 0) >= joins
                    and r.get(("state", "bad_mac"), 0) >= 2, f"{node} refuses the moved records")
    st = ctl_json(pair["n2"], "status", job)
    assert st["state"] == "RUNNING", st


def test_an_old_round_replayed_as_is_changes_nothing(pair):
    """The attacker kept the closed round the job first ran, waits for the next round
    (a rank killed), then puts the old one back: the daemons hold a newer round."""
    job = pair.job
    first = pair.running(job)
    pid = first["n2"][3][0]
    os.kill(pid, signal.SIGKILL)     # a fault: a new round, counted
    after = wait_for(lambda: (r := pair.running(job)) and all(
        v[0] == "RUNNING" and v[1] > first["n1"][1] for v in r.values()) and r, 120,
        what="the job running its next round")
    pair.attacker.put(f"/v1/rounds/{job}/state", pair.genuine_state)
    steady(pair, job, after, 4.0)
    for node in ("n1", "n2"):
        wait_metric(pair, node, lambda r: r.get(("state", "replayed"), 0) >= 1,
                    f"{node} refuses the replayed round")


def test_forged_node_records_drain_marks_events_and_phases_are_ignored(pair):
    job = pair.job
    a = pair.attacker
    before = pair.running(job)
    a.put("/v1/nodes/evil", json.dumps({
        "node_id": "evil", "host": "evil", "address": "10.6.6.6", "slots": 64,
        "slots_free": 64, "version": "0", "started_at": time.time(), "pid": 1,
        "lease_ttl": 3, "jobs": []}))
    a.put("/v1/drain/n1", json.dumps({"state": "draining", "by": "root", "at": time.time()}))
    a.put(f"/v1/events/{job}/n2/999999999999", json.dumps({
        "job_id": job, "kind": "transition", "from_state": "RUNNING", "to_state": "FAILED",
        "reason": "forged-event", "node_id": "n2", "round": 1, "rank": -1, "restart": 0,
        "time": time.time()}))
    # n1, the round's first member, reads the records; n2 reads n1's digest of them.
    a.put(f"/v1/phases/{job}/n2", json.dumps({
        "v": 1, "node": "n2", "round": before["n2"][1],
        "ranks": [[1, "checkpoint", 0.0, 1, None]], "learned": []}))
    a.put(f"/v1/phasedigests/{job}/n1", json.dumps({
        "v": 1, "node": "n1", "round": before["n1"][1], "members": 2, "stale": [],
        "stale_count": 0, "waiting": [["checkpoint", 1, ["n1"]]], "learned": [],
        "straggler": None}))
    time.sleep(2.0)   # each watch has seen them by now
    for node in ("n1", "n2"):
        nodes = {n["node_id"]: n["state"] for n in ctl_json(pair[node], "nodes")["nodes"]}
        assert nodes == {"n1": "ready", "n2": "ready"}, nodes
        evs = pair[node].ctl("-o", "json", "events", job).stdout
        assert "forged-event" not in evs
    steady(pair, job, before, 1.0)
    for node in ("n1", "n2"):
        wait_metric(pair, node, lambda r: all(r.get((k, "unsigned"), 0) >= 1 for k in (
            "node", "drain", "event", "phases")), f"{node} refuses each forgery")
