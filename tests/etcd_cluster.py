"""Helpers for the cluster tests: daemons joined to a real etcd, what they
say about the cluster, their metrics, and polling with a deadline.

The etcd servers themselves come from etcd_server.py (``EtcdServer``,
``EtcdCluster``); the daemons from daemons.py (``DaemonProc``).
"""
from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
import urllib.request
import uuid

from prometheus_client.parser import text_string_to_metric_families

from daemons import DaemonProc
from elasticd.v1 import control_pb2 as pb
from etcd_server import free_port

DEFAULT_TTL = 3.0  # membership.lease_ttl's default
# Daemon flags: no warm spares (less CPU on a small machine), and the control
# socket's group nogroup, so a test may also call elasticctl as `nobody`.
NO_SPARES_NOBODY_MAY_CALL = ("--set", "agent.warm_spares=false",
                             "--set", "daemon.socket_group=65534")


def fresh_prefix() -> str:
    """A key prefix of its own per test, so tests sharing an etcd never meet."""
    return f"/t{uuid.uuid4().hex[:10]}"


def cluster_daemon(factory, endpoints, node_id: str, prefix: str, *extra: str,
                   metrics: bool = False, slots: int = 4) -> DaemonProc:
    """A (not yet started) daemon joined to etcd at ``endpoints`` under ``prefix``;
    with ``metrics`` it serves Prometheus on a free port (``d.metrics_port``)."""
    urls = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
    args = ["--etcd-prefix", prefix, *extra]
    port = 0
    if metrics:
        port = free_port()
        args += ["--metrics-port", str(port)]  # the later flag wins over DaemonProc's 0
    d = factory(node_id=node_id, etcd=urls, slots=slots, extra_args=tuple(args))
    d.metrics_port = port
    return d


def list_nodes(d: DaemonProc) -> pb.ListNodesResponse:
    """ListNodes over the real socket, in-process (fast enough to poll)."""
    with d.client() as c:
        return c.call("ListNodes", pb.ListNodesRequest())


def states(d: DaemonProc) -> dict[str, str]:
    return {n.node_id: n.state for n in list_nodes(d).nodes}


def ctl_json(d: DaemonProc, *args: str, timeout: float = 30.0) -> dict:
    """The real elasticctl with -o json; asserts it exits 0."""
    r = d.ctl("-o", "json", *args, timeout=timeout)
    assert r.returncode == 0, f"elasticctl {' '.join(args)} -> {r.returncode}: {r.stderr}"
    return json.loads(r.stdout)


def wait_for(pred, timeout: float, step: float = 0.05, what: str = "condition"):
    """Poll ``pred()`` until it returns something truthy; that value, or AssertionError."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = pred()
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep polling; report the last one
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not within {timeout:g}s (last: {last!r})")
        time.sleep(step)


def scrape(port: int) -> dict[str, float]:
    """One scrape of a daemon's metrics: ``name{k="v",...}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def submit_on(d: DaemonProc, *command: str, nodes: tuple = (), nproc: int = 1) -> str:
    """Submit a one-node job pinned to ``nodes`` (default: this daemon's node)."""
    req = pb.SubmitRequest(command=list(command), cwd=d.root, env=dict(os.environ),
                           nproc_per_node=nproc, min_nodes=1, max_nodes=1,
                           nodes=list(nodes or (d.node_id,)))
    with d.client() as c:
        return c.call("Submit", req).job.id


class CuttableProxy:
    """A TCP proxy on loopback in front of one etcd member: ``cut()`` drops
    every connection and refuses new ones (a network partition between
    the daemons behind it and etcd, while etcd itself stays up and
    expires their leases); ``heal()`` lets connections through again."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._cut = threading.Event()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._closed.set()
        self._cut.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self._cut.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.05)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        raise OSError("closed")
                    (b if s is a else a).sendall(data)
        except OSError:
            pass
        finally:
            a.close()
            b.close()
