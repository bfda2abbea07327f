"""Sealed records and the view that reads them, without daemons (issue 29, item 1).

What someone with etcd write access and no cluster key can try, one case
each: a record forged, one of the daemons' own moved to another key (another
job, round, node, kind, cluster prefix), changed, an older one put back, a
round whose address is not its first member's own join; and whatever goes
wrong with one key stays that key's (the follower never lists again for it).
The view runs on the in-memory store: the same Store contract as etcd's.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from elasticd.rendezvous.protocol import (CLOSED, OPEN, JobLimits, Join, Member, RoundCause,
                                          RoundState, master_problem, result_for)
from elasticd.rendezvous.round import ClusterRendezvous, create_job
from elasticd.rendezvous.view import JobsView
from elasticd.store import MemoryStore
from elasticd.store.follow import Follower
from elasticd.trust import clusterkey
from elasticd.trust.refusals import Refusals
from elasticd.trust.seqmark import SeqMark
from elasticd.trust.sealed import (MAX_BODY, PLAIN, Kind, Reason, Refused, SealedRecords)

KEY = clusterkey.derive(b"k" * 32).records
JOIN = Join("n1", "10.0.0.1", 2, 29500, prev_rank=0, time=1.0, store_port=41000, hosted=True)


def sealer(domain: str = "/elasticd", key: bytes = KEY) -> SealedRecords:
    return SealedRecords(key, domain)


def refused(records, kind, key, value) -> Reason:
    with pytest.raises(Refused) as got:
        records.open(kind, key, value)
    return got.value.reason


# ---------------------------------------------------------------- the format

def test_a_sealed_record_opens_under_its_own_key_only():
    r = sealer()
    key = "/v1/rounds/j1/join/3/n1"
    value = r.seal(Kind.JOIN, key, JOIN.to_json())
    opened = r.open(Kind.JOIN, key, value)
    assert Join.from_doc(opened.doc) == JOIN and opened.seq > 0
    for other in ("/v1/rounds/j2/join/3/n1", "/v1/rounds/j1/join/4/n1",
                  "/v1/rounds/j1/join/3/n2", "/v1/rounds/j1/done/3/n1",
                  "/v1/rounds/j1/join/3/n1x", "/v1/jobs/j1/join/3/n1"):
        assert refused(r, Kind.JOIN, other, value) is Reason.BAD_MAC, other
    # The job list's copy of a round state is no round state, nor the other way round.
    state = RoundState(round=4, status=CLOSED).to_json()
    assert refused(r, Kind.STATE, "/v1/rounds/j1/state",
                   r.seal(Kind.STATE, "/v1/jobs/j1/state", state)) is Reason.BAD_MAC
    assert refused(r, Kind.STATE, "/v1/jobs/j1/state",
                   r.seal(Kind.STATE, "/v1/rounds/j1/state", state)) is Reason.BAD_MAC
    assert refused(sealer("/other"), Kind.JOIN, key, value) is Reason.BAD_MAC
    assert refused(sealer(key=clusterkey.derive(b"x" * 32).records), Kind.JOIN, key,
                   value) is Reason.BAD_MAC


def test_every_change_to_a_sealed_record_breaks_it():
    r = sealer()
    key = "/v1/jobs/j1/state"
    value = r.seal(Kind.STATE, key, RoundState(round=4, status=CLOSED).to_json())
    head, seq, mac, body = value.split(".", 3)
    assert (head, len(mac)) == ("e1", 64)
    cases = {
        "an address changed": value.replace('"closed"', '"open"'),
        "a later seq": f"{head}.{int(seq) + 1}.{mac}.{body}",
        "a byte of the mac": f"{head}.{seq}.{mac[:-1]}{'0' if mac[-1] != '0' else '1'}.{body}",
        "the body cut": value[:-1],
        "a space added": value + " ",
    }
    for what, bad in cases.items():
        assert refused(r, Kind.STATE, key, bad) is Reason.BAD_MAC, what
    for bad in (body, "e1.x." + mac + "." + body, "e1." + seq + ".abc." + body,
                "e1." + "9" * 21 + "." + mac + "." + body, "", "[" * 50000):
        assert refused(r, Kind.STATE, key, bad) is Reason.UNSIGNED, bad[:40]
    assert refused(r, Kind.STATE, key, None) is Reason.NOT_JSON


def test_size_is_checked_before_any_hashing_and_the_writer_keeps_to_it():
    r = sealer()
    key = "/v1/rounds/j1/join/1/n1"
    big = "e1.1." + "0" * 64 + "." + "x" * (MAX_BODY[Kind.JOIN] + 1)
    assert refused(r, Kind.JOIN, key, big) is Reason.TOO_LARGE
    with pytest.raises(ValueError):
        r.seal(Kind.JOIN, key, json.dumps({"node_id": "n1", "pad": "x" * MAX_BODY[Kind.JOIN]}))
    with pytest.raises(ValueError):
        r.seal(Kind.JOIN, "/v1/rounds/j1/join/1/n\0", JOIN.to_json())


def test_a_sealed_body_is_still_decoded_safely():
    """A daemon never writes these; the decoder's limits hold after the MAC too."""
    r = sealer()
    key = "/v1/nodes/n1"
    for body, reason in (("[" * 40 + "]" * 40, Reason.WRONG_TYPE),
                         ('{"a":' * 40 + "1" + "}" * 40, Reason.TOO_DEEP),
                         ('{"slots": 1e999}', Reason.BAD_NUMBER), ('{"x": NaN}', Reason.BAD_NUMBER),
                         ("{not json", Reason.NOT_JSON)):
        assert refused(r, Kind.NODE, key, r.seal(Kind.NODE, key, body)) is reason, body


