"""A node that cannot reach etcd must not run its last round again.

Found on real networks (test_partitions.py, a host cut off from etcd only):
the node's worker failed, its ask for a new round could not reach etcd, and
``next_round``, reading the node's stale view (the old round still closed,
the node a member), started that old round again beside the round its peers
had formed. Here the same on the in-memory store: one node's view is frozen
at what it saw last and its writes fail, as when it is cut off.
"""
from __future__ import annotations

import threading
import time

from elasticd.rendezvous.round import ClusterRendezvous, create_job
from elasticd.rendezvous.protocol import JobLimits
from elasticd.rendezvous.view import JobsView
from elasticd.store import StoreUnavailable, open_store
from elasticd.trust.sealed import PLAIN


class CutOff:
    """One node's side of a partition from etcd: its view stays as it was
    (it hears nothing), its writes fail; ``heal()`` lets both through."""

    def __init__(self, store, view: JobsView):
        self.store, self.view = store, view
        self.records = view.records
        self.cut = False
        self._snapshot: dict = {}
        self._revision = 0

    def partition(self, job_id: str) -> None:
        self._snapshot, self._revision = {job_id: self.view.job(job_id)}, self.view.revision
        self.cut = True

    def heal(self) -> None:
        self.cut = False

    # the view's side
    @property
    def revision(self) -> int:
        return self._revision if self.cut else self.view.revision

    def job(self, job_id: str):
        return self._snapshot.get(job_id) if self.cut else self.view.job(job_id)

    def follow(self, job_id: str) -> None:
        self.view.follow(job_id)

    def unfollow(self, job_id: str) -> None:
        self.view.unfollow(job_id)

    def caught_up(self, job_id: str, revision: int) -> bool:
        # cut off, its view holds what it wrote before (nothing it writes gets through)
        return True if self.cut else self.view.caught_up(job_id, revision)

    def watch_joins(self, job_id: str, rnd: int = 0, asker=None) -> None:
        if not self.cut:
            self.view.watch_joins(job_id, rnd, asker)

    def let_go_joins(self, job_id: str, asker) -> None:
        self.view.let_go_joins(job_id, asker)

    def joins_caught_up(self, job_id: str, revision: int = 0) -> bool:
        return True if self.cut else self.view.joins_caught_up(job_id, revision)

    def read_join(self, key: str, value: str):
        return self.view.read_join(key, value)

    def listed_state(self, job_id: str):
        return (None, 0) if self.cut else self.view.listed_state(job_id)

    def wait(self, timeout: float, seen=None, stop=None) -> None:
        if self.cut:
            time.sleep(min(timeout, 0.05))
        else:
            self.view.wait(timeout, seen, stop)

    # the store's side
    def __getattr__(self, name):
        real = getattr(self.store, name)
        if not callable(real):
            return real

        def call(*args, **kwargs):
            if self.cut:
                raise StoreUnavailable("cut off from etcd (test)")
            return real(*args, **kwargs)
        return call


def next_round_as_the_agent(p: ClusterRendezvous, stop: threading.Event):
    """As Agent._loop: a store error interrupts the rendezvous; try again."""
    while True:
        try:
            return p.next_round(stop)
        except StoreUnavailable:
            time.sleep(0.05)


def test_a_node_cut_off_from_etcd_does_not_run_its_last_round_again():
    store = open_store("memory")
    view = JobsView(store, records=PLAIN, retry=0.1)
    view.start()
    assert view.synced.wait(10)
    limits = JobLimits(min_nodes=2, max_nodes=2, max_restarts=5, last_call=0.0,
                       join_timeout=60.0)
    lease = store.grant_lease(60)
    cut = CutOff(store, view)
    a = ClusterRendezvous(cut, cut, "j1", "a", "10.0.0.1", 1, lambda: lease, limits, poll=0.05)
    b = ClusterRendezvous(store, view, "j1", "b", "10.0.0.2", 1, lambda: lease, limits,
                          poll=0.05)
    stop = threading.Event()
    try:
        create_job(store, "j1", {"id": "j1", "nodes": []}, time.time(), records=PLAIN)
        got = {}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p.node_id,
                                                                         p.next_round(stop)))
                   for p in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert got["a"].place.round == got["b"].place.round == 1 \
            and got["a"].place.group_world_size == 2

        cut.partition("j1")
        # a's worker fails; its ask for a new round cannot get through
        try:
            a.reopen(got["a"], "rank 0 exited with exit code 1", True)
        except StoreUnavailable:
            pass
        again = {}
        waiter = threading.Thread(target=lambda: again.__setitem__(
            "a", next_round_as_the_agent(a, stop)))
        waiter.start()
        waiter.join(1.0)
        assert "a" not in again, f"a ran round {again['a'].place.round} again while cut off"

        cut.heal()  # a's ask goes through now: the next round forms with both
        b_next = {}
        tb = threading.Thread(target=lambda: b_next.__setitem__("b", b.next_round(stop)))
        tb.start()
        waiter.join(20)
        tb.join(20)
        assert again["a"].place.round == b_next["b"].place.round == 2, (again, b_next)
    finally:
        stop.set()
        with view.changed:
            view.changed.notify_all()
        view.stop()
