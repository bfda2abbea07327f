"""Phases across nodes (hangs/phase_board.py): the record, its checks, and the tracker's decisions
on its peers' records. Pure decisions on a fake clock (as test_hang_learning.py); the real
daemons on a real etcd are in test_hang_multinode.py.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.hangs.timeouts import PhaseRecord
from elasticd.hangs.phase_board import (
    MAX_RANKS, RECORD_MAX, JobPeers, NodePhases, PeerPhases, PhasePublisher, RankPhase,
    merge_learned)
from test_hang import FakeGroup, beat
from test_hang_learning import tracker


def record(node="n2", rnd=3, ranks=(), learned=()):
    return NodePhases(node, rnd, tuple(ranks), tuple(learned))


def peers(*records, complete=True):
    return JobPeers(tuple(PeerPhases(r, 0.5) for r in records), complete)


# ---------------------------------------------------------------- the record

def test_a_record_round_trips():
    rec = record(ranks=[RankPhase(2, "checkpoint", 3.5, 120, 0.05),
                        RankPhase(3, "section:data", 0.0, 0, None)],
                 learned=[PhaseRecord("train", 40, 0.2), PhaseRecord("checkpoint", 1, 21.0)])
    assert NodePhases.from_json(rec.to_json(), "n2") == rec


@pytest.mark.parametrize("text", [
    None, "", "[]", "{}", "nul", '{"v": 2}', "[" * 5000 + "]" * 5000,
    '{"v":1,"node":"n3","round":1,"ranks":[],"learned":[]}',            # another node's
    '{"v":1,"node":"n2","round":-1,"ranks":[],"learned":[]}',
    '{"v":1,"node":"n2","round":true,"ranks":[],"learned":[]}',
    '{"v":1,"node":"n2","round":1,"ranks":[[0,"bogus",1,1,null]],"learned":[]}',
    '{"v":1,"node":"n2","round":1,"ranks":[[0,"train",-1,1,null]],"learned":[]}',
    '{"v":1,"node":"n2","round":1,"ranks":[[0,"train",1e999,1,null]],"learned":[]}',
    '{"v":1,"node":"n2","round":1,"ranks":[[0,"train",1,1]],"learned":[]}',
    '{"v":1,"node":"n2","round":1,"ranks":[],"learned":[["train",1,1e9]]}',
    '{"v":1,"node":"n2","round":1,"ranks":[],"learned":[["section:a/b",1,1]]}',
    '{"v":1,"node":"n2","round":1,"ranks":[],"learned":{}}',
    '{"v":1,"node":"n2","round":1,"ranks":[],"learned":[]' + " " * RECORD_MAX + "}",
])
def test_a_malformed_or_huge_peer_record_is_refused(text):
    with pytest.raises((ValueError, RecursionError)):
        NodePhases.from_json(text, "n2")


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=6)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=6)))
def test_any_json_from_a_peer_is_refused_or_read_never_crashes(doc):
    for text in (json.dumps(doc), json.dumps({"v": 1, "node": "n2", "round": 1,
                                              "ranks": [doc], "learned": [doc]})):
        try:
            NodePhases.from_json(text, "n2")
        except ValueError:
            pass


def test_a_record_stays_under_its_size_cap():
    ranks = [RankPhase(r, "section:" + "x" * 32, 1e6, 1 << 40, 123.456789)
             for r in range(MAX_RANKS + 10)]
    learned = [PhaseRecord(f"section:{i:032d}", 1 << 40, 1e6) for i in range(64)]
    text = record(ranks=ranks, learned=learned).to_json()
    assert len(text) <= RECORD_MAX
    got = NodePhases.from_json(text, "n2")
    assert len(got.ranks) <= MAX_RANKS


def test_peers_are_complete_only_when_every_other_member_has_a_fresh_record_of_the_round():
    now = 100.0
    got = {"n2": (record("n2", 3), 99.0), "n3": (record("n3", 3), 90.0)}
    assert JobPeers.of(got, ["n1", "n2"], "n1", 3, 5.0, now).complete
    assert not JobPeers.of(got, ["n1", "n2", "n3"], "n1", 3, 5.0, now).complete   # stale
    assert not JobPeers.of(got, ["n1", "n2", "n4"], "n1", 3, 5.0, now).complete   # missing
    assert not JobPeers.of(got, ["n1", "n2"], "n1", 4, 5.0, now).complete         # old round
    assert [p.record.node_id for p in JobPeers.of(got, ["n1", "n2", "n3"], "n1", 3, 5.0,
                                                  now).records] == ["n2"]


def test_learned_phases_merge_as_the_max_of_gaps_and_longest():
    mine = {"train": PhaseRecord("train", 40, 0.2)}
    assert merge_learned(mine, [PhaseRecord("train", 3, 0.5), PhaseRecord("checkpoint", 1, 21)])
    assert mine == {"train": PhaseRecord("train", 40, 0.5),
                    "checkpoint": PhaseRecord("checkpoint", 1, 21)}
    assert not merge_learned(mine, [PhaseRecord("train", 1, 0.1)])
    full = {f"section:{i}": PhaseRecord(f"section:{i}", 1, 1) for i in range(3)}
    assert not merge_learned(full, [PhaseRecord("train", 1, 1)], limit=3)


# ---------------------------------------------------------------- the tracker

def steady(tr, ops, group, t0, t1, dt=0.1, ranks=(0,), peer=None):
    t = t0
    while t < t1 - 1e-9:
        t = round(t + dt, 6)
        for r in ranks:
            beat(ops, r, t)
        tr.check(group, peer() if peer else None)
    return t


def test_a_job_across_nodes_gets_learned_timeouts_once_its_peers_publish():
    tr, ops, reg = tracker()
    group = FakeGroup([100], world_size=2)
    ops.catching = {100}
    training = lambda: peers(record(ranks=[RankPhase(1, "train", 1.0, 10, None)]))  # noqa: E731
    tr.check(group, training())
    t = steady(tr, ops, group, 0.0, 2.0, peer=training)
    assert [p.learned for p in tr.learned()] == [True]
    ops.now = t + 5.0
    assert tr.check(group, training()) == ["rank 0: no progress for 5s; stacks dumped to its "
                                           "log (pid 100)"]
    # A peer's record gone stale: the fixed bounds again, no kill at the learned 10 s.
    ops.now = t + 10.0
    assert tr.check(group, peers(complete=False)) == []
    ops.now = t + 10.5
    assert tr.check(group, training()) == ["rank 0: no progress for 10s; killed (learned "
                                           "train: agent.hang_learn_floor 10s)"]
    assert ops.sent[-1] == ("killpg", 100, signal.SIGKILL)


def test_a_rank_waiting_for_a_checkpoint_on_another_node_is_not_killed():
    tr, ops, reg = tracker()
    group = FakeGroup([100], world_size=2)
    ops.catching = {100}
    training = lambda: peers(record(ranks=[RankPhase(1, "train", 1.0, 10, None)]))  # noqa: E731
    tr.check(group, training())
    t = steady(tr, ops, group, 0.0, 2.0, peer=training)
    saving = peers(record(ranks=[RankPhase(1, "checkpoint", 0.2, 10, None)]))
    ops.now = t + 1.0
    assert tr.check(group, saving) == []
    ops.now = t + 25.0   # rank 1 still saving: rank 0 waits in its all_reduce
    assert tr.check(group, saving) == []
    ops.now = t + 26.0   # rank 1 left the checkpoint; rank 0's collective not back yet
    assert tr.check(group, training()) == []
    # The wrapper's limits file widened the training limits for the wait.
    assert ops.limits["/run/j/hang-limits.json"]["phases"].get("train") is None
    beat(ops, 0, t + 26.5)
    tr.check(group, training())
    table = {p.phase: p for p in tr.learned()}
    assert table["train"].longest < 1   # the wait was not learned as a training gap
    assert ops.limits["/run/j/hang-limits.json"]["phases"]["train"] == [5.0, 10.0]
    ops.now = t + 36.6   # later, silent on its own: the learned limits again
    tr.check(group, training())
    ops.now = t + 37.0
    done = tr.check(group, training())
    assert done and "killed (learned train" in done[-1], done


def test_what_another_node_learned_is_merged_and_published():
    tr, ops, reg = tracker()
    group = FakeGroup([100], world_size=2)
    learned = [PhaseRecord("checkpoint", 1, 21.0), PhaseRecord("train", 50, 0.3)]
    tr.check(group, peers(record(ranks=[RankPhase(1, "train", 1.0, 10, None)],
                                 learned=learned)))
    table = {p.phase: p for p in tr.learned()}
    assert (table["checkpoint"].hard, table["train"].longest) == (105.0, 0.3)
    snap = tr.snapshot(3)
    assert snap.node_id == "n1" and snap.round == 3
    assert {p.phase: p.longest for p in snap.learned} == {"checkpoint": 21.0, "train": 0.3}
    assert [(r.rank, r.phase) for r in snap.ranks] == [(0, "train")]


def test_the_straggler_is_named_across_nodes_and_announced_by_its_own_node():
    tr, ops, reg = tracker()
    group = FakeGroup([100, 101], world_size=4)
    remote = peers(record(ranks=[RankPhase(2, "train", 1.0, 50, 0.30),
                                 RankPhase(3, "train", 1.0, 50, 0.10)]))
    tr.check(group, remote)
    t = 0.0
    for _ in range(20):
        t += 0.2
        beat(ops, 0, t, busy=0.1)
        beat(ops, 1, t, busy=0.1)
        tr.check(group, remote)
    s = tr.straggler()
    assert (s.rank, s.ranks, s.nodes, s.rank_node) == (2, 4, 2, "n2")
    assert round(s.ratio, 1) == 3.0
    rec = reg.records[-1]["straggler"]
    assert (rec["rank"], rec["nodes"], rec["rank_node"]) == (2, 2, "n2")
    # n2 records the event (shared with every node); n1 only names it in its status.
    assert [e for e in reg.events if e[0] == "straggler"] == []


def test_a_straggler_on_this_node_is_announced_with_the_nodes_compared():
    tr, ops, reg = tracker()
    group = FakeGroup([100], world_size=2)
    remote = peers(record(ranks=[RankPhase(1, "train", 1.0, 50, 0.10)]))
    t = 0.0
    for _ in range(20):
        t += 0.4
        beat(ops, 0, t, busy=0.3)
        tr.check(group, remote)
    s = tr.straggler()
    assert (s.rank, s.nodes, s.rank_node) == (0, 2, "n1")
    events = [e[2] for e in reg.events if e[0] == "straggler"]
    assert len(events) == 1 and events[0].startswith("rank 0 is a straggler: 3.0x") \
        and "2 ranks on 2 node(s); it runs on node n1" in events[0], events


# ---------------------------------------------------------------- the publisher

def test_the_publisher_writes_the_latest_record_at_once_on_a_phase_change_and_deletes_at_stop():
    writes, deleted, wrote = [], [], threading.Event()

    def put(text):
        writes.append(NodePhases.from_json(text, "n1"))
        wrote.set()

    pub = PhasePublisher("j1", "n1", 30.0, put, lambda: deleted.append(True))
    pub.start()
    try:
        pub.offer(record("n1", ranks=[RankPhase(0, "train", 1.0, 5, None)]))
        assert wrote.wait(10), "the first record is written at once"
        wrote.clear()
        pub.offer(record("n1", ranks=[RankPhase(0, "checkpoint", 0.0, 5, None)]))
        assert wrote.wait(10), "a change of phase is written at once, not after 30 s"
        assert writes[-1].ranks[0].phase == "checkpoint"
    finally:
        pub.stop()
    assert deleted == [True]


# ---------------------------------------------------------------- through the store

def test_records_cross_the_store_and_garbage_from_a_peer_is_ignored_and_counted():
    from elasticd.rendezvous.phase_watch import PhaseWatch
    from elasticd.store import open_store
    from elasticd.trust.refusals import Refusals
    from elasticd.trust.sealed import Kind, SealedRecords

    store = open_store("memory")
    records, refusals = SealedRecords(b"k" * 32, "/elasticd"), Refusals("test")
    watch = PhaseWatch(store, records=records, retry=0.1, refusals=refusals)
    lease = store.grant_lease(60)
    n2 = watch.for_job("j1", "n2", lambda: lease)
    n2.follow()
    try:
        rec = record("n2", 3, ranks=[RankPhase(1, "checkpoint", 2.0, 100, 0.05)])
        n2.publish(rec.to_json())
        wait = lambda pred: [time.sleep(0.02) for _ in range(500) if not pred()]  # noqa: E731
        wait(lambda: n2.peers())
        assert n2.peers()["n2"][0] == rec
        assert watch.phases("j1")["n2"][0] == rec

        def sealed(key: str, text: str) -> None:   # as a daemon of the cluster writes it
            store.put(key, records.seal(Kind.PHASES, key, text))
        store.put("/v1/phases/j1/n3", "x" * (64 * 1024))             # huge
        sealed("/v1/phases/j1/n4", rec.to_json())                    # another node's
        sealed("/v1/phases/j1/n5", '{"v":1,"node":"n5","round":1,"ranks":[[0,"train",'
                                   '1,1,"slow"]],"learned":[]}')     # a bad field
        store.put("/v1/phases/j1/n6", rec.to_json().replace("n2", "n6"))  # unsigned
        sealed("/v1/phases/j1/n7/x", rec.to_json())                  # no daemon's key
        wait(lambda: sum(refusals.counts.values()) >= 5)
        assert refusals.counts == {("phases", "too_large"): 1, ("phases", "invalid"): 2,
                                   ("phases", "unsigned"): 1, ("phases", "bad_key"): 1}, \
            refusals.counts
        assert set(n2.peers()) == {"n2"}
        n2.delete()
        wait(lambda: not n2.peers())
        assert n2.peers() == {}
    finally:
        n2.unfollow()
    assert watch.following() == []


def test_a_job_not_followed_here_is_read_from_the_store_and_a_replay_is_refused():
    """A job that runs elsewhere: its records are listed on demand, checked the same way;
    a record older than one this node took of the key is refused, also after unfollow."""
    from elasticd.rendezvous.phase_watch import PhaseWatch
    from elasticd.store import open_store
    from elasticd.trust.refusals import Refusals
    from elasticd.trust.sealed import SealedRecords

    store = open_store("memory")
    records, refusals = SealedRecords(b"k" * 32, "/elasticd"), Refusals("test")
    watch = PhaseWatch(store, records=records, retry=0.1, refusals=refusals)
    n1 = watch.for_job("j1", "n1", lambda: None)
    old, new = record("n1", 1), record("n1", 2)
    n1.publish(old.to_json())
    replay = store.get("/v1/phases/j1/n1").value
    n1.publish(new.to_json())
    assert watch.phases("j1")["n1"][0] == new          # not followed: read now
    assert watch.phases("j1")["n1"][0] == new          # the same record, read again
    assert watch.phases("j2") == {} and watch.following() == []
    n1.follow()
    try:
        for _ in range(500):
            if n1.peers():
                break
            time.sleep(0.02)
        assert n1.peers()["n1"][0] == new
    finally:
        n1.unfollow()
    store.put("/v1/phases/j1/n1", replay)               # an older genuine record put back
    assert "n1" not in watch.phases("j1")
    assert refusals.counts == {("phases", "replayed"): 1}, refusals.counts