def test_seqs_rise_across_writes_even_when_the_clock_stands_still():
    r = SealedRecords(KEY, "", clock=lambda: 5_000_000_000)
    seqs = [r.open(Kind.DONE, "/k", r.seal(Kind.DONE, "/k", "{}")).seq for _ in range(5)]
    assert seqs == sorted(set(seqs)) and seqs[0] == 5_000_000


def test_plain_records_are_decoded_the_same_way_and_never_vouched_for():
    assert PLAIN.open(Kind.JOIN, "/k", JOIN.to_json()).doc["node_id"] == "n1"
    assert PLAIN.open(Kind.JOIN, "/k", JOIN.to_json()).seq == 0
    assert refused(PLAIN, Kind.JOIN, "/k", "[" * 50000) is Reason.TOO_LARGE
    assert refused(PLAIN, Kind.STATE, "/k", "[" * 50000) is Reason.TOO_DEEP
    assert refused(PLAIN, Kind.JOIN, "/k", '{"nproc": 1e999}') is Reason.BAD_NUMBER


def test_typed_records_bound_every_field():
    good = json.loads(JOIN.to_json())
    for change in ({"nproc": 10 ** 30}, {"nproc": 0}, {"nproc": 1.0}, {"nproc": True},
                   {"port": 70000}, {"port": 0}, {"address": "a b"}, {"address": ""},
                   {"node_id": "a/b"}, {"node_id": ""}, {"time": -1}, {"prev_rank": -2},
                   {"store_port": -1}):
        with pytest.raises(ValueError):
            Join.from_doc({**good, **change})
    state = json.loads(RoundState(round=2, status=CLOSED, members=(JOIN.member(),)).to_json())
    for change in ({"round": -1}, {"status": "weird"}, {"members": [{"node_id": "x"}]},
                   {"members": "n1"}, {"restart_times": [float("inf")]},
                   {"restart_times": ["1"]}, {"expected": [1]}, {"reason": "r" * 20000},
                   {"members": [state["members"][0]] * 2}, {"opened_at": "now"}):
        with pytest.raises(ValueError):
            RoundState.from_doc({**state, **change})
    assert RoundState.from_doc(state).members == (JOIN.member(),)


# ---------------------------------------------------------------- a round's address

def test_a_closed_rounds_master_address_comes_only_from_its_own_join():
    members = (Member("n1", "10.0.0.1", 1, 29500, hosted=True), Member("n2", "10.0.0.2", 1, 29501))
    state = RoundState(round=5, status=CLOSED, members=members)
    joins = {m.node_id: Join(m.node_id, m.address, m.nproc, m.port, hosted=m.hosted)
             for m in members}
    assert master_problem(state, joins) == (None, "")
    assert result_for(state, "n2", joins).place.master_port == 29500
    cause, why = master_problem(state, {"n2": joins["n2"]})
    assert cause is RoundCause.NODE_LOST and "n1" in why
    moved = {**joins, "n1": Join("n1", "10.6.6.6", 1, 29500, hosted=True)}
    assert master_problem(state, moved)[0] is RoundCause.FAULT
    assert result_for(state, "n2", moved) is None and result_for(state, "n2", {}) is None
    # Only the first member's address matters: another member's join may be gone (lost).
    assert result_for(state, "n1", {"n1": joins["n1"]}).place.group_rank == 0


