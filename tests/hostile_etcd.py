"""An attacker who can write etcd but holds no cluster key, and the cluster it aims at.

``Attacker`` writes the daemons' prefix the way such a person would: with
``etcdctl`` (a real etcd client, no elasticd code) for the few keys of a
reproduction, and with etcd's own HTTP gateway (``/v3/kv/put``, one
keep-alive connection per thread, any bytes as key and value) for the
thousands of values of a fuzz run. ``hostile_values`` makes those values; ``TrainingPair`` is two
real daemons on a real etcd with a 2-node job of real torch ranks training.
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import urlparse

from daemons import DaemonProc, short_tmpdir
from elasticd.v1 import control_pb2 as pb
from etcd_cluster import NO_SPARES_NOBODY_MAY_CALL, scrape, wait_for
from etcd_server import free_port

PY = sys.executable


class Attacker:
    """Writes and reads the daemons' prefix without the cluster key."""

    def __init__(self, url: str, prefix: str):
        self.url = url
        self.prefix = prefix
        self._local = threading.local()

    def etcdctl(self, *args: str, value: str | None = None) -> str:
        r = subprocess.run(["etcdctl", "--endpoints", self.url, *args], input=value,
                           capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, ETCDCTL_API="3"))
        assert r.returncode == 0, r.stderr
        return r.stdout

    def put(self, key: str, value: str) -> None:
        """``key`` relative to the prefix (``/v1/jobs/J/state``); the value on stdin (no
        shell or argv length limit, and a leading '-' is no flag)."""
        self.etcdctl("put", self.prefix + key, value=value)

    def get(self, key: str) -> str:
        return self.etcdctl("get", "--print-value-only", self.prefix + key).rstrip("\n")

    def delete(self, key: str) -> None:
        self.etcdctl("del", self.prefix + key)

    def raw_put(self, key: str | bytes, value: str | bytes) -> None:
        """A put through etcd's gateway: any bytes, any key (no elasticd code)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            u = urlparse(self.url)
            conn = self._local.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        key = self.prefix.encode() + (key.encode() if isinstance(key, str) else key)
        value = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        body = json.dumps({"key": base64.b64encode(key).decode(),
                           "value": base64.b64encode(value).decode()})
        conn.request("POST", "/v3/kv/put", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, (resp.status, data[:200])

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()


class Trap:
    """A TCP listener standing in for the attacker's TCPStore: counts who connects."""

    def __init__(self):
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


class TrainingPair:
    """Daemons n1 and n2 (metrics on both) on one etcd, under a fresh prefix."""

    def __init__(self, etcd_url: str, *extra: str):
        self.etcd_url = etcd_url
        self.prefix = f"/hx{uuid.uuid4().hex[:8]}"
        self.shared = short_tmpdir("hx-")
        self.extra = (*NO_SPARES_NOBODY_MAY_CALL, *extra)
        self.nodes: dict[str, DaemonProc] = {}
        for node in ("n1", "n2"):
            self.add(node)
        self.attacker = Attacker(etcd_url, self.prefix)

    def add(self, node: str) -> DaemonProc:
        port = free_port()
        d = DaemonProc(short_tmpdir(), node_id=node, slots=4, etcd=self.etcd_url, extra_args=(
            "--etcd-prefix", self.prefix, *self.extra, "--metrics-port", str(port)))
        d.metrics_port = port
        self.nodes[node] = d
        d.start()
        return d

    def __getitem__(self, node: str) -> DaemonProc:
        return self.nodes[node]

    def close(self) -> None:
        self.attacker.close()
        for d in self.nodes.values():
            d.cleanup()
        import shutil
        shutil.rmtree(self.shared, ignore_errors=True)

    # -- jobs ------------------------------------------------------------------
    def submit(self, *command: str, nnodes: str = "2", on: str = "n1") -> str:
        r = self[on].ctl("submit", "--nnodes", nnodes, "--", *command, cwd=self.shared)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def start_training(self) -> str:
        """A 2-node job of real torch ranks (gloo) that trains until cancelled; returns
        once both nodes run it."""
        job = self.submit(PY, "-m", "elasticd.examples.train", "--steps", "10000000",
                          "--step-time", "0.05", "--log-every", "1000", "--checkpoint-every",
                          "1000000", "--checkpoint-dir", os.path.join(self.shared, "ckpt"))
        for d in self.nodes.values():
            d.wait_state(job, "RUNNING", timeout=120)
        return job

    def running(self, job_id: str) -> dict:
        """{node: (state, round, restarts, worker pids)} of the job on each node."""
        out = {}
        for node in ("n1", "n2"):
            j = self[node].job(job_id)
            out[node] = (pb.JobState.Name(j.state), j.round, j.restarts,
                         tuple(sorted(w.pid for w in j.workers if w.node_id == node)))
        return out

    def rejected(self, node: str) -> dict:
        """{(kind, reason): count} of the records ``node`` refused from etcd."""
        out = {}
        for name, value in scrape(self[node].metrics_port).items():
            if name.startswith("elasticd_etcd_records_rejected_total{"):
                labels = dict(p.split("=", 1) for p in name[name.index("{") + 1:-1].split(","))
                out[(labels["kind"].strip('"'), labels["reason"].strip('"'))] = value
        return out

    def run_short_job(self, timeout: float = 90.0) -> str:
        """A new 2-node job submitted now must rendezvous and succeed: the watches
        still deliver."""
        job = self.submit("/bin/sh", "-c", "sleep 1")
        for node in ("n1", "n2"):     # each ran its rank of it
            done = self[node].wait_job(job, timeout=timeout)
            assert pb.JobState.Name(done.state) == "SUCCEEDED", done
            assert node in {w.node_id for w in done.workers}, done
        return job


