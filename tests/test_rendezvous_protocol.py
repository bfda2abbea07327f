"""The cluster rendezvous protocol's pure decisions (rendezvous/protocol.py), no I/O.

What a user of a multi-node job relies on: a round closes at once when the
job's max nodes joined, after the last call once its min joined, or as soon
as every node it waits for (the old members) is back; a round stuck below
min fails after the join timeout and says why; every fault counts against
the job's restart budget, cluster-wide; nodes that survive keep their group
ranks; and each node's ranks, world size and master come out right.
"""
from __future__ import annotations

import json

import pytest

from elasticd.rendezvous.protocol import (CANCELLED, CLOSED, FAILED, OPEN, SUCCEEDED, Join,
                                          JobLimits, Member, RoundClock, RoundState,
                                          decide_open_round, final_job_state,
                                          order_members, reopen, result_for)
from elasticd.jobs.states import JobState

LIMITS = JobLimits(min_nodes=2, max_nodes=4, max_restarts=3, last_call=2.0, join_timeout=30.0)


def joins(*ids: str, nproc: int = 1, prev: dict | None = None) -> list[Join]:
    prev = prev or {}
    return [Join(node_id=n, address=f"10.0.0.{i + 1}", nproc=nproc, port=29500 + i,
                 prev_rank=prev.get(n, -1)) for i, n in enumerate(ids)]


def open_round(rnd: int = 1, expected: tuple = (), restarts: int = 0) -> RoundState:
    return RoundState(round=rnd, status=OPEN, expected=expected, restarts=restarts,
                      opened_at=100.0)


def own_joins(state: RoundState) -> dict:
    """The joins the members of ``state`` wrote for its round (what a node runs it from)."""
    return {m.node_id: Join(m.node_id, m.address, m.nproc, m.port, store_port=m.store_port,
                            hosted=m.hosted) for m in state.members}


def closed(members: list[Member], rnd: int = 1, restarts: int = 0) -> RoundState:
    return RoundState(round=rnd, status=CLOSED, members=tuple(members), restarts=restarts)


def decide(state, js, now, clock=None, limits=LIMITS):
    clock = clock if clock is not None else RoundClock()
    return decide_open_round(state, js, limits, clock, now)


# ------------------------------------------------------------- closing a round

def test_round_closes_at_once_when_max_nodes_joined():
    clock = RoundClock()
    new, why = decide(open_round(), joins("a", "b", "c", "d"), now=1000.0, clock=clock)
    assert new is not None and new.status == CLOSED
    assert new.member_ids() == ["a", "b", "c", "d"]
    assert new.closed_at == 1000.0
    assert "max reached" in why and "4 node(s)" in why
    assert new.reason == why


def test_more_joins_than_max_keeps_max_members_old_members_first():
    # "z" ran in the last round (group rank 0): it keeps its place even
    # though newcomers with smaller ids joined too.
    js = joins("a", "b", "c", "d", "z", prev={"z": 0})
    new, _ = decide(open_round(), js, now=0.0)
    assert new.member_ids() == ["z", "a", "b", "c"]


def test_min_joined_waits_for_the_last_call_then_closes():
    clock = RoundClock()
    state = open_round()
    js = joins("a", "b")
    new, why = decide(state, js, now=10.0, clock=clock)
    assert new is None and "waiting" in why
    new, _ = decide(state, js, now=11.9, clock=clock)
    assert new is None, "closed before the last call was over"
    new, why = decide(state, js, now=12.0, clock=clock)
    assert new is not None and new.status == CLOSED
    assert new.member_ids() == ["a", "b"]
    assert "last call of 2s" in why


def test_last_call_counts_from_when_min_was_reached_not_from_the_open():
    clock = RoundClock()
    state = open_round()
    assert decide(state, joins("a"), now=0.0, clock=clock)[0] is None
    # min reached 20 s after the round opened: the last call starts now.
    assert decide(state, joins("a", "b"), now=20.0, clock=clock)[0] is None
    assert decide(state, joins("a", "b"), now=21.0, clock=clock)[0] is None
    new, _ = decide(state, joins("a", "b", "c"), now=22.0, clock=clock)
    assert new is not None and new.member_ids() == ["a", "b", "c"]


