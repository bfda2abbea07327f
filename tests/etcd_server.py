"""A real etcd server for tests: loopback ports, a temp data dir, start,
stop, kill and restart with the same data.

    with EtcdServer() as etcd:
        store = open_store("etcd3", etcd.endpoints)

The binary comes from $ELASTICD_TEST_ETCD or PATH (Debian's etcd 3.4 is
at /usr/bin/etcd).  Data lives under /dev/shm where it exists, so fsync is
cheap.  Short heartbeat/election settings make the single member elect
itself at once and allow one-second leases.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass


def etcd_binary() -> str | None:
    return os.environ.get("ELASTICD_TEST_ETCD") or shutil.which("etcd") or (
        "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Certs:
    """PEM files for a TLS etcd: ``ca`` signed ``server`` and ``client``;
    ``other_ca`` signed nothing here (the "wrong CA" case)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def make_certs(directory: str) -> Certs:
    """Make a CA, a server cert for 127.0.0.1/localhost, a client cert and
    an unrelated CA with the openssl command."""
    os.makedirs(directory, exist_ok=True)
    p = lambda name: os.path.join(directory, name)  # noqa: E731

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2",
            "-subj", f"/CN=elasticd test {ca}", "-keyout", p(f"{ca}.key"), "-out", p(f"{ca}.pem"))
    ext = p("san.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                "extendedKeyUsage=serverAuth,clientAuth\n")
    for who in ("server", "client"):
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-subj", f"/CN={who}",
            "-keyout", p(f"{who}.key"), "-out", p(f"{who}.csr"))
        run("x509", "-req", "-in", p(f"{who}.csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
            "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", p(f"{who}.pem"))
    return Certs(p("ca.pem"), p("server.pem"), p("server.key"),
                 p("client.pem"), p("client.key"), p("other-ca.pem"))


class EtcdServer:
    """One single-member etcd with the v2 API on, on free loopback ports."""

    def __init__(self, data_dir: str | None = None, certs: Certs | None = None,
                 client_cert_auth: bool = False, binary: str | None = None,
                 extra_args: tuple = (), name: str | None = None,
                 initial_cluster: str | None = None, cluster_token: str | None = None,
                 heartbeat_ms: int = 10, election_ms: int = 100):
        self.binary = binary or etcd_binary()
        if not self.binary:
            raise RuntimeError("no etcd binary: install etcd or set ELASTICD_TEST_ETCD")
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.workdir = tempfile.mkdtemp(prefix="elasticd-etcd-", dir=base)
        self.data_dir = data_dir or os.path.join(self.workdir, "data")
        self.log_path = os.path.join(self.workdir, "etcd.log")
        self.name = name or f"test-{uuid.uuid4().hex[:8]}"
        self.initial_cluster = initial_cluster  # None: this member alone
        self.cluster_token = cluster_token or self.name
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.certs = certs
        self.client_cert_auth = client_cert_auth
        self.extra_args = tuple(extra_args)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.certs else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoints(self) -> list[str]:
        return [self.url]

    def command(self) -> list[str]:
        peer = self.peer_url
        cmd = [
            self.binary, "--name", self.name, "--data-dir", self.data_dir,
            "--enable-v2=true",
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state", "new", "--initial-cluster-token", self.cluster_token,
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--logger", "zap", "--log-level", "warn",
        ]
        if self.certs:
            cmd += ["--cert-file", self.certs.server_cert, "--key-file", self.certs.server_key,
                    "--trusted-ca-file", self.certs.ca]
            if self.client_cert_auth:
                cmd += ["--client-cert-auth"]
        return cmd + list(self.extra_args)

    def start(self, wait: float | None = 15.0) -> "EtcdServer":
        """Start (same ports, same data dir as before); wait until healthy
        unless ``wait`` is None (a cluster member alone never is)."""
        if self.running:
            return self
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        if wait is not None:
            self.wait_healthy(wait)
        return self

    def wait_healthy(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd not healthy within {wait}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        ctx = None
        if self.certs:
            ctx = ssl.create_default_context(cafile=self.certs.ca)
            ctx.load_cert_chain(self.certs.client_cert, self.certs.client_key)
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1, context=ctx) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM and wait; SIGKILL if it lingers."""
        if self.running:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.running:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def freeze(self) -> None:
        """SIGSTOP: a hung etcd.  Its ports still accept connections (the
        kernel queues them) but nothing answers.  Returns once every thread
        is stopped, so no request slips through afterwards."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            states = []
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                try:
                    with open(f"/proc/{self.proc.pid}/task/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except OSError:
                    pass
            if states and all(st in "tT" for st in states):
                return
            time.sleep(0.005)
        raise RuntimeError("etcd did not stop on SIGSTOP")

    def thaw(self, wait: float = 10.0) -> None:
        """SIGCONT after freeze(); waits until it answers again."""
        os.kill(self.proc.pid, signal.SIGCONT)
        self.wait_healthy(wait)

    def restart(self, wait: float = 15.0) -> "EtcdServer":
        """Stop if running, then start on the same ports and data dir."""
        self.stop()
        return self.start(wait)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class EtcdCluster:
    """``size`` etcd members on loopback forming one cluster.

        with EtcdCluster(3) as cluster:
            cluster.kill(cluster.leader())
    """

    def __init__(self, size: int = 3, heartbeat_ms: int = 25, election_ms: int = 250):
        token = f"cluster-{uuid.uuid4().hex[:8]}"
        self.members = [EtcdServer(name=f"{token}-{i}", cluster_token=token,
                                   heartbeat_ms=heartbeat_ms, election_ms=election_ms)
                        for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> list[str]:
        return [m.url for m in self.members]

    def start(self, wait: float = 20.0) -> "EtcdCluster":
        for m in self.members:
            m.start(wait=None)
        for m in self.members:
            m.wait_healthy(wait)
        return self

    def status(self, member: EtcdServer) -> dict:
        req = urllib.request.Request(member.url + "/v3/maintenance/status", data=b"{}",
                                     method="POST")
        with urllib.request.urlopen(req, timeout=2) as r:
            return json.loads(r.read())

    def leader(self, wait: float = 10.0) -> EtcdServer:
        """The member that is leader now (waits for an election)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for m in self.members:
                if not m.running:
                    continue
                try:
                    st = self.status(m)
                except OSError:
                    continue
                if st.get("leader") not in (None, "0") and st["leader"] == st["header"]["member_id"]:
                    return m
            time.sleep(0.05)
        raise RuntimeError("the cluster has no leader")

    def cleanup(self) -> None:
        for m in self.members:
            m.cleanup()

    def __enter__(self) -> "EtcdCluster":
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
