"""What ClusterRendezvous.status() tells a node of its round, typed (rendezvous/status.py).

Two nodes on the in-memory store through a real JobsView: a new round
another node opened carries its cause in the round state (no node reads
the reason text), a member whose lease lapsed is LOST with its id, a node
waiting to join is WAITING, and a finished job is FINAL.
"""
from __future__ import annotations

import threading
import time

from elasticd.rendezvous.round import ClusterRendezvous, RendezvousStopped, create_job
from elasticd.rendezvous.protocol import FAILED, JobLimits, RoundCause
from elasticd.rendezvous.status import StatusKind
from elasticd.rendezvous.view import JobsView
from elasticd.store import open_store
from elasticd.trust.sealed import PLAIN

LIMITS = JobLimits(min_nodes=2, max_nodes=3, max_restarts=5, last_call=0.0, join_timeout=60.0)


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


class Pair:
    """Nodes a and b in round 1 of job j1, each with a lease of its own."""

    def __init__(self):
        self.store = open_store("memory")
        self.view = JobsView(self.store, records=PLAIN, retry=0.1)
        self.view.start()
        assert self.view.synced.wait(10)
        self.leases = {n: self.store.grant_lease(60) for n in "abc"}
        self.nodes = {n: ClusterRendezvous(self.store, self.view, "j1", n, f"10.0.0.{i}", 1,
                                           lambda n=n: self.leases[n], LIMITS, poll=0.05)
                      for i, n in enumerate("abc", 1)}
        create_job(self.store, "j1", {"id": "j1", "nodes": ["a", "b"]}, time.time(),
                   records=PLAIN, expected=("a", "b"))
        self.results = self.join("a", "b")

    def join(self, *names):
        got, stop = {}, threading.Event()
        threads = [threading.Thread(target=lambda n=n: got.__setitem__(
            n, self.nodes[n].next_round(stop))) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert set(got) == set(names), got
        return got

    def status(self, name):
        return self.nodes[name].status(self.results[name])

    def close(self):
        self.view.stop()


def test_a_standing_round_is_current():
    p = Pair()
    try:
        assert p.status("a").kind is StatusKind.CURRENT
    finally:
        p.close()


def test_a_round_a_peer_reopened_is_superseded_with_the_cause_it_gave():
    for cause in RoundCause:
        p = Pair()
        try:
            p.nodes["b"].reopen(p.results["b"], "something happened on b", True, cause)
            st = wait_for(lambda: (s := p.status("a")).kind is not StatusKind.CURRENT and s)
            assert (st.kind, st.cause) == (StatusKind.SUPERSEDED, cause)
            assert st.why.startswith("something happened on b")
        finally:
            p.close()


def test_a_member_whose_lease_lapsed_is_lost_by_name():
    p = Pair()
    try:
        p.store.revoke_lease(p.leases["b"])
        st = wait_for(lambda: (s := p.status("a")).kind is StatusKind.LOST and s)
        assert (st.nodes, st.cause, st.why) == (("b",), RoundCause.NODE_LOST, "node(s) b lost")
    finally:
        p.close()


def test_a_node_waiting_to_join_is_waiting_by_name():
    p = Pair()
    try:
        stop = threading.Event()
        t = threading.Thread(target=lambda: _quiet(p.nodes["c"].next_round, stop))
        t.start()
        st = wait_for(lambda: (s := p.status("a")).kind is StatusKind.WAITING and s)
        assert (st.nodes, st.cause) == (("c",), RoundCause.NODE_WAITING)
        stop.set()
        p.view.wake_waiters()
        t.join(10)
    finally:
        p.close()


def test_a_finished_job_is_final():
    p = Pair()
    try:
        p.nodes["b"].finish(FAILED, "rank 1 exited 3; no restarts left")
        st = wait_for(lambda: (s := p.status("a")).kind is StatusKind.FINAL and s)
        assert st.why == "rank 1 exited 3; no restarts left"
    finally:
        p.close()


def _quiet(call, stop):
    try:
        call(stop)
    except RendezvousStopped:
        pass