def alone_in_a_round(store, view, node: str, max_nodes: int):
    """What ``node``'s next_round returns, alone on the job j1 (None within 10 s)."""
    limits = JobLimits(min_nodes=1, max_nodes=max_nodes, max_restarts=5, last_call=0.0,
                       join_timeout=60.0)
    rdzv = ClusterRendezvous(store, view, "j1", node, "10.0.0.2", 1, lambda: None, limits,
                             poll=0.05)
    got, stop = {}, threading.Event()
    t = threading.Thread(target=lambda: got.setdefault("r", rdzv.next_round(stop)))
    t.start()
    t.join(10)
    stop.set()
    return got.get("r")


@pytest.fixture
def sealed_view():
    records, store = sealer(), MemoryStore()
    view = JobsView(store, records=records, retry=0.1)
    view.start()
    assert view.synced.wait(10)
    yield records, store, view
    view.stop()


def test_a_round_whose_first_member_did_not_join_it_is_not_run_but_replaced(sealed_view):
    """A genuine closed round whose first node's join is gone: the others ask for the
    next round instead of connecting to an address no join vouches for."""
    records, store, view = sealed_view
    create_job(store, "j1", {"id": "j1", "nodes": []}, time.time(), records=records)
    key = "/v1/rounds/j1/state"
    closed = RoundState(round=1, status=CLOSED, members=(
        Member("n0", "10.0.0.9", 1, 29500), Member("n2", "10.0.0.2", 1, 29501)))
    store.compare_and_swap(key, records.seal(Kind.STATE, key, closed.to_json()),
                           store.get(key).revision)
    got = alone_in_a_round(store, view, "n2", max_nodes=2)
    assert got is not None, "n2 formed no round of its own"
    assert (got.place.round, got.members, got.place.master_addr) == (2, ("n2",), "10.0.0.2")


def test_a_job_whose_state_an_older_daemon_wrote_opens_a_new_sealed_round(sealed_view):
    """After an upgrade the round state in etcd is the old version's, unsigned, and
    where it kept it (the job list; its rounds hold none): the resumed job does not
    wait for one forever but opens a new round in its rounds."""
    records, store, view = sealed_view
    store.create("/v1/jobs/j1/spec", json.dumps({"id": "j1"}))
    store.create("/v1/jobs/j1/state", RoundState(round=7, status=CLOSED, members=(
        Member("n1", "10.0.0.1", 1, 29500),)).to_json())       # unsigned: refused
    got = alone_in_a_round(store, view, "n1", max_nodes=1)
    assert got is not None and got.place.round == 1 and got.members == ("n1",)
    assert records.open(Kind.STATE, "/v1/rounds/j1/state",
                        store.get("/v1/rounds/j1/state").value).doc["status"] == CLOSED


# ---------------------------------------------------------------- the view

class Cluster:
    """A view on a memory store, and a writer with the cluster key."""

    def __init__(self):
        self.records = sealer()
        self.store = MemoryStore()
        self.refusals = Refusals("test")
        self.view = JobsView(self.store, records=self.records, retry=0.1,
                             refusals=self.refusals)
        self.view.start()
        self.view.follow("j1")      # as j1's rendezvous on a node that runs it
        self.view.watch_joins("j1")  # every join: as the node that decides its rounds
        assert self.view.synced.wait(10)
        deadline = time.monotonic() + 10
        while not self.view.joins_caught_up("j1") and time.monotonic() < deadline:
            self.view.wait(0.1)

    def put(self, kind: Kind, key: str, body: str) -> int:
        return self.settle(key, self.store.put(key, self.records.seal(kind, key, body)))

    def raw(self, key: str, value: str) -> int:
        return self.settle(key, self.store.put(key, value))

    def settle(self, key: str, revision: int) -> int:
        deadline = time.monotonic() + 10
        while not self.view.reached(key, revision) and time.monotonic() < deadline:
            self.view.wait(0.1)
        assert self.view.reached(key, revision)
        return revision

    def close(self):
        self.view.stop()