def test_below_min_never_closes_however_long_the_wait_before_timeout():
    clock = RoundClock()
    state = open_round()
    for now in (0.0, 5.0, 29.0):
        new, why = decide(state, joins("a"), now=now, clock=clock)
        assert new is None
        assert "1 node(s) joined" in why


def test_round_closes_as_soon_as_every_expected_node_joined():
    # After a fault the new round expects the old members: no last call.
    clock = RoundClock()
    state = open_round(rnd=2, expected=("a", "b", "c"))
    assert decide(state, joins("a", "b"), now=0.0, clock=clock)[0] is None
    new, why = decide(state, joins("a", "b", "c"), now=0.1, clock=clock)
    assert new is not None and new.status == CLOSED
    assert new.member_ids() == ["a", "b", "c"]
    assert "every expected node joined" in why


def test_expected_nodes_below_min_still_wait():
    clock = RoundClock()
    limits = JobLimits(min_nodes=3, max_nodes=4, max_restarts=3, last_call=2.0,
                       join_timeout=30.0)
    state = open_round(expected=("a", "b"))
    new, _ = decide(state, joins("a", "b"), now=0.0, clock=clock, limits=limits)
    assert new is None


def test_no_expected_nodes_means_the_last_call_applies():
    clock = RoundClock()
    new, _ = decide(open_round(expected=()), joins("a", "b", "c"), now=0.0, clock=clock)
    assert new is None


def test_a_new_round_restarts_the_deciders_clock():
    clock = RoundClock()
    decide(open_round(rnd=1), joins("a", "b"), now=0.0, clock=clock)
    # Round 2 opens much later: its last call starts again.
    assert decide(open_round(rnd=2), joins("a", "b"), now=100.0, clock=clock)[0] is None
    assert clock.round == 2 and clock.min_reached == 100.0
    assert decide(open_round(rnd=2), joins("a", "b"), now=102.0, clock=clock)[0] is not None


def test_closed_round_keeps_restart_count_and_round():
    new, _ = decide(open_round(rnd=5, restarts=2), joins("a", "b", "c", "d"), now=0.0)
    assert (new.round, new.restarts) == (5, 2)


# ------------------------------------------------------------- failing a round

def test_below_min_after_join_timeout_fails_with_the_reason():
    clock = RoundClock()
    limits = JobLimits(min_nodes=3, max_nodes=3, max_restarts=3, last_call=2.0,
                       join_timeout=5.0)
    state = open_round()
    assert decide(state, joins("n1", "n2"), now=50.0, clock=clock, limits=limits)[0] is None
    assert decide(state, joins("n1", "n2"), now=54.9, clock=clock, limits=limits)[0] is None
    new, why = decide(state, joins("n1", "n2"), now=55.0, clock=clock, limits=limits)
    assert new is not None and new.status == FAILED
    assert new.final
    assert "2 of the 3 nodes" in why and "5s" in why and "round 1" in why
    assert new.reason == why


def test_join_timeout_failure_names_the_nodes_that_joined():
    clock = RoundClock()
    limits = JobLimits(min_nodes=3, max_nodes=3, max_restarts=3, last_call=2.0,
                       join_timeout=5.0)
    decide(open_round(), joins("n1", "n2"), now=0.0, clock=clock, limits=limits)
    new, why = decide(open_round(), joins("n1", "n2"), now=6.0, clock=clock, limits=limits)
    assert new.status == FAILED
    assert "n1" in why and "n2" in why


def test_join_timeout_failure_names_the_expected_nodes_missing():
    # After a fault the round waits for the old members; one never came back.
    clock = RoundClock()
    limits = JobLimits(min_nodes=3, max_nodes=3, max_restarts=3, last_call=2.0,
                       join_timeout=5.0)
    state = open_round(rnd=2, expected=("n1", "n2", "n3"))
    decide(state, joins("n1", "n2"), now=0.0, clock=clock, limits=limits)
    new, why = decide(state, joins("n1", "n2"), now=6.0, clock=clock, limits=limits)
    assert new.status == FAILED
    assert "missing" in why and "n3" in why, why