def steady(pair: TrainingPair, job_id: str, before: dict, seconds: float) -> None:
    """For ``seconds``, the job keeps running exactly as ``before`` on both nodes: same
    round, no restart, the same worker processes."""
    deadline = time.monotonic() + seconds
    while True:
        now = pair.running(job_id)
        assert now == before, f"the job moved: {before} -> {now}"
        if time.monotonic() >= deadline:
            return
        time.sleep(0.25)


# ---------------------------------------------------------------- hostile values

def _deep(kind: str, n: int) -> str:
    return {"list": "[" * n, "dict": '{"a":' * n, "closed": "[" * n + "]" * n}[kind]


def hostile_values(rng: random.Random, genuine: list[str]) -> list[str | bytes]:
    """One round of hostile values: deep nesting, huge numbers, NaN/inf, wrong types,
    odd unicode, a 1 MiB string, record-shaped forgeries, and genuine values cut,
    flipped or with fields changed (what someone who can read etcd makes)."""
    deep = rng.choice((100, 1000, 5000, 50000))
    values = [
        _deep(rng.choice(("list", "dict", "closed")), deep),
        '{"round": 1e999, "status": "closed"}', "1e999", "-1e999", "9" * rng.randint(30, 5000),
        '{"nproc": 1e999, "node_id": "n1", "address": "127.0.0.1", "port": 1}',
        "NaN", '{"round": NaN}', "Infinity", '{"time": -Infinity}',
        "[]", '"text"', "null", "true", "0", "",
        '{"round": "1", "status": 7, "members": {"a": 1}}',
        '{"node_id": 5, "slots": -1, "jobs": 7}',
        '{"node_id": "n1", "slots": 99999999999999999999, "jobs": ["x"]}',
        json.dumps({"node_id": "\u202eevil\u0000", "address": "\ud800"}, ensure_ascii=False,
                   ).encode("utf-8", "surrogatepass"),     # not UTF-8 (a lone surrogate)
        b"\xff\xfe\x00garbage", "\U0001f4a9" * rng.randint(1, 2000),
        json.dumps({"node_id": "n1", "address": "\u202e\u0000" * 50}),
        json.dumps({"round": rng.randint(2, 1 << 40), "status": "closed", "members": [
            {"node_id": n, "address": "127.0.0.1", "nproc": 1, "port": rng.randint(1, 65535),
             "hosted": True} for n in ("n1", "n2")]}),
        json.dumps({"state": "draining", "by": "root", "at": time.time()}),
        json.dumps({"job_id": "x", "kind": "transition", "from_state": "RUNNING",
                    "to_state": "FAILED", "reason": "forged", "node_id": "n2", "round": 1,
                    "rank": -1, "restart": 0, "time": time.time()}),
        "e1.1." + "0" * 64 + ".{}", "e1." + "9" * 40 + "." + "f" * 64 + ".{}",
    ]
    if rng.random() < 0.05:
        values.append('"' + "a" * (1 << 20) + '"')    # 1 MiB: etcd takes up to 1.5 MiB
    for g in rng.sample(genuine, min(len(genuine), 4)):
        cut = rng.randint(0, max(0, len(g) - 1))
        flip = list(g)
        if flip:
            i = rng.randrange(len(flip))
            flip[i] = chr((ord(flip[i]) + 1) % 0x7f or 1)
        values += [g, g[:cut], "".join(flip), g.replace("127.0.0.1", "10.6.6.6"),
                   g.replace('"hosted":false', '"hosted":true').replace(
                       '"hosted": false', '"hosted": true')]
    return values