@pytest.fixture
def cl():
    c = Cluster()
    yield c
    c.close()


def state(rnd: int, status: str = CLOSED) -> str:
    return RoundState(round=rnd, status=status, members=(JOIN.member(),)).to_json()


def test_a_refused_value_changes_nothing_but_a_cas_replaces_it(cl):
    key = "/v1/rounds/j1/state"
    good = cl.put(Kind.STATE, key, state(3))
    cl.raw(key, "[" * 50000)
    cl.raw(key, json.dumps({"round": 9, "status": "closed", "members": []}))
    keys = cl.view.job("j1")
    assert keys.state.round == 3 and keys.state_revision > good
    assert cl.refusals.counts[("state", "unsigned")] == 2
    # The next move of the job replaces the bad value from the revision the view holds.
    cl.store.compare_and_swap(key, cl.records.seal(Kind.STATE, key, state(4, OPEN)),
                              keys.state_revision)
    cl.settle(key, cl.store.get(key).revision)
    assert cl.view.job("j1").state.round == 4


def test_an_older_round_put_back_is_refused(cl):
    key = "/v1/rounds/j1/state"
    old = cl.records.seal(Kind.STATE, key, state(3))
    cl.raw(key, old)
    cl.put(Kind.STATE, key, state(4, OPEN))
    cl.put(Kind.STATE, key, state(4, CLOSED))
    cl.raw(key, old)                                # genuine, and replayed as is
    assert cl.view.job("j1").state.order == (4, 1)
    assert cl.refusals.counts[("state", "replayed")] == 1
    cl.store.delete(key)
    cl.raw(key, old)                                # deleted first: still older
    assert cl.view.job("j1") is None or cl.view.job("j1").state is None
    assert cl.refusals.counts[("state", "replayed")] == 2


def test_a_nodes_older_record_put_back_is_refused_also_after_a_delete(cl):
    key = "/v1/joins/j1/round/1/n1"
    cl.put(Kind.STATE, "/v1/rounds/j1/state", state(1, OPEN))
    first = cl.records.seal(Kind.JOIN, key, JOIN.to_json())
    cl.raw(key, first)
    cl.put(Kind.JOIN, key, json.dumps({**json.loads(JOIN.to_json()), "port": 29600}))
    cl.raw(key, first)
    assert cl.view.job("j1").joins[1]["n1"].port == 29600
    cl.store.delete(key)
    cl.raw(key, first)
    assert 1 not in cl.view.job("j1").joins
    assert cl.refusals.counts[("join", "replayed")] == 2


def test_records_naming_another_node_or_unknown_keys_are_refused(cl):
    cl.put(Kind.STATE, "/v1/rounds/j1/state", state(1, OPEN))
    cl.put(Kind.JOIN, "/v1/joins/j1/round/1/n2", JOIN.to_json())     # names n1
    cl.put(Kind.JOIN, "/v1/joins/j1/round/x/n1", JOIN.to_json())
    cl.raw("/v1/jobs/j1/summaries/n1", "{}")
    cl.raw("/v1/jobs/" + "k" * 3000, "{}")
    assert cl.view.job("j1").joins == {}
    assert cl.refusals.counts[("join", "invalid")] == 1
    assert cl.refusals.counts[("join", "bad_key")] == 1
    assert cl.refusals.counts[("key", "bad_key")] == 2


def test_a_relist_keeps_verified_values_and_drops_deleted_keys(cl):
    """What the view holds after etcd compacted its history: the list, but a value that
    does not verify there keeps the verified one."""
    key = "/v1/rounds/j1/state"
    cl.put(Kind.STATE, key, state(2))
    cl.put(Kind.JOIN, "/v1/joins/j1/round/2/n1", JOIN.to_json())
    cl.put(Kind.DECIDER, "/v1/rounds/j1/decider/2", json.dumps({"node": "n1"}))
    kvs, rev = cl.store.list("/v1/rounds/j1")
    garbage = [kv._replace(value="[" * 50000) if kv.key == key else kv for kv in kvs
               if "/decider/" not in kv.key]
    # as j1's rounds watch calls it after a fresh list
    cl.view._reset_job(cl.view._followed.get("j1"), "j1", garbage, rev)
    keys = cl.view.job("j1")
    assert keys.state.round == 2 and keys.joins[2]["n1"] == JOIN and keys.deciders == {}
    assert cl.refusals.counts.get(("join", "replayed"), 0) == 0   # listed again: the same