def test_no_node_at_all_fails_after_join_timeout():
    clock = RoundClock()
    state = open_round()
    decide(state, [], now=0.0, clock=clock)
    new, why = decide(state, [], now=30.0, clock=clock)
    assert new is not None and new.status == FAILED
    assert "only 0 of the 2 nodes" in why


def test_min_reached_never_fails_on_join_timeout():
    # A slow last call past the join timeout closes the round; it never fails it.
    limits = JobLimits(min_nodes=2, max_nodes=4, max_restarts=3, last_call=10.0,
                       join_timeout=5.0)
    clock = RoundClock()
    state = open_round()
    assert decide(state, joins("a"), now=0.0, clock=clock, limits=limits)[0] is None
    assert decide(state, joins("a", "b"), now=4.0, clock=clock, limits=limits)[0] is None
    new, _ = decide(state, joins("a", "b"), now=9.0, clock=clock, limits=limits)
    assert new is None
    new, _ = decide(state, joins("a", "b"), now=14.0, clock=clock, limits=limits)
    assert new is not None and new.status == CLOSED


# ------------------------------------------------------------- reopening

def test_reopen_after_a_fault_counts_a_restart_and_opens_the_next_round():
    state = closed([Member("a", "x", 1, 1), Member("b", "y", 1, 2)], rnd=3, restarts=1)
    new, why = reopen(state, "rank 1 exited with exit code 1", True, LIMITS, now=7.0,
                      expected=("b", "a"))
    assert (new.round, new.status, new.restarts) == (4, OPEN, 2)
    assert new.members == ()
    assert new.expected == ("a", "b")        # sorted
    assert new.opened_at == 7.0
    assert "rank 1 exited" in why and "round 4 opened" in why and "restart 2 of 3" in why
    assert new.reason == why


def test_reopen_for_scale_up_does_not_count():
    state = closed([Member("a", "x", 1, 1)], rnd=1, restarts=1)
    new, why = reopen(state, "node(s) c waiting to join", False, LIMITS, now=0.0,
                      expected=("a", "c"))
    assert (new.round, new.status, new.restarts) == (2, OPEN, 1)
    assert "restart" not in why


def test_last_restart_is_still_granted():
    state = closed([Member("a", "x", 1, 1)], restarts=2)
    new, _ = reopen(state, "fault", True, LIMITS, now=0.0)
    assert new.status == OPEN and new.restarts == 3


def test_reopen_fails_the_job_when_the_restart_budget_is_spent():
    state = closed([Member("a", "x", 1, 1)], rnd=4, restarts=3)
    new, why = reopen(state, "node(s) b lost", True, LIMITS, now=0.0)
    assert new.status == FAILED and new.final
    assert "node(s) b lost" in why and "no restarts left" in why and "3 of 3" in why
    # The failed state stays on the round it failed in.
    assert new.round == 4


def test_zero_restarts_allowed_fails_on_the_first_fault():
    limits = JobLimits(min_nodes=1, max_nodes=2, max_restarts=0, last_call=0.0,
                       join_timeout=5.0)
    new, why = reopen(closed([Member("a", "x", 1, 1)]), "boom", True, limits, now=0.0)
    assert new.status == FAILED and "0 of 0" in why


def test_spent_budget_still_allows_uncounted_reopen():
    state = closed([Member("a", "x", 1, 1)], restarts=3)
    new, _ = reopen(state, "scale up", False, LIMITS, now=0.0)
    assert new.status == OPEN and new.restarts == 3


# ------------------------------------------------------------- stable ranks

def test_old_members_keep_their_order_newcomers_follow_by_id():
    js = joins("d", "a", "c", "b", "e", prev={"c": 0, "a": 1, "e": 2})
    assert [m.node_id for m in order_members(js)] == ["c", "a", "e", "b", "d"]


