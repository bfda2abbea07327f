"""A user who takes the metrics port first neither stops the daemon nor keeps metrics away
for good (issue 29, item 5).

A real unprivileged user made here binds the port before a real root daemon
starts: the daemon starts anyway, serves the user's job, says what is wrong
(a log line, `elasticctl nodes`, the gRPC health of ``elasticd.metrics``),
and serves metrics once the user lets go. A port below
``net.ipv4.ip_unprivileged_port_start`` (docs/metrics.md: where no user can take it)
is one the user cannot bind at all, and the root daemon serves there.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemons import DaemonProc, free_port, scrape
from elasticd.v1 import control_pb2 as pb
from test_local_trust import NOGROUP, PY, real_users, submit_as, submitted, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: a real user is created (CI runs as root)")

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
USER = f"h29m_mallory{_WORKER}"
# Binds and listens on the port (as the user), says so, holds it until stdin closes.
HOLD = """
import socket, sys
s = socket.socket()
try:
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen(1)
    print("bound", flush=True)
except OSError as exc:
    print("refused", exc.errno, flush=True)
    sys.exit(0)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def user():
    with real_users((USER,), "h29m-home-") as made:
        yield next(iter(made.values()))


def hold_port(user, port: int) -> tuple[subprocess.Popen, str]:
    """The user's process holding ``port`` (``bound``) or refused it (``refused ERRNO``)."""
    proc = subprocess.Popen(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}",
                             f"--groups={user.gid}", PY, "-c", HOLD, str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def health(d: DaemonProc, service: str) -> str:
    with grpc.insecure_channel(f"unix:{d.socket}") as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def problems(d: DaemonProc) -> list[str]:
    out = d.ctl("-o", "json", "nodes")
    assert out.returncode == 0, out.stderr
    return [p for n in json.loads(out.stdout)["nodes"] if n["node_id"] == d.node_id
            for p in n.get("problems", [])]


def test_a_user_on_the_metrics_port_neither_stops_the_daemon_nor_keeps_metrics_away(
        user, daemon_factory):
    port = free_port()
    holder, said = hold_port(user, port)
    try:
        assert said == "bound", said
        d = daemon_factory(extra_args=(
            "--metrics-port", str(port), "--set", "metrics.retry_interval=0.3",
            "--set", f"daemon.socket_group={NOGROUP}")).start()
        # It serves jobs: the very user's.
        work = user.mkdir(os.path.join(d.root, "work"))
        job_id = submitted(submit_as(d, user, "--", "/bin/true", cwd=work))
        assert d.wait_job(job_id, timeout=60).state == pb.SUCCEEDED
        # And says what is wrong, with whom.
        said = [p for p in problems(d) if "metrics endpoint" in p]
        assert said and f"0.0.0.0:{port} not serving" in said[0], said
        assert f"uid {user.uid}" in said[0] and "metrics.retry_interval" in said[0], said
        table = d.ctl("nodes")
        assert f"problem on {d.node_id}: metrics endpoint" in table.stdout, table.stdout
        assert health(d, "elasticd.metrics") == "NOT_SERVING"
        assert health(d, "") == "SERVING"
        time.sleep(1.0)  # a few more tries (every 0.3 s) while the user holds on
    finally:
        holder.stdin.close()
        holder.wait(10)
    # Let go: metrics come up within a retry or two, and the problem is gone.
    wait_for(lambda: _scrapes(port), 30, "metrics after the user let go", d.log)
    assert not [p for p in problems(d) if "metrics endpoint" in p]
    assert health(d, "elasticd.metrics") == "SERVING"
    log = d.log()
    assert log.count("cannot listen") == 1, log   # said once, not at every try
    assert f"metrics endpoint serving on 0.0.0.0:{port} (after" in log, log


def _scrapes(port: int) -> bool:
    try:
        return "elasticd_build_info" in scrape(port)
    except OSError:
        return False


def _unprivileged_start() -> int:
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as fh:
        return int(fh.read())


def _free_privileged_port() -> int:
    for port in range(min(_unprivileged_start(), 1024) - 1, 600, -1):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port below 1024")


@pytest.mark.skipif(not os.path.exists("/proc/sys/net/ipv4/ip_unprivileged_port_start")
                    or _unprivileged_start() < 2,
                    reason="this network namespace lets every user bind every port "
                           "(net.ipv4.ip_unprivileged_port_start)")
def test_a_privileged_metrics_port_is_one_no_user_can_take(user, daemon_factory):
    port = _free_privileged_port()
    holder, said = hold_port(user, port)
    holder.stdin.close()
    holder.wait(10)
    assert said == f"refused {errno.EACCES}", said   # EACCES: only root binds below the limit
    d = daemon_factory(extra_args=("--metrics-port", str(port))).start()
    assert not [p for p in problems(d) if "metrics endpoint" in p]
    assert "elasticd_build_info" in scrape(port)
    assert health(d, "elasticd.metrics") == "SERVING"
