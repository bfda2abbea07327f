"""A job's rounds and phase records reach its own nodes and no other: four real
daemons on one real etcd, job A on n1+n2 and job B on n3+n4 (plain sleeping workers).
Within a job, the records reach its round's first member only, and the digest it folds
them into (hangs/phase_digest.py, ``kind="phasedigests"``) the job's other node only.

Each daemon counts what its store watches receive by the kind of key
(``elasticd_store_watch_events_total{kind="phases"}``, counted where the watch
events enter the daemon, whatever watch asked for them). etcd's own history
says how many changes the phase records of each job had over the test. A node
of A may have received at most A's changes; had it received B's too (every
daemon watching every job's keys), it would count more than A's. Each node
watches the job's records while it runs it (``elasticd_phase_watches``: 1) and
stops when the job ends there (0).

No daemon receives the node records' rewrites (``kind="nodes"``: its node watch
is of deletes only, cluster/membership.py), though every node rewrote its own.

The same for a job's events (``kind="events"``, cluster/eventlog.py), its rounds
(its state and decider under /v1/rounds/<job>/, rendezvous/view.py,
``kind="rounds"``) and its joins and done marks (/v1/joins/<job>/, ``kind="joins"``:
whole only where a node decides a round or is its first member):
a node may have received its own job's changes there and none of the other's.
The nodes' worker rows (/v1/workers/<job>/, ``kind="workers"``) reach no node at
all, though each node rewrote its own: status lists them when asked.

Before the phase records moved (rendezvous/phase_watch.py), each of them reached
every daemon through its watch of /v1/jobs: n3 received A's as well as B's; so
did every join and worker row before the rounds moved out of the job list.

A job submitted on a node that runs none of it (n3 submits C for n1+n2) is adopted
by the nodes it names, shown from n3 (its workers read from its rounds on demand)
and cancelled from there.
"""
from __future__ import annotations

import concurrent.futures
import re

import pytest

from daemons import free_port, scrape
from etcd_server import EtcdServer, etcd_binary
from test_multinode import NO_SPARES, PY, Cluster, status, submit, wait_for

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary")

SLEEP = [PY, "-c", "import time; time.sleep(300)"]
JOBS = {"A": ("n1", "n2"), "B": ("n3", "n4")}


@pytest.fixture(scope="module")
def quad():
    with EtcdServer() as etcd:
        c = Cluster(etcd, 0, NO_SPARES + ("--set", "agent.phase_refresh_interval=1"))
        ports = {f"n{i}": free_port() for i in range(1, 5)}
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda n: c.add(n, ("--metrics-port", str(ports[n]))), ports))
            yield c, ports
        finally:
            c.close()


def metric(port: int, name: str) -> float:
    """One sample's value from the daemon's scrape (0 if absent)."""
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", scrape(port), re.M)
    return float(m.group(1)) if m else 0.0


PHASE_EVENTS = 'elasticd_store_watch_events_total{kind="phases"}'
ROUND_EVENTS = 'elasticd_store_watch_events_total{kind="rounds"}'
JOB_EVENTS = 'elasticd_store_watch_events_total{kind="events"}'
NODE_EVENTS = 'elasticd_store_watch_events_total{kind="nodes"}'
JOIN_EVENTS = 'elasticd_store_watch_events_total{kind="joins"}'
ROW_EVENTS = 'elasticd_store_watch_events_total{kind="workers"}'
DIGEST_EVENTS = 'elasticd_store_watch_events_total{kind="phasedigests"}'


def changes_since(store, folder: str, since: int, jobs: dict) -> dict:
    """Every change the keys of each job had under /v1/<folder>/, from etcd's history."""
    changes = {name: 0 for name in jobs}
    for ev in store.watch(f"/v1/{folder}/", since, timeout=2.0):
        changes[next(n for n in jobs if ev.key.startswith(f"/v1/{folder}/{jobs[n]}/"))] += 1
    return changes