def test_survivors_keep_relative_order_after_a_loss():
    # Round 1 was c, a, e; a died: c and e keep their order (0, 1).
    js = joins("e", "c", prev={"c": 0, "e": 2})
    members = order_members(js)
    assert [m.node_id for m in members] == ["c", "e"]
    state = closed(list(members), rnd=2)
    assert result_for(state, "c", own_joins(state)).place.group_rank == 0
    assert result_for(state, "e", own_joins(state)).place.group_rank == 1


def test_ranks_stable_across_a_scale_up_round():
    # Round 1 closed with b, a (b first); a newcomer "0" (smallest id) joins round 2.
    r1 = closed([Member("b", "hb", 2, 1), Member("a", "ha", 2, 2)], rnd=1)
    prev = {n: result_for(r1, n, own_joins(r1)).place.group_rank for n in ("a", "b")}
    new, _ = decide(open_round(rnd=2, expected=("0", "a", "b")),
                    joins("0", "a", "b", nproc=2, prev=prev), now=0.0)
    assert new.member_ids() == ["b", "a", "0"]
    for node in ("a", "b"):
        assert result_for(new, node, own_joins(new)).place.rank_offset == \
            result_for(r1, node, own_joins(r1)).place.rank_offset


def test_order_members_carries_address_nproc_and_port():
    (m,) = order_members([Join("n", "10.1.1.1", 8, 12345)])
    assert m == Member("n", "10.1.1.1", 8, 12345)


# ------------------------------------------------------------- result_for

def test_result_for_offsets_world_and_master():
    state = closed([Member("x", "10.0.0.9", 2, 29500), Member("y", "10.0.0.8", 3, 29501),
                    Member("z", "10.0.0.7", 1, 29502)], rnd=7)
    rx, ry, rz = (result_for(state, n, own_joins(state)) for n in ("x", "y", "z"))
    places = [r.place for r in (rx, ry, rz)]
    assert [p.group_rank for p in places] == [0, 1, 2]
    assert [p.rank_offset for p in places] == [0, 2, 5]
    assert {p.world_size for p in places} == {6}
    assert {p.group_world_size for p in places} == {3}
    assert {(p.master_addr, p.master_port) for p in places} == {("10.0.0.9", 29500)}
    assert {p.round for p in places} == {7}
    assert rz.members == ("x", "y", "z")


def test_every_global_rank_exactly_once():
    members = [Member(f"n{i}", f"h{i}", nproc, 1000 + i)
               for i, nproc in enumerate((4, 1, 3, 2))]
    state = closed(members)
    ranks = []
    for m in members:
        r = result_for(state, m.node_id, own_joins(state))
        ranks += range(r.place.rank_offset, r.place.rank_offset + m.nproc)
    assert sorted(ranks) == list(range(10))


def test_result_for_a_non_member_or_an_open_round_is_none():
    state = closed([Member("a", "h", 1, 1)])
    assert result_for(state, "b", own_joins(state)) is None
    assert result_for(open_round(), "a", {}) is None
    done = RoundState(round=1, status=SUCCEEDED, members=(Member("a", "h", 1, 1),))
    assert result_for(done, "a", own_joins(done)) is None


# ------------------------------------------------------------- records

def test_round_state_round_trips_through_json():
    state = RoundState(round=3, status=CLOSED, members=(Member("a", "h", 2, 7),),
                       restarts=1, expected=("a",), reason="r", opened_at=1.5, closed_at=2.5)
    assert RoundState.from_json(state.to_json()) == state


def test_the_job_lists_copy_names_its_members_by_id_alone_and_is_a_tenth_of_the_state():
    """The job list's copy of a round (RoundState.listed) is watched by every daemon: a
    closed round of 1,000 members is ~108 KB with their addresses and ports, its ids a
    tenth of it; it reads back with the same members' ids, status and round."""
    members = tuple(Member(f"node-{i:04d}", f"10.1.{i // 250}.{i % 250}", 8, 29500,
                           29501, True) for i in range(1000))
    state = RoundState(round=7, status=CLOSED, members=members, restarts=2,
                       reason="r", opened_at=1.5, closed_at=2.5)
    full, listed = state.to_json(), state.listed().to_json()
    assert len(listed) * 8 < len(full), (len(listed), len(full))
    back = RoundState.from_json(listed)
    assert back.members == () and back.member_ids() == state.member_ids()
    assert (back.round, back.status, back.restarts, back.order) == (7, CLOSED, 2, state.order)
    assert RoundState.from_json(full).listed() == back


