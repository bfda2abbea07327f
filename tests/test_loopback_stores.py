"""A job on one node keeps its stores on loopback (issue 29, item 6).

A real root daemon whose advertised address is this host's own network
address (not loopback), a real unprivileged user made here, real torch gloo
ranks: a single-node job's rank 0 store (MASTER_PORT, ``init_process_group``
through ``env://``) and its in-process job store listen on 127.0.0.1 alone,
where torch's store would listen on every interface and the job store on the
advertised address. Jobs across nodes keep the advertised address
(tests/test_multinode.py, tests/test_inprocess_multinode.py).
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket

import psutil
import pytest

from daemons import DaemonProc, short_tmpdir
from elasticd.v1 import control_pb2 as pb
from test_local_trust import NOGROUP, PY, real_users, submit_as, submitted, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: a real user is created and the daemon "
                                       "switches to it (CI runs as root)")

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
USER = f"h29l_alice{_WORKER}"
TRAIN = """
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 0:
    print("STORES", os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"],
          os.environ.get("ELASTICD_STORE_ADDR", "-"), os.environ.get("ELASTICD_STORE_PORT", "0"),
          flush=True)
deadline = time.time() + 120
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.1)
dist.destroy_process_group()
"""


def own_address() -> str | None:
    """This host's address on its way out (not loopback), or None."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


@pytest.fixture(scope="module")
def user():
    with real_users((USER,), "h29l-home-") as made:
        yield next(iter(made.values()))


@pytest.fixture
def node(user):
    address = own_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    d = DaemonProc(short_tmpdir(), slots=2, extra_args=(
        "--set", f"daemon.socket_group={NOGROUP}", "--set", f"daemon.address={address}"))
    try:
        yield d.start()
    finally:
        d.cleanup()


def listening(port: int) -> list[str]:
    """The addresses something listens on at TCP ``port``."""
    return sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port})


def test_a_single_node_jobs_stores_listen_on_loopback_alone(node, user):
    work = user.mkdir(os.path.join(user.home, "work"))
    with open(os.path.join(work, "train.py"), "w") as fh:
        fh.write(TRAIN)
    go = os.path.join(work, "go")
    job_id = submitted(submit_as(node, user, "--nproc-per-node", "2", "--inprocess", "--",
                                 PY, os.path.join(work, "train.py"), go, cwd=work))
    line = wait_for(lambda: [ln for ln in _log(node, job_id).splitlines()
                             if ln.startswith("STORES ")], 180, "rank 0's stores",
                    lambda: _log(node, job_id)[-3000:] + node.log()[-3000:])[0]
    try:
        _, master_addr, master_port, store_addr, store_port = line.split()
        assert master_addr == "127.0.0.1" and store_addr == "127.0.0.1", line
        for port in (int(master_port), int(store_port)):
            where = listening(port)
            assert where and all(ipaddress.ip_address(a).is_loopback for a in where), \
                (port, where)
    finally:
        open(go, "w").close()
    job = node.wait_job(job_id, timeout=120)
    assert job.state == pb.SUCCEEDED, _log(node, job_id)[-3000:]
    status = json.loads(node.ctl("-o", "json", "status", job_id).stdout)
    assert status["state"] == "SUCCEEDED"


def _log(node, job_id: str) -> str:
    try:
        return node.rank_log(job_id, 0)
    except FileNotFoundError:
        return ""
