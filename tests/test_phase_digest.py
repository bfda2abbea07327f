"""The phase digest (hangs/phase_digest.py): the round's first member folds the job's phase
records into one record the other members watch in place of every record. The fold,
its checks on what comes from etcd, what a member decides on from it, the tracker
(hangs/detector.py) deciding on it as on the records themselves, and the digest across
a store. The real daemons on a real etcd: test_hang_multinode.py, test_phase_scope.py.
"""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.hangs.phase_board import JobPeers, NodePhases, RankPhase
from elasticd.hangs.phase_digest import (
    DIGEST_MAX, MAX_STALE, PhaseDigest, WaitingPhase, holds_records)
from elasticd.hangs.timeouts import PhaseRecord
from test_hang import FakeGroup, beat
from test_hang_learning import tracker as tracker_on_n1


def tracker(node_id):
    """test_hang_learning's tracker, on node ``node_id``."""
    tr, ops, reg = tracker_on_n1()
    tr.node_id = node_id
    return tr, ops, reg

MEMBERS = ["n1", "n2", "n3"]


def record(node, rnd=3, ranks=(), learned=()):
    return NodePhases(node, rnd, tuple(ranks), tuple(learned))


def folded(received, members=MEMBERS, rnd=3, now=100.0):
    return PhaseDigest.fold(received, members, members[0], rnd, 7.0, now)


def test_the_fold_keeps_what_the_members_decide_on_and_names_the_stale():
    got = {
        "n1": (record("n1", ranks=[RankPhase(0, "train", 1, 50, 0.10),
                                   RankPhase(1, "train", 1, 50, 0.11)],
                      learned=[PhaseRecord("train", 40, 0.2)]), 99.0),
        "n2": (record("n2", ranks=[RankPhase(2, "checkpoint", 3, 50, 0.30),
                                   RankPhase(3, "train", 1, 50, 0.10)],
                      learned=[PhaseRecord("train", 3, 0.5),
                               PhaseRecord("checkpoint", 1, 21)]), 98.0),
        "n3": (record("n3", ranks=[RankPhase(4, "checkpoint", 3, 50, 9.0)]), 90.0),  # stale
        "n9": (record("n9", ranks=[RankPhase(5, "checkpoint", 3, 50, 9.0)]), 99.0),  # no member
    }
    d = folded(got)
    assert (d.node_id, d.round, d.members) == ("n1", 3, 3)
    assert (d.stale, d.stale_count) == (("n3",), 1)
    assert d.waiting == (WaitingPhase("checkpoint", 1, ("n2",)),)
    assert {p.phase: (p.gaps, p.longest) for p in d.learned} == {
        "train": (40, 0.5), "checkpoint": (1, 21.0)}
    s = d.straggler
    assert (s.rank, s.rank_node, s.ranks, s.nodes) == (2, "n2", 4, 2)
    assert round(s.ratio, 1) == 3.0
    # A record of another round is as stale as none.
    assert folded(got, rnd=4).stale == ("n1", "n2", "n3")


def test_a_digest_round_trips_and_stays_bounded_whatever_the_job():
    members = [f"node-{i:04d}" for i in range(1000)]
    got = {n: (record(n, ranks=[RankPhase(i, "checkpoint", 1, 9, 0.1)]), 99.0)
           for i, n in enumerate(members[:900])}
    d = folded(got, members)
    assert d.stale_count == 100 and len(d.stale) == MAX_STALE
    assert d.waiting == (WaitingPhase("checkpoint", 900, ("node-0000", "node-0001")),)
    text = d.to_json()
    assert len(text) < DIGEST_MAX
    back = PhaseDigest.from_doc(json.loads(text), "node-0000")
    assert back == d


@pytest.mark.parametrize("change", [
    lambda d: d.update(v=2),
    lambda d: d.update(node="n2"),                               # another writer's
    lambda d: d.update(stale_count=0),                           # fewer than it lists
    lambda d: d.update(stale=["n2/x"]),
    lambda d: d.update(members=0),
    lambda d: d.update(waiting=[["train", 1, ["n2"]]]),          # nobody waits for train
    lambda d: d.update(waiting=[["checkpoint", 1, ["n2", "n3"]]]),  # more holders than nodes
    lambda d: d.update(waiting=[["checkpoint", 9, ["n2"]]]),     # more nodes than members
    lambda d: d.update(learned=[["train", -1, 0.5]]),
    lambda d: d.update(straggler=[1, "slow", 0.1, 0.1, 2, 1, "n2"]),
    lambda d: d.update(straggler=[1, 2.0, 0.1, 0.1, 1, 1, "n2"]),  # one rank is no straggler
    lambda d: d.update(stale=[f"n{i}" for i in range(MAX_STALE + 1)]),
])
def test_a_malformed_digest_is_refused(change):
    doc = json.loads(folded({"n2": (record("n2", ranks=[
        RankPhase(2, "checkpoint", 3, 50, 0.3), RankPhase(3, "train", 1, 50, 0.1)]),
        99.0)}).to_json())
    PhaseDigest.from_doc(dict(doc), "n1")
    change(doc)
    with pytest.raises(ValueError):
        PhaseDigest.from_doc(doc, "n1")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"v": st.just(1), "node": st.just("n1")},
                             optional={k: json_values for k in (
                                 "round", "members", "stale", "stale_count", "waiting",
                                 "learned", "straggler")}))