@pytest.mark.parametrize("text", [
    '{"round": 1, "status": "closed", "member_ids": ["a", "a"]}',
    '{"round": 1, "status": "closed", "member_ids": ["a/b"]}',
    '{"round": 1, "status": "closed", "member_ids": "a"}',
    '{"round": 1, "status": "closed", "member_ids": ["a"], "members": '
    '[{"node_id": "a", "address": "h", "nproc": 1, "port": 1}]}'])
def test_a_listed_copy_with_bad_member_ids_is_refused(text):
    with pytest.raises(ValueError):
        RoundState.from_json(text)


@pytest.mark.parametrize("text", ['[1, 2]', '{"round": 1, "status": "weird"}',
                                  '{"status": "open"}', 'not json'])
def test_bad_round_state_is_rejected(text):
    with pytest.raises((ValueError, KeyError)):
        RoundState.from_json(text)


def test_join_round_trips_and_defaults():
    j = Join("n1", "10.0.0.1", 2, 29500, prev_rank=1, time=3.0)
    assert Join.from_json(j.to_json()) == j
    bare = Join.from_json(json.dumps({"node_id": "n", "address": "a", "nproc": 1, "port": 2}))
    assert bare.prev_rank == -1


def test_the_first_members_job_store_is_the_rounds_and_an_old_record_still_reads():
    joins = [Join("b", "10.0.0.2", 1, 29500, store_port=0),
             Join("a", "10.0.0.1", 1, 29500, store_port=41000)]
    state = RoundState(round=2, status=CLOSED, members=order_members(joins))
    state = RoundState.from_json(state.to_json())
    for node in ("a", "b"):
        r = result_for(state, node, own_joins(state))
        assert (r.store_addr, r.store_port) == ("10.0.0.1", 41000)
    # A join or member written before the store port existed reads as "no store".
    old = json.dumps({"node_id": "a", "address": "x", "nproc": 1, "port": 1})
    assert Join.from_json(old).store_port == 0
    noone = RoundState(round=1, status=CLOSED, members=(Member("b", "y", 1, 2),))
    got = result_for(noone, "b", own_joins(noone))
    assert got.store_port == 0 and got.store_addr == ""


def test_a_final_round_status_ends_the_job_in_one_job_state_on_every_node():
    assert final_job_state(SUCCEEDED) is JobState.SUCCEEDED
    assert final_job_state(CANCELLED) is JobState.CANCELLED
    assert final_job_state(FAILED) is JobState.FAILED
    assert final_job_state("anything else") is JobState.FAILED


# ------------------------------------------------------------- issue 22: rounds after a loss

REJOIN = JobLimits(min_nodes=2, max_nodes=3, max_restarts=-1, last_call=2.0,
                   join_timeout=30.0, rejoin_timeout=0.5)


def after_fault(alive: tuple, waiting: tuple = ()) -> RoundState:
    last = closed([Member(n, "h", 1, 1) for n in ("a", "b", "c")], rnd=4)
    return reopen(last, "rank 1 failed", True, REJOIN, now=10.0,
                  expected=alive + waiting, rejoining=alive)[0]


def test_reopen_records_the_members_that_rejoin_and_it_survives_json():
    state = after_fault(("a", "b", "c"), waiting=("d",))
    assert state.rejoining == ("a", "b", "c") and state.expected == ("a", "b", "c", "d")
    assert RoundState.from_json(state.to_json()).rejoining == ("a", "b", "c")
    old = json.loads(state.to_json())
    del old["rejoining"]  # a record written before the field: nobody counts as rejoining
    assert RoundState.from_json(json.dumps(old)).rejoining == ()


