"""Job events cluster-wide: `elasticctl events` on one node shows every node's.

The pure parts (key layout, parsing what is found in etcd, the registry's
dedup of imported events) are tested on their own; ``EventLog`` on a
``MemoryStore`` with two registries in this process (publish, mirror,
restart, trimming, an etcd outage); then real daemons on one real etcd,
driven with the real ``elasticctl`` as a user would: a 2-node job whose
rank on n2 fails once, seen from n1 (also while following), a daemon
restart that must not duplicate anything, garbage under the events prefix,
and who may see the events of a job their node never ran.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elasticd import config
from elasticd.cluster.eventlog import EVENTS, EventLog, event_key, parse_event, parse_key, shared
from elasticd.jobs.jobevent import JobEvent
from elasticd.jobs.registry import JobRecord, JobRegistry
from elasticd.jobs.states import JobState
from elasticd.store import MemoryStore, StoreUnavailable, open_store
from elasticd.trust import clusterkey
from elasticd.trust.sealed import PLAIN, Kind, Refused, SealedRecords
from etcd_cluster import (NO_SPARES_NOBODY_MAY_CALL as NO_SPARES, cluster_daemon, fresh_prefix,
                          wait_for)
from etcd_server import EtcdServer, etcd_binary
from daemons import cluster_key_path
from elasticd.v1 import control_pb2 as pb

PY = sys.executable
NOBODY = (65534, 65534, [65534])

# Rank on n2 exits 3 at its first start; everyone else holds until the restart,
# then all exit 0.
FAIL_ON_N2_ONCE = [PY, "-c", (
    "import os, sys, time\n"
    "first = os.environ['TORCHELASTIC_RESTART_COUNT'] == '0'\n"
    "if first and os.environ['ELASTICD_NODE_ID'] == 'n2':\n"
    "    time.sleep(0.5); sys.exit(3)\n"
    "time.sleep(30 if first else 0.3)\n")]


# ---------------------------------------------------------------- pure parts

def good_event(**changes) -> dict:
    ev = {"job_id": "j1", "time": 1700000000.5, "kind": "state", "from_state": "RUNNING",
          "to_state": "RESTARTING", "reason": "rank 1 exited with 3", "node_id": "n2",
          "round": 1, "rank": -1, "restart": 1}
    ev.update(changes)
    return ev


def test_event_keys_are_versioned_one_per_event_and_sort_by_seq():
    assert event_key("j1", "n2", 42) == "/v1/events/j1/n2/000000000042"
    assert parse_key(event_key("j1", "n2", 42)) == ("j1", "n2", 42)
    keys = [event_key("j", "n", s) for s in (9, 10, 100, 2)]
    assert [parse_key(k)[2] for k in sorted(keys)] == [2, 9, 10, 100]


@pytest.mark.parametrize("key", ["/v1/events/j1/n2", "/v1/events/j1/n2/x", "/v1/events/j1/n2/1/2",
                                 "/v1/jobs/j1/n2/1", "/v1/events//n2/1", "/v1/events/j1/n2/-1"])
def test_keys_that_are_not_event_keys_are_refused(key):
    with pytest.raises(ValueError):
        parse_key(key)


def test_an_event_read_back_carries_its_origin_seq():
    ev = parse_event(event_key("j1", "n2", 7), json.dumps(good_event(
        layer="process", duration_seconds=1.5)), PLAIN)
    assert ev.to_dict() == {**good_event(layer="process", duration_seconds=1.5),
                            "origin_seq": 7}
    assert not shared(ev, "n2"), "an imported event is never published again"
    local = JobEvent.from_dict(good_event(seq=3))
    assert shared(local, "n2") and not shared(local, "n1")


@pytest.mark.parametrize("value", [
    "{not json", "[1, 2]", "null", json.dumps(good_event(node_id="n3")),
    json.dumps(good_event(job_id="other")), json.dumps(good_event(to_state="EXPLODED")),
    json.dumps(good_event(round="1")), json.dumps(good_event(rank=True)),
    json.dumps(good_event(time="noon")), json.dumps(good_event(reason=None)),
    json.dumps({k: v for k, v in good_event().items() if k != "kind"}),
    json.dumps(good_event(layer=5)),
])
def test_garbage_event_values_are_refused(value):
    with pytest.raises(Refused):
        parse_event(event_key("j1", "n2", 7), value, PLAIN)


@pytest.fixture
def registry(tmp_path):
    reg = JobRegistry(str(tmp_path / "state"), "n1")
    yield reg
    reg.close()


def test_importing_the_same_events_again_adds_nothing_even_after_a_restart(registry, tmp_path):
    heard = []
    registry.listeners.append(heard.append)
    evs = [parse_event(event_key("j1", "n2", s), json.dumps(good_event()), PLAIN)
           for s in (3, 4)]
    woke = threading.Event()

    def wait():
        if registry.wait_for_change(lambda: registry.last_seq >= 2, 5):
            woke.set()
    t = threading.Thread(target=wait)
    t.start()
    assert registry.import_events(evs) == 2
    t.join()
    assert woke.is_set(), "an import must wake Events -f"
    assert registry.import_events(evs) == 0
    # the same seq from another node is another event
    assert registry.import_events([dataclasses.replace(evs[0], node_id="n3")]) == 1
    assert heard == [], "listeners (metrics) count this node's own events only"
    registry.close()
    again = JobRegistry(str(tmp_path / "state"), "n1")
    try:
        assert again.import_events(evs) == 0
        got = again.events(job_id="j1")
        assert [(e.node_id, e.origin_seq) for e in got] == [("n2", 3), ("n2", 4), ("n3", 3)]
        assert [e.seq for e in got] == sorted(e.seq for e in got)
    finally:
        again.close()


# ---------------------------------------------------------------- EventLog, in-process

class FlakyStore(MemoryStore):
    """A MemoryStore whose writes fail while ``down`` is set."""

    def __init__(self):
        super().__init__()
        self.down = False
        self.refused: list[str] = []  # the keys of the writes that failed

    def put(self, key, value, lease=None):
        if self.down:
            self.refused.append(key)
            raise StoreUnavailable("etcd is down (test)")
        return super().put(key, value, lease)


RECORDS = SealedRecords(b"k" * 32, "/elasticd")   # one cluster key for the nodes here


def node(root, node_id: str, store, keep: int = 1000):
    """(cfg, registry, EventLog) of one in-process node on ``store``."""
    state = os.path.join(root, node_id)
    cfg = config.load(env={}, overrides={
        "daemon.node_id": node_id, "daemon.state_dir": state, "daemon.socket": "/tmp/x.sock",
        "events.retry": 0.05, "events.keep_per_job": keep, "membership.watch_retry": 0.05})
    reg = JobRegistry(state, node_id)
    return cfg, reg, EventLog(cfg, store, reg, records=RECORDS)


def job(reg: JobRegistry, job_id: str = "j1") -> None:
    reg.create(JobRecord(id=job_id, command=["true"], cwd="/", uid=0, gid=0))
    reg.transition(job_id, JobState.RENDEZVOUS, "waiting for nodes")
    reg.transition(job_id, JobState.RUNNING, "round 1")


def moves(reg: JobRegistry, node_id: str) -> list[tuple]:
    return [(e.node_id, e.to_state) for e in reg.events(job_id="j1")
            if e.node_id == node_id]


def test_events_of_one_node_reach_the_other_and_a_restart_repeats_none(tmp_path):
    store = MemoryStore()
    (ca, ra, la), (cb, rb, lb) = node(tmp_path, "a", store), node(tmp_path, "b", store)
    la.start(), lb.start()
    lb.follow()          # every job's events, as while `elasticctl events -f` runs on b
    try:
        job(ra)
        want = [("a", "PENDING"), ("a", "RENDEZVOUS"), ("a", "RUNNING")]
        wait_for(lambda: moves(rb, "a") == want, 5, what="b to mirror a's events")
        keys = [kv.key for kv in store.list(EVENTS)[0]]
        assert keys == [event_key("j1", "a", s) for s in (1, 2, 3)]
        assert moves(ra, "b") == [], "b has no events of its own to share"
    finally:
        la.stop(), lb.stop()
    # A transition while both are down; both restart: a publishes only what is
    # new, b imports only what is new.
    ra.transition("j1", JobState.SUCCEEDED, "done")
    la, lb = EventLog(ca, store, ra, records=RECORDS), EventLog(cb, store, rb, records=RECORDS)
    la.start(), lb.start()
    lb.follow("j1"), lb.follow("j2")     # b runs both jobs now, say
    try:
        wait_for(lambda: moves(rb, "a")[-1:] == [("a", "SUCCEEDED")], 5, what="the new event")
        # A sentinel after it (another job's events): once b has it, a published and b
        # imported everything they were going to, repeats included.
        job(ra, "j2")
        wait_for(lambda: [e.to_state for e in rb.events(job_id="j2")][-1:] == ["RUNNING"],
                 5, what="the sentinel")
        assert moves(rb, "a") == want + [("a", "SUCCEEDED")]
        assert [kv.key for kv in store.list(EVENTS)[0] if parse_key(kv.key)[0] == "j1"] == \
            [event_key("j1", "a", s) for s in (1, 2, 3, 4)]
    finally:
        la.stop(), lb.stop(), ra.close(), rb.close()


def test_a_node_mirrors_the_events_of_the_jobs_it_follows_and_reads_others_when_asked(
        tmp_path):
    """b follows j1 (as while it runs it): j1's events reach it, j2's do not until it
    reads them (as `elasticctl events j2` there does); once it unfollows j1, j1's new
    events wait in etcd for the next read."""
    store = MemoryStore()
    (_, ra, la), (_, rb, lb) = node(tmp_path, "a", store), node(tmp_path, "b", store)
    la.start(), lb.start()
    lb.follow("j1")
    try:
        job(ra, "j1")
        job(ra, "j2")
        wait_for(lambda: len(moves(rb, "a")) == 3, 5, what="j1's events on b")
        wait_for(lambda: la.published == ra.last_seq, 5, what="a's events published")
        time.sleep(0.3)      # a mirror of every job would have j2's by now
        assert rb.events(job_id="j2") == [], "b follows j1 only"
        lb.read("j2")
        assert [e.to_state for e in rb.events(job_id="j2")] == \
            ["PENDING", "RENDEZVOUS", "RUNNING"]
        lb.unfollow("j1")
        assert lb.following() == []
        ra.transition("j1", JobState.SUCCEEDED, "done")
        wait_for(lambda: la.published == ra.last_seq, 5, what="a's last event published")
        time.sleep(0.3)
        assert moves(rb, "a")[-1] == ("a", "RUNNING"), "b no longer follows j1"
        lb.read("j1")
        assert moves(rb, "a")[-1] == ("a", "SUCCEEDED")
        assert len(moves(rb, "a")) == 4, "a read imports each event once"
    finally:
        la.stop(), lb.stop(), ra.close(), rb.close()


def test_events_made_while_etcd_is_down_are_shared_once_it_is_back(tmp_path):
    store = FlakyStore()
    (_, ra, la), (_, rb, lb) = node(tmp_path, "a", store), node(tmp_path, "b", store)
    la.start(), lb.start()
    lb.follow("j1")
    try:
        store.down = True
        t0 = time.monotonic()
        job(ra)
        assert time.monotonic() - t0 < 0.5, "a transition must never wait for etcd"
        wait_for(lambda: event_key("j1", "a", 1) in store.refused, 5,
                 what="a's first try to share its event")
        assert moves(rb, "a") == []
        store.down = False
        wait_for(lambda: len(moves(rb, "a")) == 3, 5, what="the events kept during the outage")
    finally:
        la.stop(), lb.stop(), ra.close(), rb.close()


def test_each_node_keeps_a_bounded_number_of_events_per_job_in_etcd(tmp_path):
    store = MemoryStore()
    _, ra, la = node(tmp_path, "a", store, keep=10)
    la.start()
    try:
        job(ra)
        for i in range(40):
            ra.event("j1", "info", f"note {i}")
        wait_for(lambda: la.published == ra.last_seq, 5, what="every event published")
        keys = [kv.key for kv in store.list(f"{EVENTS}/j1/a")[0]]
        assert 10 <= len(keys) <= 11, keys
        assert keys[-1] == event_key("j1", "a", ra.last_seq), "the newest are the ones kept"
        assert len(ra.events(job_id="j1")) == 43, "the local log keeps everything"
    finally:
        la.stop(), ra.close()


# ---------------------------------------------------------------- real daemons, real etcd

pytestmark_etcd = pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary")


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture
def pair(daemon_factory, etcd):
    """n1 and n2 on one etcd under a prefix of their own."""
    prefix = fresh_prefix()
    nodes = [cluster_daemon(daemon_factory, etcd.url, n, prefix, *NO_SPARES)
             for n in ("n1", "n2")]
    for d in nodes:
        d.start()
    return nodes[0], nodes[1], prefix


def ctl_events(d, *args: str, user=None) -> list[dict]:
    res = d.ctl("-o", "json", "events", *args, user=user)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


def summary(evs: list[dict]) -> list[tuple]:
    return [(e.get("node_id"), e["kind"], e.get("to_state") or "", e.get("rank", -1))
            for e in evs]


class Following:
    """`elasticctl events -f` running in the background; its lines as they come."""

    def __init__(self, d, *args: str):
        self.proc = subprocess.Popen(
            [PY, "-m", "elasticctl", "--socket", d.socket, "events", "-f", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.stderr.read()


@pytestmark_etcd
def test_events_on_n1_show_n2s_failure_and_every_nodes_transitions_live(pair):
    n1, n2, _ = pair
    follow = Following(n1)   # started before the job exists
    try:
        res = n1.ctl("submit", "--nnodes", "2", "--max-restarts", "2", "--", *FAIL_ON_N2_ONCE)
        assert res.returncode == 0, res.stderr
        job = res.stdout.strip()
        final = n1.wait_job(job, 90)
        assert final.restarts == 1, final
        # While following on n1, n2's worker exit came through, naming its node.
        line = wait_for(lambda: [ln for ln in follow.lines if job in ln and "worker_exit" in ln
                                 and "node n2" in ln], 15, what="n2's worker_exit in events -f")
        assert "rank 1" in line[0], line
    finally:
        err = follow.stop()
    assert "Traceback" not in err, err
    # `elasticctl events JOB` on n1: both nodes' transitions, each with its node.
    evs = wait_for(lambda: (e := ctl_events(n1, job)) and
                   ("n2", "state", "SUCCEEDED", -1) in summary(e) and e, 15,
                   what="n2's SUCCEEDED on n1")
    got = summary(evs)
    assert ("n2", "worker_exit", "", 1) in got, got
    for n in ("n1", "n2"):
        states = [s for node, kind, s, _ in got if node == n and kind == "state"]
        assert "RESTARTING" in states and "RUNNING" in states and states[-1] == "SUCCEEDED", \
            (n, states)
        assert states.index("RESTARTING") < len(states) - 1 - states[::-1].index("RUNNING")
    exit_line = next(e for e in evs if e["kind"] == "worker_exit" and e["node_id"] == "n2")
    assert "3" in exit_line["reason"], exit_line
    # ... and n2 sees n1's.
    wait_for(lambda: ("n1", "state", "SUCCEEDED", -1) in summary(ctl_events(n2, job)), 15,
             what="n1's SUCCEEDED on n2")
    # The table form names the node on each line.
    table = n1.ctl("events", job).stdout
    assert any("worker_exit rank 1" in ln and "node n2" in ln for ln in table.splitlines()), table


@pytestmark_etcd
def test_a_daemon_restart_duplicates_no_mirrored_event(pair):
    n1, n2, _ = pair
    job = n1.ctl("submit", "--nnodes", "2", "--max-restarts", "2", "--",
                 *FAIL_ON_N2_ONCE).stdout.strip()
    n1.wait_job(job, 90)
    before = wait_for(lambda: (e := ctl_events(n1, job)) and
                      ("n2", "state", "SUCCEEDED", -1) in summary(e) and e, 15,
                      what="n2's events on n1")
    other = ctl_events(n2, job)
    n1.stop()
    n2.stop()
    n2.start()
    n1.start()
    # Witness that both listed the events prefix again: a job each submits now shows up
    # in the other's events (from that listing or from the watch that follows it).
    fresh = [(d.ctl("submit", "--nnodes", "1", "--", "/bin/true").stdout.strip(), d, peer)
             for d, peer in ((n1, n2), (n2, n1))]
    for new, d, peer in fresh:
        wait_for(lambda: (d.node_id, "state", "SUCCEEDED", -1) in summary(
            ctl_events(peer, new)), 15, what=f"{d.node_id}'s new job on {peer.node_id}")
    after = ctl_events(n1, job)
    assert summary(after) == summary(before)
    assert [e["seq"] for e in after] == [e["seq"] for e in before]
    assert summary(ctl_events(n2, job)) == summary(other)


GARBAGE = {  # sealed with the cluster key where marked (the test holds it), the rest not
    "/v1/events/zz/n9/000000000001": "{not json",
    "/v1/events/zz/n9/000000000002": ("sealed", json.dumps(good_event(
        job_id="zz", node_id="n9", to_state="EXPLODED"))),
    "/v1/events/zz/n9/000000000003": ("sealed", json.dumps(good_event(job_id="zz",
                                                                      node_id="n8"))),
    "/v1/events/zz/n9/000000000006": json.dumps(good_event(job_id="zz", node_id="n9",
                                                          reason="forged")),
    "/v1/events/zz/n9/x": json.dumps(good_event(job_id="zz", node_id="n9")),
    "/v1/events/zz": "[]",
    "/v1/events/zz/n9/000000000004/deeper": "{}",
}


@pytestmark_etcd
def test_garbage_under_the_events_prefix_does_not_break_the_stream(pair, etcd):
    n1, n2, prefix = pair
    follow = Following(n1)
    store = open_store("etcd3", etcd.endpoints, prefix=prefix)
    records = SealedRecords(clusterkey.load(cluster_key_path()).records, prefix)
    try:
        for key, value in GARBAGE.items():
            store.put(key, records.seal(Kind.EVENT, key, value[1])
                      if isinstance(value, tuple) else value)
        # One well-formed event, sealed, from a node that does not exist: shown, with its node.
        key = "/v1/events/zz/n9/000000000005"
        store.put(key, records.seal(Kind.EVENT, key, json.dumps(good_event(
            job_id="zz", node_id="n9", reason="from n9"))))
        job = n2.ctl("submit", "--nodes", "n2", "--", PY, "-c", "pass").stdout.strip()
        n2.wait_job(job, 60)
        wait_for(lambda: any(job in ln and "node n2" in ln and "SUCCEEDED" in ln
                             for ln in follow.lines), 15, what="n2's job in n1's events -f")
        assert any("from n9" in ln and "node n9" in ln for ln in follow.lines), follow.lines
        assert not any("forged" in ln for ln in follow.lines), follow.lines
        assert follow.proc.poll() is None, "the stream must go on"
    finally:
        err = follow.stop()
        store.close()
    assert "EXPLODED" not in err and "Traceback" not in err, err
    log = n1.log()
    assert "refused the event record at '/v1/events/zz/n9/000000000002'" in log, log
    assert "000000000006' in etcd (unsigned)" in log, log
    assert n1.ctl("events").returncode == 0


@pytestmark_etcd
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_events_of_a_job_this_node_never_ran_go_to_root_and_its_owner_only(pair):
    n1, n2, _ = pair
    work = os.path.join(n2.root, "nobody-work")
    os.mkdir(work)
    os.chown(work, 65534, 65534)
    res = n2.ctl("submit", "--nodes", "n2", "--", "/bin/true", user=NOBODY, cwd=work)
    assert res.returncode == 0, res.stderr
    theirs = res.stdout.strip()
    mine = n2.ctl("submit", "--nodes", "n2", "--", "/bin/true").stdout.strip()
    for job in (theirs, mine):
        assert n2.wait_job(job, 60).state == pb.SUCCEEDED, n2.job(job)
    wait_for(lambda: {e["job_id"] for e in ctl_events(n1) if e["to_state"] == "SUCCEEDED"}
             >= {theirs, mine}, 15, what="root on n1 seeing both jobs end on n2")
    as_nobody = {e["job_id"] for e in ctl_events(n1, user=NOBODY)}
    assert theirs in as_nobody and mine not in as_nobody, as_nobody
