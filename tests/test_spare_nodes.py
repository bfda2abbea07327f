"""Spare nodes (issue #36), end to end: three real daemons on one real etcd, real torch workers.

A job that needs exactly two nodes and keeps one spare (``--nnodes 2:2
--spares 1``): the third node stands by without ranks, its worker template
warm, shown by ``status`` and ``nodes``. A worker fault restarts the job on
its two members (the spare, joining the round too, is one more node than max
and stands by again: more live nodes than max never fails a job). A member's
daemon killed with -9 (its workers die with it) is replaced by the spare at
once, in the lost node's group rank, at the same world size: the job never
runs on fewer nodes, and trains on; the lost node, back, stands by in turn.
"""
from __future__ import annotations

import os
import time

import pytest

from test_multinode import (  # noqa: F401 (etcd, make_cluster: fixtures)
    LEASE_TTL, check_envs, etcd, events, local_rows, make_cluster, polled, rank_log,
    running_on, state_moves, status, submit, wait_done, wait_for)

pytestmark = pytest.mark.slow   # a 2-node job trained through two faults: most of a minute

STEPS = 100_000      # trains until cancelled, through both faults


def standing_by(d, job: str) -> list[str]:
    return polled(d, job).get("spare_nodes", [])


def round_envs(c, job: str, after: int = 0) -> list[dict]:
    """Both ranks' environments of the job's newest round past ``after``, once both
    ranks wrote theirs (each writes it as it starts: one may come a moment later)."""
    def both():
        envs = c.envs(job)
        return envs if len(envs) == 2 and int(envs[0]["ELASTICD_ROUND"]) > after else None
    return wait_for(both, 60, f"both ranks of a round after round {after} started",
                    interval=0.1)


def members(d, job: str) -> set[str]:
    return {w["node_id"] for w in polled(d, job).get("workers", [])
            if w["state"] == "running"}


def test_a_spare_stands_by_and_takes_a_lost_members_place_at_the_same_world_size(
        make_cluster):
    c = make_cluster(3)
    job = submit(c["n1"], "--nnodes", "2:2", "--spares", "1", "--max-restarts", "3",
                 cmd=c.train_cmd("spare", "--steps", str(STEPS), "--step-time", "0.05",
                                 "--checkpoint-every", "10", "--log-every", "1000"))
    # Any of the three may be the spare, n1 too: its own status then says RENDEZVOUS
    # (standing by), so the job's state is asked of a member.
    def on_two() -> set[str] | None:
        running = members(c["n1"], job)
        return running if len(running) == 2 else None
    first = wait_for(on_two, 90, "ranks running on two nodes", interval=0.3)
    member = min(first)
    running_on(c[member], job, 2)
    spare = wait_for(lambda: standing_by(c["n1"], job), 60, "a node standing by")
    assert len(spare) == 1, spare
    spare = spare[0]
    assert spare not in first, (spare, first)
    st = status(c[spare], job)
    assert st["spares"] == 1
    assert "standing by as a spare node" in st["reason"], st["reason"]
    assert not local_rows(c[spare], job), "a spare runs no ranks"
    nodes = c["n1"].ctl("nodes").stdout
    assert f"{job} (spare)" in nodes, nodes
    # its worker template warms while it stands by: what a takeover starts from
    wait_for(lambda: polled(c[spare], job).get("template_state") == "ready", 90,
             "the spare's worker template to be ready", interval=0.3)

    # A worker fault: the round after it has three nodes for two places; the members
    # rejoin first and keep them, the spare stands by again.
    node_of = {int(e["RANK"]): e["ELASTICD_NODE_ID"] for e in round_envs(c, job)}
    wait_for(lambda: "FIRST_STEP" in rank_log(c[node_of[0]], job, 0), 90, "the first step",
             interval=0.3)
    victim_rank = 1
    row = local_rows(c[node_of[victim_rank]], job)[0]
    os.kill(row["pid"], 9)
    wait_for(lambda: (polled(c[member], job)["round"] >= 2 and members(c[member], job) == first
                      and polled(c[member], job)["state"] == "RUNNING"), 60,
             "the job running again on its two members", interval=0.3)
    wait_for(lambda: standing_by(c["n1"], job) == [spare], 30, "the spare standing by again",
             interval=0.3)
    assert {e["ELASTICD_NODE_ID"] for e in round_envs(c, job, after=1)} == first

    # A member node lost: kill -9 of a member's daemon; asked from another node.
    envs = round_envs(c, job, after=1)
    node_of = check_envs(envs, job, nodes=2, nproc=1)
    lost = max(first)
    asked = min({"n1", "n2", "n3"} - {lost})
    lost_rank = next(int(e["GROUP_RANK"]) for e in envs if e["ELASTICD_NODE_ID"] == lost)
    rnd = int(envs[0]["ELASTICD_ROUND"])
    wait_for(lambda: "FIRST_STEP" in rank_log(c[node_of[0]], job, 0), 90,
             "a step of the restarted round", interval=0.3)
    c.remember_children()
    t0 = time.monotonic()
    c[lost].kill()
    took = wait_for(lambda: [e for e in c.envs(job) if int(e["ELASTICD_ROUND"]) > rnd
                             and e["ELASTICD_NODE_ID"] == spare], 30 + LEASE_TTL,
                    "the spare to start ranks")
    print(f"spare {spare} started group rank {took[0]['GROUP_RANK']} "
          f"{time.monotonic() - t0:.2f}s after kill -9 of {lost}")
    envs = round_envs(c, job, after=rnd)
    assert {e["ELASTICD_NODE_ID"] for e in envs} == (first - {lost}) | {spare}
    node_of = check_envs(envs, job, nodes=2, nproc=1)
    assert int(next(e for e in envs if e["ELASTICD_NODE_ID"] == spare)["GROUP_RANK"]) \
        == lost_rank, "the spare takes the lost node's group rank; the survivor keeps its own"
    # training goes on, at world size 2, from the new round's first step
    attempt = envs[0]["TORCHELASTIC_RESTART_COUNT"]
    began = f"attempt {attempt}: world size 2"
    wait_for(lambda: "FIRST_STEP" in rank_log(c[node_of[0]], job, 0).partition(began)[2], 60,
             "a training step of the round with the spare", interval=0.3)
    print(f"training again at world size 2 {time.monotonic() - t0:.2f}s after the kill")
    # The lost node comes back (its daemon restarted on the same state dir): the job has
    # its max nodes, so it stands by as the spare; none of its old workers shows running.
    c[lost].start()
    wait_for(lambda: standing_by(c[asked], job) == [lost], 60, "the node back as the spare",
             interval=0.3)
    assert not [w for w in local_rows(c[lost], job) if w["state"] == "running"], \
        local_rows(c[lost], job)
    assert c[asked].ctl("cancel", job).returncode == 0
    final = wait_done(c[asked], job, 60)
    assert final["state"] == "CANCELLED", final
    # never on fewer nodes: every round of the job ran on two
    moves = state_moves(events(c[asked], job))
    runs = [why for _, to, why in moves if to == "RUNNING"]
    assert len(runs) >= 3 and all("of 2 on 2 node(s)" in why for why in runs), moves
    said = [e.get("reason", "") for e in events(c[spare], job) if e["kind"] == "spare"]
    assert any("standing by as a spare node" in s for s in said), said
    assert any("this spare node takes group rank" in s and lost in s for s in said), said