def test_any_json_as_a_digest_is_refused_or_read_never_crashes(doc):
    try:
        PhaseDigest.from_doc(doc, "n1")
    except ValueError:
        pass


def test_a_member_has_complete_peers_only_from_a_fresh_digest_of_its_round_by_its_first():
    ok = {m: (record(m), 99.0) for m in MEMBERS}
    d = folded(ok)
    assert d.peers(MEMBERS, "n2", 3, 1.0, 7.0).complete
    assert not d.peers(MEMBERS, "n2", 3, 8.0, 7.0).complete           # the digest is stale
    assert not d.peers(MEMBERS, "n2", 4, 1.0, 7.0).complete           # of another round
    assert not d.peers(["n2", "n1", "n3"], "n2", 3, 1.0, 7.0).complete  # not the first's
    assert not d.peers(MEMBERS + ["n4"], "n2", 3, 1.0, 7.0).complete  # of fewer members
    # n2's own record missing at the first member: its peers are still complete; n3's not.
    d = folded({m: ok[m] for m in ("n1", "n3")})
    assert d.peers(MEMBERS, "n2", 3, 1.0, 7.0).complete
    assert not d.peers(MEMBERS, "n3", 3, 1.0, 7.0).complete
    assert holds_records(MEMBERS, "n1") and not holds_records(MEMBERS, "n2")
    assert not holds_records([], "n1")


def test_a_phase_held_only_by_this_node_is_not_a_wait_for_another():
    mine = WaitingPhase("checkpoint", 1, ("n2",))
    assert not mine.held_elsewhere("n2") and mine.held_elsewhere("n3")
    assert WaitingPhase("checkpoint", 2, ("n2", "n3")).held_elsewhere("n2")
    d = PhaseDigest("n1", 3, 3, waiting=(mine, WaitingPhase("section:eval", 1, ("n1",))))
    assert d.waiting_phases("n2") == ["section:eval"]


def test_the_digest_is_written_again_at_once_only_when_what_members_decide_on_moved():
    base = {"n1": (record("n1", ranks=[RankPhase(0, "train", 1, 50, 0.10)]), 99.0),
            "n2": (record("n2", ranks=[RankPhase(1, "train", 1, 50, 0.30)]), 99.0)}
    d = folded(base, ["n1", "n2"])
    assert d.moved_from(None)
    # Step counts and how long a phase lasted move nothing; nor the ratio by less than a fifth.
    same = dict(base, n2=(record("n2", ranks=[RankPhase(1, "train", 9, 80, 0.33)]), 99.5))
    assert not folded(same, ["n1", "n2"]).moved_from(d)
    saving = dict(base, n2=(record("n2", ranks=[RankPhase(1, "checkpoint", 0, 50, 0.3)]), 99.5))
    assert folded(saving, ["n1", "n2"]).moved_from(d)
    assert folded({"n1": base["n1"]}, ["n1", "n2"]).moved_from(d)        # n2 went stale
    slower = dict(base, n2=(record("n2", ranks=[RankPhase(1, "train", 1, 50, 0.6)]), 99.5))
    assert folded(slower, ["n1", "n2"]).moved_from(d)


# ---------------------------------------------------------------- the tracker on a digest

def digest_peers(*records, members=("n1", "n2", "n3"), me="n3"):
    got = {r.node_id: (r, 99.0) for r in records}
    d = PhaseDigest.fold(got, list(members), members[0], 3, 7.0, 100.0)
    return d.peers(list(members), me, 3, 0.5, 7.0)


def trained(group, peers):
    """A tracker on n3 whose rank 0 trained 2 s at 10 steps a second (learned limits on),
    its peers ``peers()`` at each look; the tracker, its ops and the time reached."""
    tr, ops, _ = tracker("n3")
    ops.catching = {100}
    tr.check(group, peers())
    t = 0.0
    while t < 2.0:
        t = round(t + 0.1, 6)
        beat(ops, 0, t)
        tr.check(group, peers())
    assert [p.learned for p in tr.learned()] == [True]
    return tr, ops, t


def test_a_rank_waiting_for_a_checkpoint_seen_only_in_the_digest_is_not_killed():
    group = FakeGroup([100], world_size=3)
    train = [record("n1", ranks=[RankPhase(1, "train", 1, 10, None)]),
             record("n2", ranks=[RankPhase(2, "train", 1, 10, None)]),
             record("n3", ranks=[RankPhase(0, "train", 1, 10, None)])]
    training = lambda: digest_peers(*train)  # noqa: E731
    assert training().complete and training().digest is not None
    tr, ops, t = trained(group, training)
    saving = digest_peers(train[0], record("n2", ranks=[RankPhase(2, "checkpoint", 0, 10, None)]),
                          train[2])
    ops.now = t + 1.0
    assert tr.check(group, saving) == []
    ops.now = t + 25.0   # n2's rank still saving: rank 0 waits in its all_reduce
    assert tr.check(group, saving) == []
    # Without the digest's word on n2, the learned 10 s would have killed it long ago.
    tr, ops, t = trained(group, training)
    ops.now = t + 5.0
    tr.check(group, training())                  # its stacks dumped
    ops.now = t + 10.5
    done = tr.check(group, training())
    assert done and "killed (learned train" in done[-1], done


