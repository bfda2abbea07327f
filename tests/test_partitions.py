"""Jepsen-style partitions on real (virtual) networks: every host and etcd
member in its own network namespace (netcluster.py), real daemons, a real
3-member etcd, real gloo workers; the five safety checks of
netcluster_safety.py run after every test.

Each scenario prints what it measured (run with -s): the time from the fault
to the first training step after it, and the job's state events.
"""
from __future__ import annotations

import json
import time

import pytest

from elasticd.v1 import control_pb2 as pb
from netcluster import COLLECTIVE_TIMEOUT, STOP_GRACE, netcluster_fixture, netns_unavailable

REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs network namespaces: {REASON}")

LEASE_TTL = 3.0       # membership.lease_ttl's default, which these daemons keep
STARTUP = 120.0       # submit -> first step: torch imports on a loaded 2-core machine
STEP = 0.05           # seconds a training step sleeps


@pytest.fixture
def netcluster():
    yield from netcluster_fixture()


def training(c, steps: int, nodes=(2, 3)) -> tuple[str, float]:
    """Submit a 3-host training job and wait until a round of all its hosts
    trains: on a loaded machine a host's join may land after the first round
    closed (rendezvous.last_call), and the round that takes it in is growth,
    not the fault a test is about."""
    job = c.submit_training(nodes=nodes, steps=steps, step_seconds=STEP)
    c.wait_steps(job, after=0, count=5, timeout=STARTUP)
    return job, all_hosts_training(c, job, hosts=nodes[1], timeout=STARTUP)


def all_hosts_training(c, job: str, hosts: int, timeout: float) -> float:
    """Time of the first step of the first round with workers on ``hosts``
    hosts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = c.safety.records(job, "step")
        for rnd in sorted({r["round"] for r in steps}):
            ours = [r for r in steps if r["round"] == rnd]
            if len({r["host"] for r in ours}) >= hosts:
                return min(r["t"] for r in ours)
        time.sleep(0.2)
    raise AssertionError(f"no round of {hosts} hosts trained within {timeout:g}s: "
                         f"{c.describe(job)}")


def rounds_after(c, job: str, t: float) -> set[int]:
    """Rounds whose workers first trained after ``t``."""
    steps = c.safety.records(job, "step")
    before = {r["round"] for r in steps if r["t"] <= t}
    return {r["round"] for r in steps if r["t"] > t} - before


def moves(c, job: str, on: str = "h1", since: float | None = None) -> list[str]:
    """The job's state events as ``on`` has them (times relative to ``since``)."""
    return [(f"{e.time - since:+7.2f} s " if since else "") +
            f"{e.node_id}: {pb.JobState.Name(e.from_state)} -> {pb.JobState.Name(e.to_state)}: "
            f"{e.reason}" for e in c.events(job, on) if e.kind == "state"]


def report(title: str, c, job: str, fault_t: float, numbers: dict, on: str = "h1") -> None:
    back = c.safety.first_step_after(job, fault_t)
    new = c.safety.first_new_round_step(job, fault_t)
    print(f"\n== {title}")
    print(f"fault -> first training step after it: "
          f"{'none' if back is None else f'{back:.2f} s'}; first step of a later round: "
          f"{'none (no new round)' if new is None else f'{new:.2f} s'}")
    print(f"safety numbers: {numbers}")
    print("state events seen on", on + ":\n  " + "\n  ".join(moves(c, job, on, fault_t)))
    for r in c.safety.records(job, "error"):
        print(f"  worker error {r['t'] - fault_t:+7.2f} s rank {r['rank']} round {r['round']} "
              f"on {r['host']}: {r['error'][:150]}")