def test_a_nodes_watches_get_the_phase_records_of_its_own_job_only(quad):
    from elasticd.store import open_store
    c, ports = quad
    store = open_store("etcd3", [c.etcd.url], prefix=c.prefix)
    try:
        _, since = store.list("/v1/phases/")
        jobs = {name: submit(c[nodes[0]], "--nnodes", "2", "--nodes", ",".join(nodes), cmd=SLEEP)
                for name, nodes in JOBS.items()}
        for name, nodes in JOBS.items():
            for node in nodes:
                c[node].wait_state(jobs[name], "RUNNING", 90)
        # Each node watches its job's records (the first member) or their digest (the
        # other) and received some (the refreshes).
        wait_for(lambda: all(metric(p, "elasticd_phase_watches") == 1
                             and metric(p, PHASE_EVENTS) + metric(p, DIGEST_EVENTS) >= 2
                             for p in ports.values()),
                 60, "every node watching its job's phase records or digest and receiving them")
        # A job that runs elsewhere still shows from a node that does not run it.
        assert status(c["n4"], jobs["A"])["state"] == "RUNNING"
        for name, nodes in JOBS.items():
            c[nodes[0]].ctl("cancel", jobs[name])
        for name, nodes in JOBS.items():
            for node in nodes:
                c[node].wait_state(jobs[name], "CANCELLED", 60)
        wait_for(lambda: all(metric(p, "elasticd_phase_watches") == 0 for p in ports.values()),
                 30, "every node's phase watch closed once its job ended there")
        got = {node: metric(p, PHASE_EVENTS) for node, p in ports.items()}
        digests = {node: metric(p, DIGEST_EVENTS) for node, p in ports.items()}
        digest_changes = changes_since(store, "phasedigests", since, jobs)
        rounds = {node: metric(p, ROUND_EVENTS) for node, p in ports.items()}
        events = {node: metric(p, JOB_EVENTS) for node, p in ports.items()}
        joins = {node: metric(p, JOIN_EVENTS) for node, p in ports.items()}
        rows = {node: metric(p, ROW_EVENTS) for node, p in ports.items()}
        row_changes = changes_since(store, "workers", since, jobs)
        join_changes = changes_since(store, "joins", since, jobs)
        changes = changes_since(store, "phases", since, jobs)
        round_changes = changes_since(store, "rounds", since, jobs)
        event_changes = changes_since(store, "events", since, jobs)
        node_records = {node: metric(p, NODE_EVENTS) for node, p in ports.items()}
        node_changes = list(store.watch("/v1/nodes/", since, timeout=2.0))
    finally:
        store.close()
    # Every node rewrote its record as its job started and ended (free slots, jobs);
    # no daemon received one of those rewrites (its node watch is of deletes only).
    assert {ev.key.rsplit("/", 1)[-1] for ev in node_changes} == set(ports), node_changes
    assert node_records == {node: 0 for node in ports}, (node_records, len(node_changes))
    assert all(n >= 4 for n in changes.values()), changes
    assert all(n >= 4 for n in round_changes.values()), round_changes
    # Both nodes of each job published their rows (as they started and as they
    # stopped); no node received one.
    assert all(n >= 2 for n in row_changes.values()), row_changes
    assert rows == {node: 0 for node in ports}, (rows, row_changes)
    assert all(n >= 2 for n in digest_changes.values()), digest_changes
    for name, nodes in JOBS.items():
        # One node of the job (its round's first member) received the records and no
        # digest; the other received the digests and no record.
        first = [node for node in nodes if got[node]]
        assert len(first) == 1, (got, digests)
        other = next(node for node in nodes if node != first[0])
        assert digests[first[0]] == 0 and got[other] == 0, (got, digests)
        assert 2 <= got[first[0]] <= changes[name], (
            f"{first[0]} runs job {name} only: it may receive that job's {changes[name]} "
            f"phase record changes and no other job's; it received {got[first[0]]:.0f} "
            f"(all: {got}, changes per job: {changes})")
        assert 2 <= digests[other] <= digest_changes[name], (digests, digest_changes)
        for node in nodes:
            assert 2 <= rounds[node] <= round_changes[name], (
                f"{node} runs job {name} only: it may receive that job's "
                f"{round_changes[name]} changes of its rounds and no other job's; it "
                f"received {rounds[node]:.0f} (all: {rounds}, per job: {round_changes})")
            assert joins[node] <= join_changes[name], (
                f"{node} runs job {name} only: it may receive that job's "
                f"{join_changes[name]} join changes and no other job's; it received "
                f"{joins[node]:.0f} (all: {joins}, per job: {join_changes})")
            assert events[node] <= event_changes[name], (
                f"{node} runs job {name} only: it may receive that job's "
                f"{event_changes[name]} job events and no other job's; it received "
                f"{events[node]:.0f} (all: {events}, per job: {event_changes})")


def test_a_job_submitted_where_none_of_it_runs_is_adopted_shown_and_cancelled_there(quad):
    c, ports = quad
    job = submit(c["n3"], "--nnodes", "2", "--nodes", "n1,n2", cmd=SLEEP)
    for node in ("n1", "n2"):
        c[node].wait_state(job, "RUNNING", 90)
    before = metric(ports["n3"], ROUND_EVENTS)
    shown = wait_for(lambda: (st := status(c["n3"], job))["state"] == "RUNNING"
                     and len(st["workers"]) == 2 and st, 30,
                     "n3 showing the job running with both nodes' workers")
    assert {w["node_id"] for w in shown["workers"]} == {"n1", "n2"}, shown
    assert metric(ports["n3"], ROUND_EVENTS) == before, "n3 received rounds of a job it " \
        "does not run"
    c["n3"].ctl("cancel", job)
    for node in ("n1", "n2", "n3"):
        c[node].wait_state(job, "CANCELLED", 60)