def test_a_checkpoint_on_this_node_alone_does_not_widen_through_the_digest():
    d = digest_peers(record("n3", ranks=[RankPhase(0, "checkpoint", 0, 10, None)]),
                     record("n1"), record("n2"))
    assert d.waiting_phases("n3") == [] and d.waiting_phases("n1") == ["checkpoint"]


def test_the_digest_learned_and_straggler_reach_the_tracker_and_its_node_announces_it():
    tr, ops, reg = tracker("n2")
    group = FakeGroup([100], world_size=3)
    peers = digest_peers(
        record("n1", ranks=[RankPhase(0, "train", 1, 50, 0.10)],
               learned=[PhaseRecord("checkpoint", 1, 21.0)]),
        record("n2", ranks=[RankPhase(1, "train", 1, 50, 0.40)]),
        record("n3", ranks=[RankPhase(2, "train", 1, 50, 0.10)]), me="n2")
    tr.check(group, peers)
    assert {p.phase: p.longest for p in tr.learned()}["checkpoint"] == 21.0
    s = tr.straggler()
    assert (s.rank, s.rank_node, s.nodes, s.ranks) == (1, "n2", 3, 3)
    events = [e[2] for e in reg.events if e[0] == "straggler"]
    assert len(events) == 1 and events[0].startswith("rank 1 is a straggler: 4.0x"), events
    # Named on n3 too, where it is not announced (events are shared across nodes).
    tr3, _, reg3 = tracker("n3")
    tr3.check(group, peers)
    assert tr3.straggler().rank == 1 and not [e for e in reg3.events if e[0] == "straggler"]


# ---------------------------------------------------------------- through the store

def test_digests_cross_the_store_per_writer_and_garbage_is_ignored_and_counted():
    from elasticd.rendezvous.phase_watch import PhaseWatch
    from elasticd.store import open_store
    from elasticd.trust.refusals import Refusals
    from elasticd.trust.sealed import Kind, SealedRecords

    store = open_store("memory")
    records, refusals = SealedRecords(b"k" * 32, "/elasticd"), Refusals("test")
    watch = PhaseWatch(store, records=records, retry=0.1, refusals=refusals)
    n1 = watch.for_job("j1", "n1", lambda: None)
    n2 = watch.for_job("j1", "n2", lambda: None)
    n2.follow_digests()
    try:
        d = folded({"n2": (record("n2", ranks=[RankPhase(1, "checkpoint", 1, 5, None)]),
                           99.0)}, ["n1", "n2"])
        n1.publish_digest(d.to_json())
        wait = lambda pred: [time.sleep(0.02) for _ in range(500) if not pred()]  # noqa: E731
        wait(lambda: n2.digest("n1"))
        assert n2.digest("n1")[0] == d and n2.digest("n3") is None
        assert watch.following() == ["j1"]

        def sealed(key: str, text: str) -> None:
            store.put(key, records.seal(Kind.PHASES, key, text))
        sealed("/v1/phasedigests/j1/n3", d.to_json())                 # names another writer
        store.put("/v1/phasedigests/j1/n4", d.to_json().replace("n1", "n4"))  # unsigned
        sealed("/v1/phasedigests/j1/n5", record("n5").to_json())      # a record, no digest
        sealed("/v1/phases/j1/n1", d.to_json())   # a digest where records lie: not watched here
        wait(lambda: sum(refusals.counts.values()) >= 3)
        assert refusals.counts == {("phases", "invalid"): 2, ("phases", "unsigned"): 1}, \
            refusals.counts
        n1.delete_digest()
        wait(lambda: n2.digest("n1") is None)
        assert n2.digest("n1") is None
    finally:
        n2.unfollow_digests()
    assert watch.following() == [] and n2.digest("n1") is None


def test_peers_from_records_and_from_a_digest_say_the_same():
    got = {"n1": (record("n1", ranks=[RankPhase(0, "train", 1, 50, 0.1)]), 99.0),
           "n2": (record("n2", ranks=[RankPhase(1, "section:eval", 1, 50, 0.2)],
                         learned=[PhaseRecord("section:eval", 2, 4.0)]), 99.0)}
    direct = JobPeers.of(got, ["n1", "n2"], "n1", 3, 7.0, 100.0)
    via = PhaseDigest.fold(got, ["n1", "n2"], "n1", 3, 7.0, 100.0).peers(
        ["n1", "n2"], "n1", 3, 0.0, 7.0)
    assert direct.complete and via.complete
    assert direct.waiting_phases("n1") == via.waiting_phases("n1") == ["section:eval"]
    assert {p.phase for ls in direct.learned() for p in ls} \
        == {p.phase for ls in via.learned() for p in ls} == {"section:eval"}