def round_ended(c, job: str, after: float, timeout: float, on: str = "h1") -> float:
    """Time of the first state event (on any node, as ``on`` has them) that
    left RUNNING after ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ends = [e.time for e in c.events(job, on) if e.kind == "state" and e.time > after
                and pb.JobState.Name(e.from_state) == "RUNNING"]
        if ends:
            return min(ends)
        time.sleep(0.2)
    raise AssertionError(f"the round did not end within {timeout:g}s: {c.describe(job)}")


def restarts(c, job: str, on: str = "h1") -> int:
    return c.job(job, on).restarts


def lives_on(c, job: str, host: str) -> list:
    return [lf for lf in c.safety.lives.values() if lf.job == job and lf.host == host]


# ---------------------------------------------------------------- one host cut off

@pytest.mark.slow  # a partition case: namespaces, three hosts and a lease expiry
def test_host_cut_off_from_etcd_only(netcluster):
    """h3 reaches its peers but not etcd: its lease expires, the others stop
    their workers and go on as two; h3's workers are gone within the TTL plus
    the grace; after the heal h3 registers again and rejoins (scale-up
    policy: immediate)."""
    c = netcluster(hosts=3)
    job, _ = training(c, steps=160)
    before = {lf.pid for lf in lives_on(c, job, "h3")}
    t = c.isolate_from_etcd("h3")
    c.wait_steps(job, after=t + LEASE_TTL, count=3, timeout=60)
    c.safety.poll()
    h3_last = max(lf.last_seen for lf in c.safety.lives.values() if lf.pid in before)
    healed = c.heal()
    final = c.wait_job(job, timeout=180)
    numbers = c.safety.check()
    report("h3 cut off from etcd only", c, job, t, numbers)
    print(f"h3's workers last seen {h3_last - t:.2f} s after the cut; "
          f"healed at +{healed - t:.1f} s")
    assert pb.JobState.Name(final.state) == "SUCCEEDED", c.describe(job)
    # its workers fail as soon as their peers are stopped; torch's teardown
    # may then take seconds on a loaded machine: hence the slack
    assert h3_last - t <= LEASE_TTL + STOP_GRACE + 5.0, "h3's workers outlived the TTL + grace"
    assert any("h3" in m and "lost" in m for m in moves(c, job)), moves(c, job)


@pytest.mark.slow
def test_host_cut_off_from_peers_only(netcluster):
    """h3 reaches etcd but not h1/h2: its lease lives, so only the failing
    collectives tell; each round fails within the collective timeout (no
    hang), new rounds form, and after the heal the job finishes."""
    c = netcluster(hosts=3)
    job, _ = training(c, steps=160)
    t = c.isolate_from_peers("h3")
    # the collective fails and the round ends while the partition lasts: no hang
    ended = round_ended(c, job, after=t, timeout=COLLECTIVE_TIMEOUT + STOP_GRACE + 20)
    healed = c.heal()
    final = c.wait_job(job, timeout=240)
    numbers = c.safety.check()
    report("h3 cut off from its peers only", c, job, t, numbers)
    back = c.safety.first_step_after(job, healed)
    print(f"fault -> round ended: {ended - t:.2f} s; heal (at +{healed - t:.1f} s) -> first "
          f"step: {back:.2f} s")
    assert pb.JobState.Name(final.state) == "SUCCEEDED", c.describe(job)
    assert restarts(c, job) >= 1


# ---------------------------------------------------------------- etcd members

def _leader_away_from(c, member: str) -> str:
    """Make sure ``member`` is not etcd's leader; returns the leader."""
    leader = c.etcd_leader()
    if leader != member:
        return leader
    other = next(n for n in c.etcd_names if n != member)
    r = c.etcd[leader].etcdctl("endpoint", "status", "-w", "json",
                               "--endpoints", c.etcd[other].url)
    target = format(json.loads(r.stdout)[0]["Status"]["header"]["member_id"], "x")
    r = c.etcd[leader].etcdctl("move-leader", target)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 15
    while c.etcd_leader() == member and time.monotonic() < deadline:
        time.sleep(0.2)
    return c.etcd_leader()


@pytest.mark.slow
def test_minority_etcd_member_cut_off_no_restart(netcluster):
    """e0, the first etcd endpoint every daemon is given and not the leader,
    is cut off from everyone: the daemons go on through e1/e2 and training is
    never restarted."""
    c = netcluster(hosts=3)
    _leader_away_from(c, "e0")
    job, _ = training(c, steps=150)
    t = c.isolate("e0")
    c.wait_steps(job, after=t + 2 * LEASE_TTL, count=3, timeout=60)
    c.heal()
    final = c.wait_job(job, timeout=180)
    numbers = c.safety.check()
    report("minority etcd member cut off", c, job, t, numbers)
    assert pb.JobState.Name(final.state) == "SUCCEEDED", c.describe(job)
    assert final.restarts == 0, moves(c, job)
    assert not rounds_after(c, job, t), moves(c, job, since=t)


@pytest.mark.slow
def test_etcd_leader_cut_off(netcluster):
    """The etcd leader is cut off from everyone: a new leader is elected; at
    most one round change, the job is not lost."""
    c = netcluster(hosts=3)
    job, _ = training(c, steps=150)
    leader = c.etcd_leader()
    t = c.isolate(leader)
    c.wait_steps(job, after=t + 2 * LEASE_TTL, count=3, timeout=90)
    c.heal()
    final = c.wait_job(job, timeout=180)
    numbers = c.safety.check()
    report(f"etcd leader ({leader}) cut off", c, job, t, numbers)
    assert pb.JobState.Name(final.state) == "SUCCEEDED", c.describe(job)
    assert len(rounds_after(c, job, t)) <= 1, moves(c, job, since=t)


@pytest.mark.slow
def test_latency_and_loss_on_every_etcd_link(netcluster):
    """200 ms each way between the daemons and etcd and 5 % of etcd's
    packets dropped, for the whole job: it trains and finishes, and lease
    refreshes that come late are never taken for a lost node."""
    c = netcluster(hosts=3, etcd_relay=True)
    c.latency(200)
    c.net.loss(c.etcd_names, 5)
    t = c.note("200 ms + 5 % loss on every etcd link")
    job, _ = training(c, steps=120, nodes=(3, 3))
    final = c.wait_job(job, timeout=240)
    numbers = c.safety.check()
    report("200 ms latency + 5 % loss on etcd links", c, job, t, numbers)
    assert pb.JobState.Name(final.state) == "SUCCEEDED", c.describe(job)
    assert final.restarts == 0, moves(c, job)
    assert not any("lost" in m for m in moves(c, job)), moves(c, job)


# ---------------------------------------------------------------- a daemon frozen

@pytest.mark.slow
def test_daemon_stopped_10s_is_replaced_and_runs_nothing_stale(netcluster):
    """SIGSTOP h3's daemon for 10 s: its lease expires, h1/h2 go on as two;
    when it resumes it runs no worker of the old round next to the new one
    (the safety checker's property 1)."""
    c = netcluster(hosts=3)
    job, _ = training(c, steps=220)
    t = c.freeze("h3")
    c.wait_steps(job, after=t + LEASE_TTL, count=3, timeout=60)
    time.sleep(max(0.0, t + 10 - time.time()))
    c.thaw("h3")
    final = c.wait_job(job, timeout=180)
    numbers = c.safety.check()
    report("h3's daemon SIGSTOPped 10 s", c, job, t, numbers)
    assert pb.JobState.Name(final.state) == "SUCCEEDED", c.describe(job)
    assert any("h3" in m and "lost" in m for m in moves(c, job)), moves(c, job)
