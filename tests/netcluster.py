"""A cluster on real (virtual) networks: every host and every etcd member in
its own Linux network namespace, all on one bridge, and faults as one-line
calls. For the partition tests (tests/test_partitions.py), the chaos soak
(tests/test_chaos_soak.py) and bench/.

    with NetCluster(hosts=3) as c:           # 3 etcd members + 3 daemons
        job = c.submit_training(nodes=(2, 3), steps=200)
        c.net.isolate_from_etcd("h1")         # or partition(["h1"], ["h2", "h3"]) ...
        c.net.heal()
        c.wait_job(job)
        c.safety.check()                      # the five safety properties

Layout (names start with ``ed19`` plus a random tag, so clusters of tests
running side by side never meet and nothing clashes with the machine's own):
``<tag>-sw`` holds the bridge; ``<tag>-e0..2`` an etcd member each,
``<tag>-h1..N`` a daemon each, every one with an ``eth0`` on the bridge and
an address in 10.213.0.0/24 (which exists only inside these namespaces;
the root namespace gets no link, address or route). The test process talks
to the daemons over their unix sockets (the filesystem is shared) and to
etcd with ``ip netns exec ... etcdctl``.

Faults: packet filters (nftables, a table ``ed19`` in each namespace) drop
traffic between sets of namespaces, both ways; ``loss`` drops a share of
packets at random. This kernel has no netem, so ``latency`` is a delaying
TCP relay in each etcd member's namespace in front of its client port
(``NetCluster(etcd_relay=True)``: the daemons then reach etcd only through
it). Processes: kill -9, SIGSTOP/SIGCONT, restart, for daemons and members.

Teardown removes everything even when the test failed and raises if
anything was left: namespaces, links, processes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import psutil

from daemons import DaemonProc, short_tmpdir
from elasticd.v1 import control_pb2 as pb
from etcd_server import EtcdServer, etcd_binary

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "netcluster_train.py")
RELAY = os.path.join(HERE, "netcluster_relay.py")
SUBNET = "10.213.0"
ETCD_CLIENT, ETCD_PEER, RELAY_PORT = 2379, 2380, 2479
PREFIX = "ed19"

# Daemon settings for these tests: the defaults where they make sense (lease
# TTL 3 s, refresh 1 s), shorter where a default would make a test long.
DAEMON_SETTINGS = {
    "agent.warm_spares": "false",        # each spare imports torch: too much CPU on CI
    "agent.stop_grace_period": "3",
    "agent.restart_backoff_step": "0.2",
    "rendezvous.last_call": "1.0",
    "daemon.socket_group": "65534",
}
STOP_GRACE = float(DAEMON_SETTINGS["agent.stop_grace_period"])
COLLECTIVE_TIMEOUT = 10.0  # the workers' gloo timeout: a cut-off peer fails a step this late


def netns_unavailable() -> str | None:
    """Why this machine cannot run the namespace cluster, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (scripts/setup.sh installs iproute2 and nftables)"
    if etcd_binary() is None:
        return "no etcd binary"
    probe = f"{PREFIX}probe{uuid.uuid4().hex[:6]}"
    try:
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if r.returncode:
            return f"cannot make a network namespace: {r.stderr.strip()}"
        r = subprocess.run(["ip", "netns", "exec", probe, "nft", "add", "table", "inet", "x"],
                           capture_output=True, text=True)
        if r.returncode:
            return f"nftables does not work in a namespace: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(script: str) -> None:
    r = subprocess.run(["sh", "-ec", script], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"network setup failed ({r.returncode}): {r.stderr.strip()}\n{script}")


# ---------------------------------------------------------------- the network

