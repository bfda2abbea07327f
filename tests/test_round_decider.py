"""Who decides an open round, and who sees its joins (rendezvous/round.py, issue 33).

Each node has a JobsView of its own over one in-memory store, as daemons have
theirs over etcd. The first joined node to claim a round decides it and is the
only one whose view holds the round's joins; the others hold none, only the
round's state. A decider whose lease ends (a node lost) hands over: another
node claims the round and closes it. The closed round's first member watches
every join (it sees a newcomer wait); the others only their deletes, and still
see a member lost.
"""
from __future__ import annotations

import threading
import time

from etcd_cluster import wait_for
from elasticd.rendezvous.protocol import OPEN, JobLimits
from elasticd.rendezvous.round import ClusterRendezvous, RendezvousStopped, create_job
from elasticd.rendezvous.status import StatusKind
from elasticd.rendezvous.view import JobsView
from elasticd.store import open_store
from elasticd.trust.sealed import PLAIN

LIMITS = JobLimits(min_nodes=2, max_nodes=3, max_restarts=5, last_call=60.0,
                   join_timeout=600.0)


class Nodes:
    def __init__(self, names, limits=LIMITS, **kw):
        self.store = open_store("memory")
        self.leases = {n: self.store.grant_lease(60) for n in names}
        self.views, self.nodes, self.stops, self.got = {}, {}, {}, {}
        for i, n in enumerate(names, 1):
            view = self.views[n] = JobsView(self.store, records=PLAIN, retry=0.1)
            view.start()
            assert view.synced.wait(10)
            self.nodes[n] = ClusterRendezvous(self.store, view, "j1", n, f"10.0.0.{i}", 1,
                                              lambda n=n: self.leases[n], limits, poll=0.05,
                                              **kw)
        create_job(self.store, "j1", {"id": "j1", "nodes": []}, time.time(), records=PLAIN)
        self.threads = {}

    def start(self, name):
        stop = self.stops[name] = threading.Event()

        def run():
            try:
                self.got[name] = self.nodes[name].next_round(stop)
            except RendezvousStopped:
                pass
        t = self.threads[name] = threading.Thread(target=run, daemon=True)
        t.start()

    def decider(self, rnd=1):
        kv = self.store.get(f"/v1/rounds/j1/decider/{rnd}")
        return None if kv is None else kv.value

    def keys(self, name):
        return self.views[name].job("j1")

    def close(self):
        for stop in self.stops.values():
            stop.set()
        for view in self.views.values():
            view.wake_waiters()
        for t in self.threads.values():
            t.join(5)
        for view in self.views.values():
            view.stop()


def test_one_node_claims_the_round_and_only_its_view_holds_the_joins():
    ns = Nodes(["a", "b", "c"])
    try:
        for n in "abc":
            ns.start(n)
        # max 3 joined: the decider closes the round at once
        wait_for(lambda: len(ns.got) == 3, 20, what="the round closed")
        ranks = sorted(r.place.group_rank for r in ns.got.values())
        assert ranks == [0, 1, 2]
        first = ns.got["a"].members[0]
        # The first member watches every join now; the others none, the round's deletes
        for n in "abc":
            ns.nodes[n].status(ns.got[n])
        wait_for(lambda: ns.keys(first).joins_all and ns.keys(first).joins.get(1),
                 20, what="the first member listing the joins")
        for n in set("abc") - {first}:
            keys = ns.keys(n)
            assert not keys.joins_all and keys.joins == {}, (n, keys.joins)
        # A member lost (its lease ended): every member sees it, by its join's delete
        lost = next(n for n in "abc" if n != first)
        ns.store.revoke_lease(ns.leases[lost])
        for n in set("abc") - {lost}:
            st = wait_for(lambda n=n: (s := ns.nodes[n].status(ns.got[n])).kind
                          is StatusKind.LOST and s, 20, what=f"{n} seeing {lost} lost")
            assert st.nodes == (lost,)
    finally:
        ns.close()


def test_a_lost_decider_hands_the_round_over():
    ns = Nodes(["a", "b", "c"])
    try:
        ns.start("a")
        wait_for(lambda: ns.decider() is not None, 20, what="a claiming round 1")
        assert '"a"' in ns.decider()
        ns.start("b")
        wait_for(lambda: ns.keys("a").joins.get(1, {}).keys() >= {"a", "b"},
                 20, what="the decider seeing both joins")
        assert ns.keys("b").state.status == OPEN and ns.keys("b").joins == {}
        # a is lost: its lease ends, its join and its claim with it
        ns.stops["a"].set()
        ns.views["a"].wake_waiters()
        ns.store.revoke_lease(ns.leases["a"])
        wait_for(lambda: '"b"' in (ns.decider() or ""), 20, what="b claiming the round")
        ns.start("c")                  # max 3 is out of reach now; b closes at min 2 ...
        wait_for(lambda: ns.keys("b").joins.get(1, {}).keys() == {"b", "c"},
                 20, what="b seeing c join")
        assert "b" not in ns.got       # ... once last_call passes: not yet
        assert not ns.keys("c").joins_all
    finally:
        ns.close()