def test_worker_rows_are_read_when_asked_for_and_an_older_one_put_back_is_refused(cl):
    """No node watches the rows (/v1/workers/<job>/rows/<node>): the view holds none, and
    ``job(id, rows=True)`` lists them, refusing a row older than one it read before."""
    key = "/v1/workers/j1/rows/n1"
    cl.put(Kind.STATE, "/v1/rounds/j1/state", state(1))
    row = {"rank": 0, "local_rank": 0, "pid": 7, "state": "running", "exit_code": 0}
    first = cl.records.seal(Kind.WORKERS, key, json.dumps({"rows": [row], "summary": {}}))
    cl.raw(key, first)
    assert cl.view.job("j1").workers == {}          # not watched
    assert [w.pid for w in cl.view.job("j1", rows=True).workers["n1"]] == [7]
    cl.put(Kind.WORKERS, key, json.dumps({"rows": [{**row, "pid": 8}], "summary": {}}))
    assert [w.pid for w in cl.view.job("j1", rows=True).workers["n1"]] == [8]
    cl.raw(key, first)                               # the older rows put back
    assert "n1" not in cl.view.job("j1", rows=True).workers
    assert cl.refusals.counts[("workers", "replayed")] == 1
    cl.raw("/v1/workers/j1/rows/n2", "[" * 50000)     # garbage: refused, n1's kept
    cl.put(Kind.WORKERS, key, json.dumps({"rows": [{**row, "pid": 9}], "summary": {}}))
    assert set(cl.view.job("j1", rows=True).workers) == {"n1"}


# ---------------------------------------------------------------- the follower

class CountingStore(MemoryStore):
    lists = 0

    def list(self, prefix):
        self.lists += 1
        return super().list(prefix)


def test_a_handler_that_raises_on_one_key_never_makes_the_follower_list_again():
    store = CountingStore()
    seen = []

    def on_event(ev):
        if ev.key.endswith("/bad"):
            raise RecursionError("as json.loads on '[' * 50000 did")
        seen.append(ev.key)

    f = Follower(store, "/v1/x", "test-watch", 0.1, lambda kvs, rev: None, on_event)
    f.start()
    try:
        assert f.synced.wait(10)
        for key in ("/v1/x/a", "/v1/x/bad", "/v1/x/b", "/v1/x/bad", "/v1/x/c"):
            store.put(key, "{}")
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen == ["/v1/x/a", "/v1/x/b", "/v1/x/c"]
        assert store.lists == 1 and f.handler_errors == 2
    finally:
        f.stop()


# ---------------------------------------------------------------- cost

def test_verifying_a_record_costs_microseconds():
    """The numbers in the report: a join (~200 B), a closed round of 64 nodes (~9 KB),
    a phase record (~4 KB), sealed and then opened (size cap, HMAC, decode)."""
    r = sealer()
    members = tuple(Member(f"node{i:03d}", f"10.0.{i // 250}.{i % 250}", 8, 29500 + i)
                    for i in range(64))
    cases = {"join": (Kind.JOIN, "/v1/rounds/j1/join/7/n1", JOIN.to_json()),
             "state (64 nodes)": (Kind.STATE, "/v1/rounds/j1/state",
                                  RoundState(round=7, status=CLOSED, members=members).to_json()),
             "phases": (Kind.PHASES, "/v1/phases/j1/n1", json.dumps(
                 {"v": 1, "node": "n1", "round": 7, "learned": [],
                  "ranks": [[i, "train", 0.5, 1000, 0.01] for i in range(128)]}))}
    out = []
    for name, (kind, key, body) in cases.items():
        value = r.seal(kind, key, body)
        n = 300
        t0 = time.process_time()
        for _ in range(n):
            r.open(kind, key, value)
        opened = (time.process_time() - t0) / n * 1e6
        costs = []
        for bad in ("{" + value, value[:-1]):      # unsigned; a bad MAC (hashed, not parsed)
            t0 = time.process_time()
            for _ in range(n):
                try:
                    r.open(kind, key, bad)
                except Refused:
                    pass
            costs.append((time.process_time() - t0) / n * 1e6)
        out.append(f"{name}: {len(value)} B, verify+decode {opened:.1f} us (MAC alone "
                   f"{costs[1]:.1f} us), refuse unsigned {costs[0]:.1f} us")
        assert opened < 2000, out      # far above what it costs: a loaded machine passes
    print("\n" + "\n".join(out))