class Net:
    """Namespaces on one bridge, by short name (``e0``, ``h1``, ...)."""

    def __init__(self, names: list[str]):
        self.tag = f"{PREFIX}{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-sw"
        self.ip = {n: f"{SUBNET}.{10 + i}" for i, n in enumerate(names)}
        self.rules: list[str] = []   # what is in force now, for the log
        lines = [f"ip netns add {self.switch}",
                 f"ip -n {self.switch} link set lo up",
                 f"ip -n {self.switch} link add br0 type bridge",
                 f"ip -n {self.switch} link set br0 up"]
        for i, n in enumerate(names):
            ns = self.ns(n)
            lines += [f"ip netns add {ns}",
                      f"ip -n {ns} link set lo up",
                      f"ip -n {ns} link add eth0 type veth peer name p{i} netns {self.switch}",
                      f"ip -n {ns} addr add {self.ip[n]}/24 dev eth0",
                      f"ip -n {ns} link set eth0 up",
                      f"ip -n {self.switch} link set p{i} master br0 up"]
        try:
            sh("\n".join(lines))
            for n in names:
                self._nft(n, "table inet ed19 {\n"
                             " chain input { type filter hook input priority 0; }\n"
                             " chain output { type filter hook output priority 0; }\n}\n")
        except BaseException:
            self.destroy()
            raise

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def exec(self, name: str) -> list[str]:
        """Argv prefix that runs a command in ``name``'s namespace."""
        return ["ip", "netns", "exec", self.ns(name)]

    def _nft(self, name: str, script: str) -> None:
        r = subprocess.run([*self.exec(name), "nft", "-f", "-"], input=script,
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nft in {name}: {r.stderr.strip()}\n{script}")

    # -- faults ----------------------------------------------------------------
    def partition(self, side_a, side_b) -> None:
        """Drop every packet between the two sets of namespaces, both ways."""
        side_a, side_b = list(side_a), list(side_b)
        for mine, theirs in ((side_a, side_b), (side_b, side_a)):
            ips = ", ".join(self.ip[n] for n in theirs)
            for n in mine:
                self._nft(n, f"add rule inet ed19 input ip saddr {{ {ips} }} drop\n"
                             f"add rule inet ed19 output ip daddr {{ {ips} }} drop\n")
        self.rules.append(f"partition {side_a} | {side_b}")

    def loss(self, names, percent: int, peers=None) -> None:
        """Drop ``percent`` % of the packets ``names`` send to or get from
        ``peers`` (default: everyone), at random."""
        peers = list(peers) if peers is not None else list(self.ip)
        for n in names:
            ips = ", ".join(self.ip[p] for p in peers if p != n)
            self._nft(n, f"add rule inet ed19 input ip saddr {{ {ips} }} "
                         f"numgen random mod 100 < {percent} drop\n"
                         f"add rule inet ed19 output ip daddr {{ {ips} }} "
                         f"numgen random mod 100 < {percent} drop\n")
        self.rules.append(f"loss {percent}% on {list(names)}")

    def heal(self) -> None:
        """Remove every packet filter (not the relays' latency)."""
        for n in self.ip:
            self._nft(n, "flush chain inet ed19 input\nflush chain inet ed19 output\n")
        self.rules.clear()

    # -- teardown --------------------------------------------------------------
    def namespaces(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines()
                if line.split() and line.split()[0].startswith(self.tag)]

    def pids(self) -> list[int]:
        found = []
        for ns in self.namespaces():
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                 text=True).stdout
            found += [int(p) for p in out.split()]
        return found

    def destroy(self) -> list[int]:
        """Kill every process in the namespaces and delete them (the veths
        and the bridge go with them). Returns the pids that had to be killed."""
        killed = self.pids()
        for pid in killed:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and _not_zombie(p) for p in killed):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for ns in self.namespaces():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        return killed

    def leftovers(self) -> list[str]:
        """What of this network still exists (should be nothing after destroy)."""
        left = [f"namespace {ns}" for ns in self.namespaces()]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        left += [f"link {line.split(':')[1].strip()}" for line in links.splitlines()
                 if self.tag in line]
        return left


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- etcd members