def test_a_node_that_leaves_the_job_gives_up_its_claim():
    ns = Nodes(["a", "b"])             # max 3: the round stays open
    try:
        ns.start("a")
        wait_for(lambda: ns.decider() is not None, 20, what="a claiming round 1")
        ns.stops["a"].set()
        ns.views["a"].wake_waiters()
        ns.threads["a"].join(5)
        ns.nodes["a"].close()          # the job ends here: its claim goes, its lease lives
        wait_for(lambda: ns.decider() is None, 20, what="a giving up its claim")
        ns.start("b")
        wait_for(lambda: '"b"' in (ns.decider() or ""), 20, what="b claiming round 1")
    finally:
        ns.close()


def test_every_member_lists_the_spare_though_only_the_first_watches_the_joins():
    """`elasticctl nodes` names a job's spares from its closed round's joins: a member that
    watches only the joins' deletes reads them when asked (ci88: a spare went unlisted on
    a node that was not the round's first member)."""
    from elasticd.control.remote_jobs import spare_roles
    ns = Nodes(["a", "b", "c"], JobLimits(min_nodes=2, max_nodes=2, max_restarts=5,
                                          last_call=0.0, join_timeout=600.0))
    try:
        ns.start("a")
        ns.start("b")
        wait_for(lambda: len(ns.got) == 2, 20, what="round 1 closed with a and b")
        ns.start("c")                  # at max nodes: c stands by as a spare
        wait_for(lambda: ns.nodes["c"].standing_by == 1, 20, what="c standing by")
        first = ns.got["a"].members[0]
        for n in "ab":
            ns.nodes[n].status(ns.got[n])
        # The other member reads the joins when asked: at once.
        other = "b" if first == "a" else "a"
        assert spare_roles(ns.views[other]) == {"c": ["j1"]}, other
        # The first member's watch delivers c's join when it does (c saw its own put
        # before the test looked).
        wait_for(lambda: spare_roles(ns.views[first]) == {"c": ["j1"]}, 20,
                 what=f"{first} listing c as the spare")
    finally:
        ns.close()


def test_only_the_first_member_holds_the_done_marks_and_ends_the_job():
    """The exit barrier: each member marks its workers done; the round's first member,
    which watches every join and mark, sees all of them and ends the job; the others
    hold no mark and end the job when its state turns final (N marks reach one node)."""
    ns = Nodes(["a", "b", "c"], done_recheck=600)
    try:
        for n in "abc":
            ns.start(n)
        wait_for(lambda: len(ns.got) == 3, 20, what="the round closed")
        first = ns.got["a"].members[0]
        others = sorted(set("abc") - {first})
        for n in "abc":
            ns.nodes[n].status(ns.got[n])
        for n in "abc":
            ns.nodes[n].mark_done(1)
        wait_for(lambda: ns.nodes[first].all_done(ns.got[first]), 20,
                 what="the first member seeing every mark")
        for n in others:
            assert not ns.nodes[n].all_done(ns.got[n])
            assert ns.keys(n).done == {}, (n, ns.keys(n).done)
        assert ns.keys(first).done == {1: {"a", "b", "c"}}
        ns.nodes[first].finish("succeeded", "every node's workers exited 0")
        for n in others:
            st = wait_for(lambda n=n: (s := ns.nodes[n].status(ns.got[n])).kind
                          is StatusKind.FINAL and s, 20, what=f"{n} seeing the job end")
            assert st.state.status == "succeeded"
    finally:
        ns.close()


def test_a_member_left_waiting_at_the_barrier_reads_the_marks_itself():
    """The first member never ends the job (its write did not reach etcd, its daemon
    stopped): another member, done_recheck after its own mark, reads every mark once
    a period and may end the job itself."""
    ns = Nodes(["a", "b"], limits=JobLimits(min_nodes=2, max_nodes=2, max_restarts=5,
                                            last_call=60.0, join_timeout=600.0),
               done_recheck=0.5)
    try:
        for n in "ab":
            ns.start(n)
        wait_for(lambda: len(ns.got) == 2, 20, what="the round closed")
        other = ns.got["a"].members[1]
        for n in "ab":
            ns.nodes[n].status(ns.got[n])
            ns.nodes[n].mark_done(1)
        # (Before done_recheck it reads none: the case above, at 600 s, shows that.)
        wait_for(lambda: ns.nodes[other].all_done(ns.got[other]), 20,
                 what=f"{other} reading the marks itself")
        assert ns.keys(other).done == {}          # read, not watched
    finally:
        ns.close()
