"""In-process restart across nodes: two real daemons on one real etcd, real gloo ranks.

Every node of an ``--inprocess`` job hosts a job store; the ranks of a round
share the first member's (it outlives any rank). A fault on the second node
is recovered by every rank of both nodes in their own processes; a rank
that dies there is replaced by its own node's daemon and joins the others
through the first node's store.
"""
from __future__ import annotations

import re
import sys

import pytest

from etcd_server import EtcdServer, etcd_binary
from test_multinode import NO_SPARES, Cluster, rank_log, status, submit, wait_done

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary")

PY = sys.executable
TRAIN = [PY, "-m", "elasticd.examples.train_inprocess", "--steps", "60",
         "--crash-at-step", "25", "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def pair():
    with EtcdServer() as etcd:
        c = Cluster(etcd, 2, NO_SPARES + ("--set", "rendezvous.last_call=5"))
        yield c
        c.close()


def iterations(text: str) -> list[tuple[int, int]]:
    return [(int(it), int(pid)) for it, pid in
            re.findall(r"INPROCESS_ITERATION (\d+) rank=\d+ pid=(\d+)", text)]


def run(pair, *extra: str) -> tuple[str, dict]:
    job = submit(pair["n1"], "--inprocess", "--nnodes", "2", "--nproc-per-node", "1",
                 cmd=[*TRAIN, *extra])
    return job, wait_done(pair["n1"], job, timeout=240)


def test_a_fault_on_the_second_node_is_recovered_in_process_on_both(pair):
    job, st = run(pair)
    assert st["state"] == "SUCCEEDED", st
    assert st["restarts"] == 0                          # no process restart on any node
    for node, rank in (("n1", 0), ("n2", 1)):
        text = rank_log(pair[node], job, rank)
        its = iterations(text)
        assert [it for it, _ in its] == [0, 1], text[-2000:]
        assert len({pid for _, pid in its}) == 1        # the same process in both iterations
        assert "all_reduce sum 1 ok" in text
        assert status(pair[node], job)["restarts_by_layer"].get("inprocess") == 1
    assert "injected failure on rank 1 at step 25" in rank_log(pair["n2"], job, 1)


def test_a_rank_dying_on_the_second_node_is_replaced_there(pair):
    job, st = run(pair, "--crash-mode", "exit")
    assert st["state"] == "SUCCEEDED", st
    assert st["restarts"] == 0, st["attempts"]   # replaced in-process, no process restart
    survivor = iterations(rank_log(pair["n1"], job, 0))
    assert [it for it, _ in survivor] == [0, 1] and len({p for _, p in survivor}) == 1
    replaced = rank_log(pair["n2"], job, 1)
    its = iterations(replaced)
    assert [it for it, _ in its] == [0, 1] and its[0][1] != its[1][1], replaced[-2000:]
    n2 = status(pair["n2"], job)
    assert n2["attempts"][-1]["layer"] == "inprocess"
    assert "rank 1 exited with exit code 3" in n2["attempts"][-1]["cause"]