class NetEtcd(EtcdServer):
    """One etcd member in its own namespace, on the namespace's address."""

    def __init__(self, net: Net, name: str, initial_cluster: str, token: str):
        super().__init__(name=f"{token}-{name}", initial_cluster=initial_cluster,
                         cluster_token=token, heartbeat_ms=100, election_ms=1000)
        self.net, self.short = net, name
        self.ip = net.ip[name]
        self.client_port, self.peer_port = ETCD_CLIENT, ETCD_PEER

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{ETCD_CLIENT}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.ip}:{ETCD_PEER}"

    def command(self) -> list[str]:
        return [*self.net.exec(self.short), *super().command()]

    def etcdctl(self, *args: str, timeout: float = 5.0) -> subprocess.CompletedProcess:
        return subprocess.run([*self.net.exec(self.short), "etcdctl", "--endpoints", self.url,
                               "--command-timeout=2s", *args], capture_output=True, text=True,
                              timeout=timeout, env=dict(os.environ, ETCDCTL_API="3"))

    def healthy(self) -> bool:
        try:
            return self.etcdctl("endpoint", "health").returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def is_leader(self) -> bool:
        try:
            r = self.etcdctl("endpoint", "status", "-w", "json")
            st = json.loads(r.stdout)[0]["Status"]
            return st["leader"] == st["header"]["member_id"]
        except (subprocess.TimeoutExpired, ValueError, LookupError, KeyError):
            return False


# ---------------------------------------------------------------- the cluster