def test_seqs_stay_above_an_earlier_process_of_the_daemon_after_its_clock_went_back(tmp_path):
    """A daemon restarted after its clock stepped back an hour: its peers hold its
    records' counts of before, so its new counts must lie above them (trust/seqmark.py)."""
    now = [7_200 * 10**9]
    first = SealedRecords(KEY, "", clock=lambda: now[0], mark=SeqMark(str(tmp_path)))
    before = [first.open(Kind.NODE, "/k", first.seal(Kind.NODE, "/k", "{}")).seq
              for _ in range(3)]
    assert (tmp_path / "records-seq").stat().st_mode & 0o777 == 0o600
    now[0] -= 3_600 * 10**9                     # the clock goes back an hour; a restart
    again = SealedRecords(KEY, "", clock=lambda: now[0], mark=SeqMark(str(tmp_path)))
    after = again.open(Kind.NODE, "/k", again.seal(Kind.NODE, "/k", "{}")).seq
    assert after > max(before)
    # Without the mark the count would have come from the clock alone, below them.
    bare = SealedRecords(KEY, "", clock=lambda: now[0])
    assert bare.open(Kind.NODE, "/k", bare.seal(Kind.NODE, "/k", "{}")).seq < max(before)
    # The mark is written once per reserve, not once a record.
    written = (tmp_path / "records-seq").stat().st_mtime_ns
    again.seal(Kind.NODE, "/k", "{}")
    assert (tmp_path / "records-seq").stat().st_mtime_ns == written


def test_a_mark_file_that_holds_no_count_is_ignored(tmp_path):
    (tmp_path / "records-seq").write_text("garbage\n")
    assert SeqMark(str(tmp_path)).reserved == 0
    (tmp_path / "elsewhere").write_text("99999999999999\n")
    os.unlink(tmp_path / "records-seq")
    os.symlink(tmp_path / "elsewhere", tmp_path / "records-seq")   # never followed
    assert SeqMark(str(tmp_path)).reserved == 0


def test_the_job_lists_copy_of_a_round_never_goes_back_and_replaces_a_forged_one(
        sealed_view):
    """What other nodes adopt by and show (/v1/jobs/<job>/state) follows the round
    state a node wrote, never an older one a slower writer offers after it; a value
    there that does not verify is replaced."""
    records, store, view = sealed_view
    create_job(store, "j1", {"id": "j1", "nodes": []}, time.time(), records=records)
    limits = JobLimits(min_nodes=1, max_nodes=1, max_restarts=5, last_call=0.0,
                       join_timeout=60.0)
    rdzv = ClusterRendezvous(store, view, "j1", "n1", "10.0.0.1", 1, lambda: None, limits)
    key = "/v1/jobs/j1/state"

    def copy() -> RoundState:
        return RoundState.from_doc(records.open(Kind.STATE, key, store.get(key).value).doc)
    try:
        assert (copy().round, copy().status) == (1, OPEN)     # create_job's
        rdzv._list_copy(RoundState(round=3, status=CLOSED))
        rdzv._list_copy(RoundState(round=2, status=OPEN))    # late: older than the copy
        assert (copy().round, copy().status) == (3, CLOSED)
        store.put(key, json.dumps({"round": 99, "status": "closed"}))   # forged, unsigned
        rdzv._list_copy(RoundState(round=4, status=OPEN))
        assert (copy().round, copy().status) == (4, OPEN)
        closed = RoundState(round=5, status=CLOSED, members=(Member("n1", "10.0.0.1", 1, 9),
                                                             Member("n2", "10.0.0.2", 1, 9)))
        rdzv._list_copy(closed)     # the members by id alone (their addresses: the rounds')
        assert copy().members == () and copy().member_ids() == ["n1", "n2"]
    finally:
        rdzv.close()
