"""Cluster membership on a real etcd with real daemons: nodes, drain and
uncordon, node loss, clean leave, and garbage under the key prefix.

One etcd serves the module; every test has its own key prefix, so the
daemons of one test never see another's. Daemons are real processes on
real sockets; elasticctl is the real command line.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from elasticctl import cli
from elasticd.cluster.membership import parse_node
from elasticd.store import open_store
from elasticd.trust.sealed import PLAIN
from etcd_cluster import (DEFAULT_TTL, cluster_daemon, ctl_json, fresh_prefix, states,
                          submit_on, wait_for)
from etcd_server import EtcdServer, etcd_binary
from elasticd.v1 import control_pb2 as pb

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary")

NOBODY = (65534, 65534, [65534])


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return fresh_prefix()


@pytest.fixture
def pair(daemon_factory, etcd, prefix):
    """Two started daemons, n-a and n-b, that each see both nodes ready."""
    a = cluster_daemon(daemon_factory, etcd.url, "n-a", prefix).start()
    b = cluster_daemon(daemon_factory, etcd.url, "n-b", prefix).start()
    for d in (a, b):
        wait_for(lambda d=d: states(d) == {"n-a": "ready", "n-b": "ready"}, 5,
                 what=f"{d.node_id} seeing both nodes ready")
    return a, b


def by_id(doc: dict) -> dict[str, dict]:
    return {n["node_id"]: n for n in doc["nodes"]}


# ---------------------------------------------------------------- nodes

def test_two_daemons_list_each_other_ready_with_slots(pair):
    for d in pair:
        doc = ctl_json(d, "nodes")
        nodes = by_id(doc)
        assert set(nodes) == {"n-a", "n-b"}, doc
        for node in nodes.values():
            assert node["state"] == "ready"
            assert node["slots"] == 4 and node["slots_free"] == 4
            assert node["address"] and node["version"] and node["started_at"] > 0
        assert doc["store"] == "etcd3" and doc["store_health"] == "ok"


def test_node_id_held_by_a_live_daemon_is_refused(pair, daemon_factory, etcd, prefix):
    a, _ = pair
    before = by_id(ctl_json(a, "nodes"))["n-a"]
    twin = cluster_daemon(daemon_factory, etcd.url, "n-a", prefix)
    with pytest.raises(RuntimeError, match="exited 1"):
        twin.start(timeout=15)
    assert twin.proc.returncode == 1
    assert "node id 'n-a' is held by a live daemon" in twin.log(), twin.log()
    # Refused at once: from its first line to the refusal, well within a lease TTL (no
    # wait for the holder's lease). Its interpreter's start is not counted: it took
    # over 5 s once on a loaded machine (ci53).
    stamps = [time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) +
              int(line[20:23]) / 1000 for line in twin.log().splitlines()
              if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", line)]
    assert stamps and stamps[-1] - stamps[0] < DEFAULT_TTL, twin.log()
    # The live holder is untouched: same record, still ready on both nodes.
    assert a.proc.poll() is None
    assert states(a) == {"n-a": "ready", "n-b": "ready"}
    after = by_id(ctl_json(a, "nodes"))["n-a"]
    assert (after["started_at"], after["host"]) == (before["started_at"], before["host"])


# ---------------------------------------------------------------- drain / uncordon

def test_drain_then_uncordon_change_what_nodes_shows(pair):
    a, b = pair
    r = a.ctl("drain", "n-b")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "n-b draining"
    for d in pair:  # every daemon reads the drain mark from etcd
        assert by_id(ctl_json(d, "nodes"))["n-b"]["state"] == "draining"
        assert by_id(ctl_json(d, "nodes"))["n-a"]["state"] == "ready"
    table = b.ctl("nodes")
    assert table.returncode == 0
    assert any(line.split()[:2] == ["n-b", "draining"] for line in table.stdout.splitlines())

    doc = ctl_json(b, "uncordon", "n-b")
    assert doc["node_id"] == "n-b" and doc["state"] == "ready"
    for d in pair:
        assert {n: v["state"] for n, v in by_id(ctl_json(d, "nodes")).items()} == \
            {"n-a": "ready", "n-b": "ready"}

    # A daemon may drain itself, too.
    assert ctl_json(a, "drain", "n-a")["state"] == "draining"
    assert by_id(ctl_json(b, "nodes"))["n-a"]["state"] == "draining"
    assert a.ctl("uncordon", "n-a").returncode == 0


def test_drain_of_an_unknown_node_is_not_found(pair):
    a, _ = pair
    r = a.ctl("drain", "no-such-node")
    assert r.returncode == 1
    assert "NOT_FOUND" in r.stderr and "no-such-node" in r.stderr, r.stderr
    assert r.stdout == ""
    r = a.ctl("uncordon", "no-such-node")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run elasticctl as nobody")
def test_drain_is_root_only(daemon_factory, etcd, prefix):
    a = cluster_daemon(daemon_factory, etcd.url, "n-a", prefix,
                       "--set", "daemon.socket_group=65534").start()
    r = a.ctl("drain", "n-a", user=NOBODY)
    assert r.returncode == 1
    assert "PERMISSION_DENIED" in r.stderr and "root" in r.stderr, r.stderr
    assert states(a) == {"n-a": "ready"}


def test_drain_without_a_daemon_is_exit_3(tmp_short, capsys):
    code = cli.main(["--socket", os.path.join(tmp_short, "none.sock"), "drain", "n1"])
    assert code == 3
    assert "cannot reach elasticd" in capsys.readouterr().err


# ---------------------------------------------------------------- node loss

def test_kill9_node_is_lost_within_ttl_and_stays_listed(pair):
    a, b = pair
    t0 = time.monotonic()
    b.kill()
    wait_for(lambda: states(a).get("n-b") == "lost", DEFAULT_TTL + 1, step=0.02,
             what="n-a listing n-b lost")
    detected = time.monotonic() - t0
    print(f"\nkill -9 of n-b -> n-a lists it lost after {detected:.2f} s "
          f"(TTL {DEFAULT_TTL:g} s)")
    assert detected <= DEFAULT_TTL + 1

    # And it stays listed as lost (lost_node_retention is an hour), witnessed after n-a's
    # view took a later record: its own, naming a job submitted now.
    job = submit_on(a, "/bin/sleep", "30")
    wait_for(lambda: job in by_id(ctl_json(a, "nodes"))["n-a"]["jobs"], 10,
             what="n-a's record naming its new job in n-a's view")
    doc = ctl_json(a, "nodes")
    nodes = by_id(doc)
    assert nodes["n-b"]["state"] == "lost", doc
    assert nodes["n-b"]["lost_at"] > 0 and nodes["n-b"]["slots"] == 4
    assert nodes["n-a"]["state"] == "ready"


def test_clean_stop_revokes_the_key_at_once(pair, etcd, prefix):
    a, b = pair
    store = open_store("etcd3", etcd.endpoints, prefix=prefix)
    try:
        assert store.get("/v1/nodes/n-b") is not None
        t0 = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: store.get("/v1/nodes/n-b") is None, 2.0, step=0.02,
                 what="n-b's key gone from etcd")
        gone = time.monotonic() - t0
        wait_for(lambda: states(a).get("n-b") == "lost", 2.0, step=0.02,
                 what="n-a listing n-b lost")
        seen = time.monotonic() - t0
        print(f"\nSIGTERM of n-b -> key gone after {gone:.2f} s, n-a lists it lost after "
              f"{seen:.2f} s")
        assert b.proc.wait(10) == 0
        assert gone < 1.5 and seen < 1.5  # at once, not after the 3 s TTL
    finally:
        store.close()


# ---------------------------------------------------------------- garbage

GARBAGE_BEFORE = {  # written before the daemons start: met by their first list
    "/v1/nodes/bogus": "{not json",
    "/v1/nodes/typed": json.dumps({"node_id": "typed", "slots": "four"}),
    "/v1/nodes/listy": "[1, 2, 3]",
    "/v1/nodes/liar": json.dumps({"node_id": "someone-else", "slots": 1}),
    "/v2/x": json.dumps({"layout": "from the future"}),
    "/v1/jobs/zz/state": "not json",
    "/v1/jobs/zz/spec": json.dumps({"id": 5, "nproc_per_node": "many"}),
    "/v1/drain/n-a": "not json either",
    # At a node's own key, with no lease: not a live daemon's, so n-b takes it over.
    "/v1/nodes/n-b": json.dumps({"node_id": "n-b", "jobs": 7}),
}
GARBAGE_AFTER = {  # written while they run: met by their watches, or read when asked
    "/v1/nodes/bogus2": "\u0000\ufffd binary-ish",
    "/v1/nodes/typed2": json.dumps({"node_id": "typed2", "slots": 2, "jobs": 7}),
    "/v1/nodes/typed3": json.dumps({"node_id": "typed3", "slots": 10 ** 12,
                                    "started_at": "yesterday"}),
    "/v1/nodes/a/b/c": "{}",
    "/v2/nodes/n-a": json.dumps({"node_id": "n-a", "v2": True}),
    "/v1/jobs/zz/state": "still not json",
    "/v1/jobs/zz/join/x/n-a": "{}",
    "/v1/jobs/yy/workers/n-a": json.dumps({"rows": "not a list"}),
    "/v1/unknown-kind/q": "?",
}


@pytest.mark.parametrize("record", [
    {"node_id": "n1", "jobs": 7}, {"node_id": "n1", "jobs": [1]}, {"node_id": "n1", "slots": "4"},
    {"node_id": "n1", "slots": 2**40}, {"node_id": "n1", "slots_free": -1},
    {"node_id": "n1", "slots": True}, {"node_id": "n1", "started_at": "yesterday"},
    {"node_id": "n1", "host": ["h"]}, {"node_id": "n2"}, {"node_id": 1}, [], "n1", None])
def test_parse_node_refuses_what_a_reader_would_trip_on(record):
    assert parse_node("/v1/nodes/n1", json.dumps(record), PLAIN) is None


def test_parse_node_takes_a_full_record_and_unknown_fields():
    record = {"node_id": "n1", "host": "h", "address": "10.0.0.1", "slots": 8, "slots_free": 2,
              "version": "0.1.0", "started_at": 1.5, "pid": 42, "jobs": ["j1"], "new": {}}
    assert parse_node("/v1/nodes/n1", json.dumps(record), PLAIN) == record


def test_garbage_under_the_prefix_is_skipped(daemon_factory, etcd, prefix):
    store = open_store("etcd3", etcd.endpoints, prefix=prefix)
    try:
        for key, value in GARBAGE_BEFORE.items():
            store.put(key, value)
        a = cluster_daemon(daemon_factory, etcd.url, "n-a", prefix).start()
        b = cluster_daemon(daemon_factory, etcd.url, "n-b", prefix).start()
        for key, value in GARBAGE_AFTER.items():
            store.put(key, value)
        # Node records are read when asked (no daemon watches their puts): `nodes` lists
        # them all, garbage included, and the refusal of each bad one is logged.
        last = re.compile(r"refused the node record at '[^']*/v1/nodes/a/b/c'")
        for d in (a, b):
            assert d.proc.poll() is None, d.log()
            doc = ctl_json(d, "nodes")
            assert {n: v["state"] for n, v in by_id(doc).items()} == \
                {"n-a": "ready", "n-b": "ready"}, doc  # an unreadable drain mark is no mark
            wait_for(lambda d=d: last.search(d.log()), 10, what=f"{d.node_id} refusing a/b/c")
        job_id = submit_on(a, "/bin/true")
        job = a.wait_job(job_id, timeout=30)
        assert job.state == pb.SUCCEEDED, job
        assert "refused the node record" in a.log()  # logged, not silently swallowed
        for d in (a, b):
            assert d.proc.poll() is None, d.log()
            assert "Traceback" not in d.log(), d.log()
        # The garbage deleted lists no node lost: n-b's clean stop, after it (deletes
        # reach the watch in order), is the only loss n-a lists.
        for key in (*GARBAGE_BEFORE, *GARBAGE_AFTER):
            if key.startswith("/v1/nodes/") and key.rsplit("/", 1)[-1] not in ("n-a", "n-b"):
                store.delete(key)
        b.stop()
        wait_for(lambda: states(a).get("n-b") == "lost", 10, what="n-a listing n-b lost")
        assert states(a) == {"n-a": "ready", "n-b": "lost"}, ctl_json(a, "nodes")
        assert "Traceback" not in a.log(), a.log()
    finally:
        store.close()