def test_a_member_whose_lease_expired_is_not_waited_for():
    # c was alive at the reopen; its join key of the last round vanished since (its
    # node lease expired): the round closes once a and b joined, no last call.
    clock = RoundClock()
    state = after_fault(("a", "b", "c"))
    assert decide_open_round(state, joins("a", "b"), REJOIN, clock, 0.0,
                             last_round={"a", "b", "c"})[0] is None
    new, why = decide_open_round(state, joins("a", "b"), REJOIN, clock, 0.1,
                                 last_round={"a", "b"})
    assert new is not None and new.member_ids() == ["a", "b"]
    assert "every expected node joined; lost: c" in why


def test_a_member_that_does_not_rejoin_is_given_up_after_the_rejoin_timeout():
    clock = RoundClock()
    state = after_fault(("a", "b", "c"))
    alive = {"a", "b", "c"}  # c's lease still holds: it may be alive, just slow
    assert decide_open_round(state, joins("a", "b"), REJOIN, clock, 100.0, alive)[0] is None
    assert decide_open_round(state, joins("a", "b"), REJOIN, clock, 100.4, alive)[0] is None
    new, why = decide_open_round(state, joins("a", "b"), REJOIN, clock, 100.5, alive)
    assert new is not None and new.member_ids() == ["a", "b"]
    assert "c of the last round did not rejoin within 0.5s" in why


def test_a_missing_newcomer_still_gets_the_last_call():
    # d waited to join (it is expected but was no member): the rejoin timeout is
    # for old members only; d gets the full last call.
    clock = RoundClock()
    state = after_fault(("a", "b"), waiting=("d",))
    last = {"a", "b"}
    assert decide_open_round(state, joins("a", "b"), REJOIN, clock, 100.0, last)[0] is None
    assert decide_open_round(state, joins("a", "b"), REJOIN, clock, 101.0, last)[0] is None
    new, why = decide_open_round(state, joins("a", "b"), REJOIN, clock, 102.0, last)
    assert new is not None and "last call of 2s" in why


def test_first_round_expected_nodes_are_no_rejoiners():
    # Pinned nodes of a new job are expected but never were members: neither lost
    # (they have no last-round key) nor hurried by the rejoin timeout.
    clock = RoundClock()
    state = open_round(rnd=1, expected=("a", "b", "c"))
    assert decide_open_round(state, joins("a", "b"), REJOIN, clock, 100.0, set())[0] is None
    assert decide_open_round(state, joins("a", "b"), REJOIN, clock, 101.9, set())[0] is None
    assert decide_open_round(state, joins("a", "b"), REJOIN, clock, 102.0, set())[0] is not None


def test_a_hosted_master_port_reaches_every_node_and_old_records_read_as_not_hosted():
    js = [Join("a", "10.0.0.1", 1, 41000, hosted=True), Join("b", "10.0.0.2", 1, 29500)]
    state = RoundState.from_json(RoundState(round=2, status=CLOSED,
                                            members=order_members(js)).to_json())
    for node in ("a", "b"):
        r = result_for(state, node, own_joins(state))
        assert (r.place.master_addr, r.place.master_port, r.master_hosted) == \
            ("10.0.0.1", 41000, True)
    assert Join.from_json(js[0].to_json()).hosted is True
    old = json.dumps({"node_id": "a", "address": "x", "nproc": 1, "port": 1})
    assert Join.from_json(old).hosted is False
    odd = json.dumps({"node_id": "a", "address": "x", "nproc": 1, "port": 1, "hosted": "yes"})
    assert Join.from_json(odd).hosted is False  # only a JSON true counts
    plain = RoundState(round=1, status=CLOSED, members=(Member("b", "y", 1, 2),))
    assert result_for(plain, "b", own_joins(plain)).master_hosted is False


def test_a_member_field_from_a_newer_release_is_ignored():
    # A rolling upgrade: a newer daemon wrote a field this release does not know.
    data = json.loads(RoundState(round=2, status=CLOSED,
                                 members=(Member("a", "h", 1, 7, hosted=True),)).to_json())
    data["members"][0]["future_field"] = 42
    state = RoundState.from_json(json.dumps(data))
    assert state.members == (Member("a", "h", 1, 7, hosted=True),)


