"""A chaos soak on the namespace cluster (netcluster.py): one training job,
a random fault every few seconds for the soak's length, then every fault
healed; the job must end SUCCEEDED (or FAILED for a reason the faults
justify, stated in its record), the five safety checks must hold for the
whole run, and nothing may be left running.

The short soak runs by default; the long one (4 hosts, a few minutes) is
marked slow. ``ED19_SOAK_SEED`` replays a run (each prints its seed); the
counts (faults, rounds, restarts by layer, longest time without a training
step) are printed (run with -s).
"""
from __future__ import annotations

import os
import random
import re
import time

import pytest

from elasticd.v1 import control_pb2 as pb
from netcluster import netcluster_fixture, netns_unavailable

REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs network namespaces: {REASON}")

STARTUP = 120.0  # submit -> first step: torch imports on a loaded 2-core machine


@pytest.fixture
def netcluster():
    yield from netcluster_fixture()


# The reasons the faults can justify a FAILED job, as rendezvous/protocol.py words them:
# its restarts used up, or fewer nodes than it needs joined a round within the join timeout.
NO_RESTARTS_LEFT = re.compile(r"\bno restarts left (\(\d+ of \d+ used\)|in the window \()")
TOO_FEW_NODES = re.compile(r"only (\d+) of the (\d+) nodes the job needs joined round \d+ "
                           r"within [\d.]+s \(joined: ")


def justified(state: str, reason: str) -> bool:
    """The job ended as the faults allow: SUCCEEDED, or FAILED for one of the reasons above."""
    if state == "SUCCEEDED":
        return True
    too_few = TOO_FEW_NODES.search(reason)
    return state == "FAILED" and (NO_RESTARTS_LEFT.search(reason) is not None or (
        too_few is not None and int(too_few[1]) < int(too_few[2])))


KINDS = ("etcd-only", "peers-only", "etcd-member", "etcd-leader", "kill-daemon",
         "stop-daemon", "kill-etcd", "loss")


class Chaos:
    """One fault at a time: inject, hold a few seconds, undo."""

    def __init__(self, c, rng: random.Random):
        self.c, self.rng = c, rng
        self.counts: dict[str, int] = {}
        self.deck: list[str] = []

    def one(self, hold: float) -> None:
        c, rng = self.c, self.rng
        host = rng.choice(c.host_names)
        if not self.deck:  # every kind once, in random order, then again
            self.deck = list(KINDS)
            rng.shuffle(self.deck)
        kind = self.deck.pop()
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "etcd-only":
            c.isolate_from_etcd(host)
            time.sleep(hold)
            c.heal()
        elif kind == "peers-only":
            c.isolate_from_peers(host)
            time.sleep(hold)
            c.heal()
        elif kind == "etcd-member":
            c.isolate(rng.choice(c.etcd_names))
            time.sleep(hold)
            c.heal()
        elif kind == "etcd-leader":
            c.isolate(c.etcd_leader())
            time.sleep(hold)
            c.heal()
        elif kind == "kill-daemon":
            c.kill(host)
            time.sleep(hold)
            c.restart(host)
        elif kind == "stop-daemon":
            c.freeze(host)
            time.sleep(hold)
            c.thaw(host)
        elif kind == "kill-etcd":
            member = rng.choice(c.etcd_names)
            c.kill(member)
            time.sleep(hold)
            c.restart(member)
        else:
            c.note("5 % loss on etcd's links")
            c.net.loss(c.etcd_names, 5)
            time.sleep(hold)
            c.heal()


def soak(c, seconds: float, steps: int, nodes: tuple, seed: int) -> dict:
    rng = random.Random(seed)
    job = c.submit_training(nodes=nodes, steps=steps, step_seconds=0.05, max_restarts=100)
    c.wait_steps(job, after=0, count=3, timeout=STARTUP)
    chaos = Chaos(c, rng)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pb.JobState.Name(c.job(job).state) in ("SUCCEEDED", "FAILED", "CANCELLED"):
            break
        chaos.one(hold=rng.uniform(2.0, 6.0))
        time.sleep(rng.uniform(1.0, 4.0))
    faults_over = c.note("faults over")
    try:
        final = c.wait_job(job, timeout=300)
        numbers = c.safety.check()[job]
    finally:
        print(f"\nchaos soak timeline (seed {seed}):")
        t0 = c.faults[0][0]
        lines = [(t, what) for t, what in c.faults]
        try:
            lines += [(e.time, f"    {e.node_id}: {pb.JobState.Name(e.from_state)} -> "
                               f"{pb.JobState.Name(e.to_state)}: {e.reason[:110]}")
                      for e in c.events(job) if e.kind == "state" and e.time >= t0]
        except Exception as exc:  # noqa: BLE001 - the timeline is for reading only
            lines.append((t0, f"(no events: {exc})"))
        for t, what in sorted(lines):
            print(f"  {t - t0:7.2f} s  {what}")
    numbers.update(faults=sum(chaos.counts.values()), by_kind=chaos.counts,
                   restarts=final.restarts, state=pb.JobState.Name(final.state),
                   reason=final.reason, seed=seed,
                   done_after_faults_s=round(time.time() - faults_over, 1))
    print(f"\nchaos soak ({seconds:g} s, {len(c.host_names)} hosts): {numbers}")
    # FAILED only for a reason the faults justify: restarts used up or too few nodes.
    assert justified(numbers["state"], final.reason), numbers
    return numbers


def _seed() -> int:
    return int(os.environ.get("ED19_SOAK_SEED") or random.SystemRandom().randrange(1 << 30))


@pytest.mark.slow  # a soak: three namespaced hosts and a minute of faults
def test_chaos_soak_short(netcluster):
    c = netcluster(hosts=3)
    soak(c, seconds=15, steps=250, nodes=(2, 3), seed=_seed())


@pytest.mark.slow
def test_chaos_soak_long(netcluster):
    c = netcluster(hosts=4)
    soak(c, seconds=60, steps=400, nodes=(2, 4), seed=_seed())