class NetCluster:
    """3 etcd members (e0..e2) and ``hosts`` daemons (h1..hN), each in its own
    namespace; a shared directory for worker reports and checkpoints."""

    def __init__(self, hosts: int = 3, etcd_members: int = 3, etcd_relay: bool = False,
                 settings: dict | None = None):
        from netcluster_safety import Safety  # noqa: PLC0415 - sibling module
        self.etcd_names = [f"e{i}" for i in range(etcd_members)]
        self.host_names = [f"h{i}" for i in range(1, hosts + 1)]
        self.settings = dict(DAEMON_SETTINGS, **(settings or {}))
        self.etcd_relay = etcd_relay
        self.shared = short_tmpdir("ed19-")
        self.report = os.path.join(self.shared, "reports.jsonl")
        self.prefix = f"/ed19-{uuid.uuid4().hex[:8]}"
        self.net = Net(self.etcd_names + self.host_names)
        self.etcd: dict[str, NetEtcd] = {}
        self.relays: dict[str, subprocess.Popen] = {}
        self.daemons: dict[str, DaemonProc] = {}
        self.collective_timeout = COLLECTIVE_TIMEOUT
        self.safety = Safety(self)
        self.faults: list[tuple[float, str]] = []

    # -- life cycle ------------------------------------------------------------
    def start(self) -> "NetCluster":
        token = f"{self.net.tag}-etcd"
        initial = ",".join(f"{token}-{n}=http://{self.net.ip[n]}:{ETCD_PEER}"
                           for n in self.etcd_names)
        for n in self.etcd_names:
            self.etcd[n] = NetEtcd(self.net, n, initial, token)
            self.etcd[n].start(wait=None)
            if self.etcd_relay:
                self.relays[n] = subprocess.Popen(
                    [*self.net.exec(n), sys.executable, RELAY, self.net.ip[n], str(RELAY_PORT),
                     str(ETCD_CLIENT), self.relay_file(n)], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for m in self.etcd.values():
            m.wait_healthy(30)
        for h in self.host_names:
            self.daemons[h] = self._daemon(h)
        for d in self.daemons.values():
            d.start(timeout=30)
        self.safety.start()
        return self

    def etcd_urls(self) -> str:
        port = RELAY_PORT if self.etcd_relay else ETCD_CLIENT
        return ",".join(f"http://{self.net.ip[n]}:{port}" for n in self.etcd_names)

    def daemon_args(self, host: str) -> list[str]:
        """Every flag a host's daemon gets beyond DaemonProc's own: THE one
        place to add cluster-wide settings (e.g. a cluster key file)."""
        args = ["--etcd-prefix", self.prefix, "--set", f"daemon.address={self.net.ip[host]}"]
        for key, value in self.settings.items():
            args += ["--set", f"{key}={value}"]
        return args

    def _daemon(self, host: str) -> DaemonProc:
        d = DaemonProc(os.path.join(self.shared, host), node_id=host, slots=4,
                       etcd=self.etcd_urls(), extra_args=tuple(self.daemon_args(host)))
        os.makedirs(d.root, exist_ok=True)
        d.wrap = self.net.exec(host)
        return d

    def close(self) -> None:
        """Stop everything; raise if anything was left behind."""
        problems = []
        try:
            self.safety.stop()
        except Exception as exc:  # noqa: BLE001 - teardown goes on
            problems.append(f"safety monitor: {exc}")
        try:
            self.net.heal()
        except Exception:  # noqa: BLE001
            pass
        for d in self.daemons.values():
            if d.proc is not None and d.proc.poll() is None:
                try:
                    os.kill(d.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                d.stop(timeout=15)
        for p in self.relays.values():
            p.kill()
            p.wait()
        for m in self.etcd.values():
            m.kill()
        killed = self.net.destroy()
        for m in self.etcd.values():
            shutil.rmtree(m.workdir, ignore_errors=True)
        left = self.net.leftovers()
        alive = [p for p in killed if psutil.pid_exists(p) and _not_zombie(p)]
        shutil.rmtree(self.shared, ignore_errors=True)
        if left or alive or problems:
            raise AssertionError(f"cluster teardown left {left}, live pids {alive}; {problems}")

    def __enter__(self) -> "NetCluster":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    # -- faults on processes ---------------------------------------------------
    def note(self, what: str) -> float:
        now = time.time()
        self.faults.append((now, what))
        return now

    def _proc(self, name: str) -> subprocess.Popen:
        return (self.daemons[name].proc if name in self.daemons else self.etcd[name].proc)

    def kill(self, name: str) -> float:
        """kill -9 a daemon (h*) or an etcd member (e*)."""
        t = self.note(f"kill -9 {name}")
        if name in self.daemons:
            self.daemons[name].kill()
        else:
            self.etcd[name].kill()
        return t

    def freeze(self, name: str) -> float:
        t = self.note(f"SIGSTOP {name}")
        os.kill(self._proc(name).pid, signal.SIGSTOP)
        return t

    def thaw(self, name: str) -> float:
        t = self.note(f"SIGCONT {name}")
        os.kill(self._proc(name).pid, signal.SIGCONT)
        return t

    def restart(self, name: str) -> float:
        """Start a killed (or stop a live and start) daemon or etcd member again."""
        t = self.note(f"restart {name}")
        if name in self.daemons:
            d = self.daemons[name]
            if d.proc is not None and d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
                d.stop()
            d.start(timeout=30)
        else:
            m = self.etcd[name]
            m.kill()
            m.start(wait=30)
        return t

    def isolate_from_etcd(self, host: str) -> float:
        """Cut ``host`` off from every etcd member (its peers still reach it)."""
        t = self.note(f"{host} cut off from etcd")
        self.net.partition([host], self.etcd_names)
        return t

    def isolate_from_peers(self, host: str) -> float:
        """Cut ``host`` off from the other hosts (it still reaches etcd)."""
        t = self.note(f"{host} cut off from its peers")
        self.net.partition([host], [h for h in self.host_names if h != host])
        return t

    def isolate(self, name: str) -> float:
        """Cut a host or etcd member off from everyone."""
        t = self.note(f"{name} cut off from everyone")
        self.net.partition([name], [n for n in self.net.ip if n != name])
        return t

    def heal(self) -> float:
        t = self.note("healed")
        self.net.heal()
        return t

    def latency(self, ms: int) -> None:
        """Delay every byte through the etcd relays by ``ms`` each way (needs etcd_relay)."""
        assert self.etcd_relay, "latency needs NetCluster(etcd_relay=True)"
        for n in self.etcd_names:
            tmp = self.relay_file(n) + ".tmp"
            with open(tmp, "w") as fh:
                fh.write(str(ms / 1000.0))
            os.replace(tmp, self.relay_file(n))
        self.net.rules.append(f"latency {ms} ms each way on etcd client links")

    def relay_file(self, member: str) -> str:
        return os.path.join(self.shared, f"relay-delay-{member}")

    def etcd_leader(self, wait: float = 15.0) -> str:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for n, m in self.etcd.items():
                if m.running and m.is_leader():
                    return n
            time.sleep(0.1)
        raise AssertionError("the etcd cluster has no leader")

    # -- jobs --------------------------------------------------------------------
    def submit_training(self, on: str = "h1", nodes: tuple = (2, 3), steps: int = 100,
                        step_seconds: float = 0.1, max_restarts: int = 10,
                        name: str = "") -> str:
        ckpt = os.path.join(self.shared, f"ckpt-{uuid.uuid4().hex[:6]}")
        cmd = [sys.executable, TRAIN, self.report, ckpt, str(steps), str(step_seconds),
               str(COLLECTIVE_TIMEOUT)]
        # gloo finds its own address from the hostname, which here names the
        # machine, not the namespace: point it at the namespace's interface.
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")
        req = pb.SubmitRequest(command=cmd, cwd=self.shared, env=env,
                               min_nodes=nodes[0], max_nodes=nodes[1], nproc_per_node=1,
                               max_restarts=max_restarts, name=name)
        with self.daemons[on].client() as c:
            job_id = c.call("Submit", req).job.id
        self.safety.watch_job(job_id, on, steps)
        return job_id

    def job(self, job_id: str, on: str = "h1") -> pb.Job:
        return self.daemons[on].job(job_id)

    def wait_job(self, job_id: str, on: str = "h1", timeout: float = 120.0) -> pb.Job:
        return self.daemons[on].wait_job(job_id, timeout)

    def wait_steps(self, job_id: str, after: float, count: int = 1,
                   timeout: float = 60.0) -> float:
        """Wait until rank 0 reports ``count`` steps after time ``after``;
        returns the time of the first of them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = [r["t"] for r in self.safety.records(job_id, "step")
                     if r["rank"] == 0 and r["t"] > after]
            if len(steps) >= count:
                return min(steps)
            if pb.JobState.Name(self.job(job_id).state) in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            time.sleep(0.2)
        raise AssertionError(f"job {job_id}: no training step within {timeout:g}s after the "
                             f"fault; {self.describe(job_id)}")

    def describe(self, job_id: str) -> str:
        parts = []
        for h, d in self.daemons.items():
            try:
                j = d.job(job_id)
                parts.append(f"{h}: {pb.JobState.Name(j.state)} round {j.round} ({j.reason})")
            except Exception as exc:  # noqa: BLE001 - a frozen or dead daemon
                parts.append(f"{h}: unreachable ({type(exc).__name__})")
        return "; ".join(parts)

    def events(self, job_id: str, on: str = "h1") -> list[pb.Event]:
        return self.daemons[on].events(job_id)


# ---------------------------------------------------------------- pytest

def netcluster_fixture():
    """The body of the ``netcluster`` fixture (test modules wrap it): a
    factory of started clusters, each closed at the end, leftovers asserted."""
    made: list[NetCluster] = []

    def make(**kwargs) -> NetCluster:
        c = NetCluster(**kwargs)
        made.append(c)
        return c.start()

    yield make
    errors = []
    for c in made:
        try:
            c.close()
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, "\n".join(errors)