# ------------------------------------------------------------- spare nodes

PAIR = JobLimits(min_nodes=2, max_nodes=2, max_restarts=3, last_call=2.0, join_timeout=30.0,
                 rejoin_timeout=1.0)


def test_a_newcomer_takes_the_place_of_the_member_gone_and_the_others_keep_theirs():
    # Round 1 was a, b, c; a (group rank 0) is gone; spare s fills its place.
    js = joins("c", "b", "s", prev={"b": 1, "c": 2})
    assert [m.node_id for m in order_members(js)] == ["s", "b", "c"]
    # a gap in the middle too, and newcomers beyond the gaps follow by id
    js = joins("a", "c", "y", "x", prev={"a": 0, "c": 2})
    assert [m.node_id for m in order_members(js)] == ["a", "x", "c", "y"]


def test_at_max_no_newcomer_puts_an_old_member_out():
    # old members at 0 and 3 (places 1, 2 gone), max 2: both old members, no newcomer
    js = joins("a", "d", "s", prev={"a": 0, "d": 3})
    assert [m.node_id for m in order_members(js, 2)[:2]] == ["a", "d"]


def test_reopen_expects_the_spares_standing_by():
    state = closed([Member("a", "x", 1, 1), Member("b", "y", 1, 2)])
    new, _ = reopen(state, "node b lost", False, PAIR, now=10.0, expected=("a", "s"),
                    rejoining=("a",), spares=("s",))
    assert new.expected == ("a", "s") and new.rejoining == ("a",) and new.spares == ("s",)
    assert RoundState.from_json(new.to_json()) == new


def test_a_spare_closes_the_round_at_the_same_world_size_in_the_lost_nodes_place():
    # b (group rank 0) was lost: its join of round 1 is gone; a and spare s joined.
    state = RoundState(round=2, status=OPEN, expected=("a", "b", "s"), rejoining=("a", "b"),
                       spares=("s",), opened_at=10.0)
    new, why = decide_open_round(state, joins("a", "s", prev={"a": 1}), PAIR, RoundClock(),
                                 10.2, last_round={"a", "s"})
    assert new is not None and new.status == CLOSED, why
    assert new.member_ids() == ["s", "a"]
    assert "spare node(s) s in place of b" in why


def test_live_members_rejoin_before_a_spare_takes_a_place():
    # a worker fault: a and b are alive (their round-1 joins are there); s joined first
    state = RoundState(round=2, status=OPEN, expected=("a", "b", "s"), rejoining=("a", "b"),
                       spares=("s",), opened_at=10.0)
    clock = RoundClock()
    assert decide_open_round(state, joins("a", "s", prev={"a": 0}), PAIR, clock, 10.0,
                             last_round={"a", "b", "s"})[0] is None
    # b rejoins: three nodes for two places, the members keep them, s stands by again
    new, _ = decide_open_round(state, joins("a", "s", "b", prev={"a": 0, "b": 1}), PAIR,
                               clock, 10.3, last_round={"a", "b", "s"})
    assert new.member_ids() == ["a", "b"]
    # a member that does not rejoin within rejoin_timeout (alive but stuck) is replaced
    clock = RoundClock()
    decide_open_round(state, joins("a", "s", prev={"a": 0}), PAIR, clock, 10.0,
                      last_round={"a", "b", "s"})
    new, _ = decide_open_round(state, joins("a", "s", prev={"a": 0}), PAIR, clock, 11.0,
                               last_round={"a", "b", "s"})
    assert new.member_ids() == ["a", "s"]


def test_a_spare_gone_is_not_waited_for():
    # min 1 of max 2: a rejoined; spare s's join of round 1 is gone (its lease expired)
    limits = JobLimits(min_nodes=1, max_nodes=2, max_restarts=3, last_call=30.0,
                       join_timeout=300.0, rejoin_timeout=30.0)
    state = RoundState(round=2, status=OPEN, expected=("a", "s"), rejoining=("a",),
                       spares=("s",), opened_at=10.0)
    new, why = decide_open_round(state, joins("a", prev={"a": 0}), limits, RoundClock(), 10.0,
                                 last_round={"a"})
    assert new is not None and new.member_ids() == ["a"], why