def hostile_keys(rng: random.Random, job_id: str, rnd: int) -> list[str]:
    """Keys under every prefix a daemon watches: the running job's own and others'."""
    other = rng.choice(("x", "evil", uuid.uuid4().hex[:6]))
    node = rng.choice(("n1", "n2", "evil"))
    r = rng.choice((rnd, rnd + 1, rnd + 9, 1))
    keys = []
    for job in (job_id, other):
        keys += [f"/v1/jobs/{job}/spec", f"/v1/jobs/{job}/state",
                 f"/v1/jobs/{job}/join/{r}/{node}", f"/v1/jobs/{job}/done/{r}/{node}",
                 f"/v1/jobs/{job}/workers/{node}", f"/v1/jobs/{job}/phases/{node}",
                 f"/v1/phases/{job}/{node}", f"/v1/phases/{job}/{node}/x",
                 f"/v1/phasedigests/{job}/{node}", f"/v1/phasedigests/{job}/{node}/x",
                 f"/v1/jobs/{job}/summaries/{node}", f"/v1/jobs/{job}/join/notanint/{node}",
                 f"/v1/events/{job}/{node}/{rng.randint(0, 10**12):012d}",
                 f"/v1/rounds/{job}/state", f"/v1/rounds/{job}/spec",
                 f"/v1/rounds/{job}/join/{r}/{node}", f"/v1/rounds/{job}/done/{r}/{node}",
                 f"/v1/rounds/{job}/workers/{node}", f"/v1/rounds/{job}/join/notanint/{node}",
                 f"/v1/rounds/{job}/decider/{r}", f"/v1/rounds/{job}/decider/notanint",
                 f"/v1/joins/{job}/round/{r}/{node}", f"/v1/joins/{job}/round/notanint/{node}",
                 f"/v1/joins/{job}/{r}/{node}",
                 f"/v1/joins/{job}/done/{r}/{node}", f"/v1/joins/{job}/done/notanint/{node}",
                 f"/v1/workers/{job}/rows/{node}", f"/v1/workers/{job}/{node}",
                 f"/v1/workers/{job}/rows/{node}/x",
                 f"/v1/rounds/{job}/" + "k" * rng.choice((10, 3000))]
    keys += [f"/v1/nodes/{node}", f"/v1/drain/{node}", "/v1/jobs/", f"/v1/jobs/{other}",
             "/v1/rounds/", f"/v1/rounds/{job_id}", "/v1/joins/", f"/v1/joins/{job_id}",
             "/v1/workers/", f"/v1/workers/{job_id}",
             f"/v1/jobs/{other}/" + "k" * rng.choice((10, 3000)), "/v1/nodes/",
             f"/v1/events/{other}", f"/v1/drain/{node}/deeper",
             f"/v1/witnesses/{rng.randrange(4)}", "/v1/witnesses/x", f"/v1/lost/{node}",
             f"/v1/lost/{other}", "/v1/lost/"]
    return keys


def wait_metric(pair: TrainingPair, node: str, pred, what: str, timeout: float = 20.0):
    return wait_for(lambda: pred(pair.rejected(node)), timeout, what=what)