def test_a_job_is_adopted_up_to_its_max_nodes_plus_its_spares():
    from elasticd.cluster.dispatch import eligible
    from elasticd.jobs.spec import JobSpec
    members = (Member("a", "x", 1, 1), Member("b", "y", 1, 2))
    running = RoundState(round=1, status=CLOSED, members=members)
    plain = JobSpec(id="j", command=("true",), cwd="/", uid=0, gid=0, max_nodes=2)
    spared = JobSpec(id="j", command=("true",), cwd="/", uid=0, gid=0, max_nodes=2, spares=1)
    ok, why = eligible(plain, running, 2, "c", 4, False, 0)
    assert not ok and "max nodes" in why
    assert eligible(spared, running, 2, "c", 4, False, 0) == (True, "")
    # a spare already stands by (its join of the closed round)
    ok, why = eligible(spared, running, 3, "d", 4, False, 0)
    assert not ok and "its 1 spare(s)" in why
    ok, _ = eligible(spared, RoundState(round=1, status=OPEN), 3, "d", 4, False, 0)
    assert not ok
    assert eligible(spared, RoundState(round=1, status=OPEN), 2, "c", 4, False, 0)[0]


def test_spares_are_checked_alike_in_a_submission_and_in_a_signed_spec():
    from elasticd.config import ControlSettings
    from elasticd.control import validation
    from elasticd.errors import InvalidArgument
    from elasticd.jobs.spec import JobSpec
    from elasticd.trust import clusterkey
    from elasticd.trust.specs import SpecCodec
    from elasticd.v1 import control_pb2 as pb
    limits = ControlSettings()
    got = validation.submit_request(pb.SubmitRequest(command=["true"], cwd="/", spares=2),
                                    limits)
    assert got.spares == 2
    assert validation.submit_request(pb.SubmitRequest(command=["true"], cwd="/"),
                                     limits).spares is None   # the cluster's default
    for bad in (-1, limits.max_spares + 1):
        with pytest.raises(InvalidArgument, match="spares"):
            validation.submit_request(pb.SubmitRequest(command=["true"], cwd="/", spares=bad),
                                      limits)
    codec = SpecCodec(clusterkey.ephemeral(), limits)
    spec = JobSpec(id="j1", command=("true",), cwd="/", uid=1000, gid=1000, max_nodes=2,
                   spares=1, submitted_on="n1")
    assert codec.open("j1", json.dumps(codec.seal(spec))).spares == 1


def test_a_spec_signed_before_spares_existed_still_opens_and_cannot_gain_them():
    """A spec an older release sealed has no ``spares`` (its MAC covers the rest): it
    opens with none; adding the field to it breaks its signature."""
    import hmac as hmac_mod
    from hashlib import sha256
    from elasticd.config import ControlSettings
    from elasticd.jobs.spec import JobSpec
    from elasticd.trust import clusterkey
    from elasticd.trust import specs as specs_mod
    from elasticd.trust.rejections import RejectReason, SpecRejected
    keys = clusterkey.ephemeral()
    codec = specs_mod.SpecCodec(keys, ControlSettings())
    old = codec.seal(JobSpec(id="j1", command=("true",), cwd="/", uid=1000, gid=1000,
                             max_nodes=2, submitted_on="n1"))
    del old["spares"], old["mac"]
    fields = [f for f in specs_mod.SIGNED_FIELDS if f != "spares"]
    old["mac"] = hmac_mod.new(keys.mac, specs_mod._MAC_LABEL + specs_mod._canonical(
        [old[f] for f in fields]), sha256).hexdigest()
    assert codec.open("j1", json.dumps(old)).spares == 0
    with pytest.raises(SpecRejected) as refused:
        codec.open("j1", json.dumps({**old, "spares": 5}))
    assert refused.value.rejection.reason is RejectReason.BAD_SIGNATURE
