"""N simulated nodes on one real etcd: what the daemon's own cluster code costs etcd, per N.

    python bench/scale_sim.py [--nodes 20,50,100] [--seconds 10] [--procs 2] [--quick]
    python bench/scale_sim.py --nodes 1000 --job-nodes 20 --daemon-nodes 100 --no-full-job

Each simulated node runs the daemon's own code, nothing else (no torch, no
workers, no gRPC server), over its OWN etcd client (one Etcd3Store each, so
its own HTTP connections to etcd's v3 JSON gateway, and its lease refreshes
and watches over membership.lease_transport and membership.watch_transport
as open_cluster_store passes them: by default its own gRPC channels, a
keep-alive stream and one Watch stream carrying all its watched prefixes,
with gRPC's threads;
``--lease-transport gateway`` / ``--watch-transport gateway`` send them
through the gateway instead):

  membership   cluster/membership.py: a LeaseKeeper (its node key under a lease,
               refreshed every membership.refresh_interval) and a NodeWatcher (a
               watch of the node keys' deletes only: no node receives another's
               record rewrites), as cluster/node.py builds them
  rendezvous   rendezvous/view.py: a JobsView (one watch per node of the job
               list, as every daemon keeps, one of the rounds of each job the
               node runs, which its ClusterRendezvous follows, and one of the job's
               joins: whole where the node decides the round or is its first
               member, else of their deletes) and rendezvous/round.py's
               ClusterRendezvous.next_round for the job
  phases       rendezvous/phase_watch.py: a PhaseWatch per node, and
               hangs/phase_board.py: a PhasePublisher per node of the running job,
               made as the agent makes it (PhasePublisher.for_agent), offered a
               record of 4 training ranks every 0.2 s; each node reads its peers
               once a second through agent/phase_peers.py's PeerReader, as the
               agent's attempt does: the round's first member watches the job's
               records and folds them into the digest it publishes
               (hangs/phase_digest.py), every other node watches that digest

The nodes live in --procs worker processes (threads inside: about nine per
node idle, twelve running, over grpc: one per watch, its follower, and a few
per node for its streams; on 2 cores the simulator, not etcd, stops between
200 and 300 nodes, and a job of all N nodes between 160 and 200:
bench/README.md), plus one more process holding the 10 % that is killed with
SIGKILL.
With --daemon-nodes F (and --job-nodes S, F a multiple of S) only the first F
nodes run the daemon's code; the other N - F are replay nodes
(bench/scale_replay.py): each sends etcd what a daemon sends in steady state
(its lease's keep-alives, its node key, one Watch stream with the daemon's
watches, its phase record and its job's digest every refresh) over streams
of its own, all of a process's replay nodes from one asyncio loop, so that
etcd carries 1,000 nodes' traffic while 2 cores still run the daemon's code
for 100. A job of replay nodes alone forms no round; the N-node job does:
its daemon-code nodes run the rendezvous (one of them decides the round),
its replay nodes write their joins at the release and take the closed
state their watch receives as their result. The killed 10 % are replay
nodes; the loss witnesses are daemon-code nodes.

Records are sealed with a cluster key as the daemons' are (trust/sealed.py);
the job's spec is plain JSON (the spec codec is not simulated).

Per N it measures, over --seconds windows read from etcd's own /metrics and
psutil:
  idle         nodes registered and watching, no job
  rendezvous   one job of min = max = N nodes: seconds from the release of all
               N next_round calls until the last node has its result
  rows         every node publishes its worker rows once the job formed (as the
               agent after a start): their deliveries a node
  running      that job running: every node publishing its phase record
  done         every node marks its workers done (the exit barrier): the
               marks' deliveries a node
  node loss    SIGKILL of the process holding 10 % of the nodes: seconds until
               a loss witness (cluster/witness.py) recorded each of them lost, the
               lost row's own time (median and the last), at the lease settings of
               this tree; the node keys' deletes reach the witnesses alone
and prints, per window: etcd writes/s (raft proposals committed), etcd gRPC
requests/s (the messages etcd's gRPC server received: every v3 gateway call,
each watch created, each lease keep-alive on a stream) per node, deliveries/s (the events every node's watches received,
counted at each node's store) in total and per node, the share of the
expected deliveries that arrived (every watcher should get every write under
its prefixes, a phase record every node of its job: below ~95 % the watchers
fall behind), etcd's CPU and the
simulator's CPU in % of one core, the simulator's threads, and the machine's load. Where the
simulator's processes use their whole core each (they run Python: one core
per process at most) while etcd has CPU to spare, the simulator, not etcd,
is the limit, and the line says so.

Prints tables and one BENCH-ROW (bench/rows.py); never asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import psutil  # noqa: E402

from common import machine, median, revision, table  # noqa: E402
from rows import emit_row  # noqa: E402
from etcd_server import EtcdServer, etcd_binary  # noqa: E402
import scale_replay  # noqa: E402
from scale_replay import (  # noqa: E402
    RANKS, SeenEvents, kind_of, node_info, replay_worker, training_phases,
)

OFFER_EVERY = 0.2      # seconds between records offered to each node's publisher
PEERS_EVERY = 1.0      # seconds between each node's reads of its peers' records


# ---------------------------------------------------------------- one node

class CountingStore:
    """A node's store, counting its requests by operation, its phase record writes by
    job and its watch deliveries by kind of key (nodes, phases, other job keys)."""

    def __init__(self, inner):
        self.inner, self.name, self.timeout = inner, inner.name, inner.timeout
        self.ops: Counter = Counter()
        self.delivered: Counter = Counter()
        # job -> puts, CASes and deletes of its rounds' keys (every node of the job
        # watches them), of its phase digests (every node of the job but the writer);
        # and the phase records' (each reaches the round's first member alone)
        self.phase_writes: Counter = Counter()
        self.digest_writes: Counter = Counter()
        self.record_writes: Counter = Counter()
        # (prefix, key, revision) of the events its watches received: one delivered
        # again (a watch made again from too early a revision) is counted as "again"
        self.seen = SeenEvents()
        self.node_puts = 0       # writes of its node key, lost rows, witness slots: no
                                 # watch receives them
        self.row_puts = 0        # writes of its worker rows (/v1/workers/: no watch there)
        self.errors = 0          # requests that failed (etcd slow to answer: overload),
                                 # not those etcd answered no (a key taken, a compare)
        from elasticd.store import CompareFailed, KeyExists
        self._answers = (KeyExists, CompareFailed)
        self._lock = threading.Lock()

    def _op(self, name: str) -> None:
        with self._lock:
            self.ops[name] += 1

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def counted(*args, **kwargs):
            self._op(name)
            try:
                return attr(*args, **kwargs)
            except self._answers:
                raise            # an answer (a round's decider claimed by another node)
            except Exception:
                self.errors += 1
                raise
        return counted

    def _phase_write(self, key: str, put: bool = True) -> None:
        if key.startswith("/v1/rounds/"):
            with self._lock:
                self.phase_writes[key.split("/")[3]] += 1
        elif key.startswith("/v1/phasedigests/"):
            with self._lock:
                self.digest_writes[key.split("/")[3]] += 1
        elif key.startswith("/v1/phases/"):
            with self._lock:
                self.record_writes[key.split("/")[3]] += 1
        elif key.startswith("/v1/workers/"):
            with self._lock:
                self.row_puts += 1
        elif (put and key.startswith("/v1/nodes/")) \
                or key.startswith(("/v1/lost/", "/v1/witnesses/")):
            with self._lock:       # no watch receives these (slots: their deletes alone)
                self.node_puts += 1

    def put(self, key, value, lease=None):
        self._phase_write(key)
        return self.__getattr__("put")(key, value, lease)

    def delete(self, key, prev_revision=None):
        self._phase_write(key, put=False)
        return self.__getattr__("delete")(key, prev_revision)

    def create(self, key, value, lease=None):
        self._phase_write(key)
        return self.__getattr__("create")(key, value, lease)

    def compare_and_swap(self, key, value, prev_revision, lease=None):
        self._phase_write(key)
        return self.__getattr__("compare_and_swap")(key, value, prev_revision, lease)

    def watch(self, prefix, start_revision, stop_event=None, timeout=None, deletes_only=False):
        self._op("watch")
        for ev in self.inner.watch(prefix, start_revision, stop_event, timeout, deletes_only):
            kind = kind_of(ev.key)
            with self._lock:
                self.delivered[kind] += 1
                if self.seen.once(prefix, ev.key, ev.revision):
                    self.delivered["again"] += 1
            yield ev


class SimNode:
    """One simulated daemon: lease, node watch, jobs view; a rendezvous and a phase
    publisher while it runs the job."""

    def __init__(self, node_id: str, url: str, prefix: str, records, cfg):
        from elasticd.cluster.membership import LeaseKeeper, NodeWatcher
        from elasticd.cluster.witness import LossWitness
        from elasticd.rendezvous.phase_watch import PhaseWatch
        from elasticd.rendezvous.view import JobsView
        from elasticd.store import open_store
        m = cfg.membership
        self.node_id, self.cfg, self.records = node_id, cfg, records
        # Lease refreshes and watches as open_cluster_store sends them: membership.*_transport.
        self.store = CountingStore(open_store("etcd3", [url], prefix=prefix,
                                              timeout=cfg.etcd.request_timeout,
                                              lease_transport=m.lease_transport,
                                              watch_transport=m.watch_transport))
        self.keeper = LeaseKeeper(self.store, node_id, m.lease_ttl, m.refresh_interval,
                                  self.info, records=records)
        self.watcher = NodeWatcher(self.store, node_id, m.lost_node_retention,
                                   records=records, recheck=m.record_recheck,
                                   port_recheck=m.port_record_recheck)
        self.witness = LossWitness(self.store, node_id, self.watcher,
                                   lambda: self.keeper.lease, records=records,
                                   slots=m.loss_witnesses, retry=m.watch_retry,
                                   list_interval=m.witness_list_interval,
                                   retention=m.lost_node_retention)
        self.view = JobsView(self.store, records=records, retry=m.watch_retry)
        self.phases = PhaseWatch(self.store, records=records, retry=m.watch_retry)
        self.started_at = time.time()
        self.rdzv = self.result = self.publisher = self.job_phases = self.reader = None

    def info(self) -> dict:
        return node_info(self.node_id, "sim", self.started_at, self.cfg.membership.lease_ttl)

    def start(self) -> None:
        from elasticd.store import StoreUnavailable
        try:   # as cluster/node.py: etcd slow to answer; the keeper registers later
            self.keeper.register()
        except StoreUnavailable:
            self.keeper.health = "unavailable"
        self.keeper.start()
        self.witness.start()
        self.view.start()

    def join(self, job_id: str, n: int, release: float, stop: threading.Event) -> None:
        from elasticd.rendezvous.protocol import JobLimits
        from elasticd.rendezvous.round import ClusterRendezvous
        from elasticd.store import StoreError
        r = self.cfg.rendezvous
        limits = JobLimits(min_nodes=n, max_nodes=n, max_restarts=0, last_call=0.0,
                           join_timeout=r.join_timeout)
        if self.rdzv is not None:   # the last job ended here: as the agent's end does
            self.rdzv.close()
        self.rdzv = ClusterRendezvous(self.store, self.view, job_id, self.node_id, "127.0.0.1",
                                      RANKS, lambda: self.keeper.lease, limits, poll=r.poll)
        time.sleep(max(0.0, release - time.time()))
        self.failed = None
        while True:
            try:
                self.result = self.rdzv.next_round(stop)
                break
            except StoreError:   # as the agent does (agent/loop.py): wait, join again
                self.store.errors += 1
                stop.wait(self.cfg.membership.watch_retry)
            except Exception as exc:   # the round ended (RoundFinal): the parent says so
                self.failed = f"{type(exc).__name__}: {str(exc)[:300]}"
                return
        self.done_at = time.time()

    def publish_rows(self) -> None:
        """This node's worker rows and recovery summary, as the agent publishes them
        after each start of its workers (agent/loop.py)."""
        from elasticd.jobs.records import WorkerRow, WorkerState
        from elasticd.jobs.summary import RecoverySummary
        base = self.result.place.group_rank * RANKS
        rows = [WorkerRow(rank=base + i, local_rank=i, pid=10_000 + i,
                          state=WorkerState.RUNNING, exit_code=0, node_id=self.node_id)
                for i in range(RANKS)]
        from elasticd.store import StoreError
        try:
            self.rdzv.publish_workers(rows, RecoverySummary(
                restarts_by_layer={"process": 0}, restart_budget={}, last_failure=None,
                attempts=()))
        except StoreError:   # as the agent's _try: logged there, the job goes on
            self.store.errors += 1

    def publish(self) -> None:
        """Start publishing at a random point of one refresh interval: real nodes' jobs
        do not all start on the same tick, and bursts would fool a short window."""
        from elasticd.agent.phase_peers import PeerReader
        from elasticd.hangs.phase_board import PhasePublisher
        self.job_phases = self.phases.for_job(self.rdzv.job_id, self.node_id,
                                              lambda: self.keeper.lease)
        # As agent/attempt.py: the records (the first member) or their digest (the others).
        self.reader = PeerReader(self.rdzv.job_id, self.node_id, self.job_phases,
                                 self.cfg.agent)
        self.read_peers()
        self.publisher = PhasePublisher.for_agent(self.rdzv.job_id, self.node_id,
                                                  self.cfg.agent, self.job_phases.publish,
                                                  self.job_phases.delete)
        threading.Timer(random.uniform(0, self.publisher.refresh), self.publisher.start).start()

    def offer(self, t: float) -> None:
        """What the agent's tracker would offer now: RANKS ranks training at ~10 steps/s."""
        self.publisher.offer(training_phases(self.node_id, self.result.place.round,
                                             self.result.place.group_rank * RANKS,
                                             t - self.done_at))

    def read_peers(self) -> None:
        """What the agent's tracker reads of the other nodes (the first member folds and
        offers the digest here)."""
        self.reader.peers(list(self.result.members), self.result.place.round)

    def counters(self) -> dict:
        with self.store._lock:
            return {"ops": dict(self.store.ops), "delivered": dict(self.store.delivered),
                    "errors": self.store.errors, "revision": self.view.revision,
                    "lapsed": self.keeper.reregistrations,
                    "phase_writes": dict(self.store.phase_writes),
                    "digest_writes": dict(self.store.digest_writes),
                    "record_writes": dict(self.store.record_writes),
                    # what it reads of its job's phases: "records" or "digests"
                    "reads": ({self.reader.job_id: self.reader.reading}
                              if self.reader is not None and self.reader.reading else {}),
                    "node_puts": self.store.node_puts, "row_puts": self.store.row_puts,
                    "follows": sorted(set(self.phases.following())
                                      | set(self.view.following()))}


# ---------------------------------------------------------------- a worker process

LOG_TO = ""     # --log: set before the worker processes fork

def worker(conn, node_ids: list, url: str, prefix: str, key: bytes, overrides: dict) -> None:
    """Runs ``node_ids`` and answers the parent's commands on ``conn`` until 'stop'."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import logging
    logging.basicConfig(level=logging.ERROR)
    if LOG_TO:   # --log: the rendezvous' own lines (why each round opened and closed)
        handler = logging.FileHandler(LOG_TO)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(message)s"))
        rdzv = logging.getLogger("elasticd.rendezvous")
        rdzv.setLevel(logging.INFO)
        rdzv.addHandler(handler)
    from elasticd.trust.sealed import SealedRecords
    cfg = sim_config(overrides)
    records = SealedRecords(key, prefix)
    nodes = [SimNode(n, url, prefix, records, cfg) for n in node_ids]
    stop = threading.Event()
    feeding = threading.Event()

    def feeder():
        last_peers = 0.0
        while not stop.wait(OFFER_EVERY):
            if not feeding.is_set():
                continue
            t = time.monotonic()
            peers = t - last_peers >= PEERS_EVERY
            for node in nodes:
                node.offer(t)
                if peers:
                    node.read_peers()
            if peers:
                last_peers = t
    threading.Thread(target=feeder, daemon=True).start()

    def handle(cmd: str, arg):
        if cmd == "start":
            deadline = time.monotonic() + arg      # one limit for all: not one per node
            for node in nodes:
                node.start()
            for node in nodes:
                node.view.synced.wait(max(0.0, deadline - time.monotonic()))
            behind = sum(not n.view.synced.is_set() for n in nodes)
            if behind:
                lapsed = sum(n.keeper.reregistrations for n in nodes)
                raise RuntimeError(f"{behind} of {len(nodes)} nodes' watches not synced "
                                   f"within {arg:g} s ({lapsed} registrations again after "
                                   "a lapsed lease)")
            return True
        if cmd == "seen":   # how many live nodes this process's first node lists (a node
            # reads the records when asked: one list a process, not one a node)
            return [len(nodes[0].watcher.snapshot().live)] if nodes else []
        if cmd == "join":   # ({node: (job id, its nodes)}, {job id: its release wall time},
            jobs, releases, _forming = arg      # the jobs that form a round: all here)
            threads = [threading.Thread(target=node.join,
                                        args=(*jobs[node.node_id],
                                              releases[jobs[node.node_id][0]], stop),
                                        daemon=True)
                       for node in nodes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            failed = [f"{node.node_id}: {node.failed}" for node in nodes if node.failed]
            if failed:
                raise RuntimeError(f"{len(failed)} nodes got no round: {failed[0]}")
            return [(node.rdzv.job_id, node.done_at, node.result.place.group_rank,
                     node.result.place.group_world_size) for node in nodes]
        if cmd == "holds":          # whether every node's view holds the jobs ``arg``
            return all(node.view.job(j) is not None for node in nodes for j in arg)
        if cmd == "rows":
            for node in nodes:
                node.publish_rows()
            return True
        if cmd == "done":   # every node's workers exited 0: its mark, as the agent's
            for node in nodes:
                node.rdzv.mark_done(node.result.place.round)
                node.rdzv.status(node.result)   # the first member's watch of the marks
            return True
        if cmd == "publish":
            for node in nodes:
                node.publish()
            feeding.set()
            return True
        if cmd == "counters":
            return {"nodes": [node.counters() for node in nodes], "pid": os.getpid()}
        if cmd == "join_times":   # replay processes only: [(last join, closed_at)]
            return []
        if cmd == "witnesses":   # this process's loss witnesses: [(node, slot)]
            return [(n.node_id, n.witness.slot) for n in nodes if n.witness.slot is not None]
        if cmd == "stop":
            stop.set()
            for node in nodes:
                if node.publisher is not None:
                    node.publisher.stop(1.0)
                if node.reader is not None:
                    node.reader.stop()
                node.phases.stop()
                node.view.request_stop()
                node.witness.request_stop()
            stops = [threading.Thread(target=node.keeper.stop) for node in nodes]
            for t in stops:       # each revokes its lease: at once, not one after another
                t.start()
            for t in stops:
                t.join()
            return True
        raise ValueError(f"unknown command {cmd!r}")

    while True:
        cmd, arg = conn.recv()
        try:
            conn.send(("ok", handle(cmd, arg)))
        except Exception:   # the parent says what went wrong, then stops
            import traceback
            conn.send(("error", traceback.format_exc()))
        if cmd == "stop":
            return


def sim_config(overrides: dict):
    """This tree's default settings with the --set overrides (section.field=value),
    checked as the daemon checks its own (no config file, no environment)."""
    import tempfile
    from elasticd.config import load
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as empty:
        return load(path=empty.name, env={}, overrides=overrides)


# ---------------------------------------------------------------- the parent

def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"requests": 0.0, "writes": 0.0}
    for line in text.splitlines():
        # Unary calls and stream messages alike: each keep-alive on a lease stream counts
        # (grpc_server_started_total would count the stream once).
        if line.startswith("grpc_server_msg_received_total{") and "Health" not in line:
            out["requests"] += float(line.split()[-1])
        elif line.startswith("etcd_server_proposals_committed_total "):
            out["writes"] = float(line.split()[1])
    return out


class Sim:
    """One N: the worker processes, etcd's counters and CPU."""

    def __init__(self, etcd: EtcdServer, n: int, procs: int, overrides: dict,
                 full: int | None = None, replay_procs: int = 2):
        """``full``: the first ``full`` ids run the daemon's code, the rest are replay
        nodes (bench/scale_replay.py) in ``replay_procs`` processes; None: all run it."""
        self.etcd, self.n = etcd, n
        self.prefix = f"/sim{uuid.uuid4().hex[:8]}"
        self.ids = [f"n{i:04d}" for i in range(n)]
        # The last ids: each job's first member (the lowest id of its nodes, which reads
        # its phase records) survives, so the window after the loss still measures them.
        self.victims = self.ids[-max(1, n // 10):]
        self.full = n if full is None else full
        if self.full < n and self.full > n - len(self.victims):
            raise ValueError(f"--full {self.full} of {n}: the killed 10 % are the last ids "
                             "and must all be replay nodes or all run the daemon's code")
        rest = self.ids[:-len(self.victims)]
        code, replay = rest[:self.full], rest[self.full:]
        groups = [self.victims] + [code[i::procs] for i in range(procs)]
        targets = [worker if self.full == n else replay_worker] + [worker] * procs
        if replay:
            groups += [replay[i::replay_procs] for i in range(replay_procs)]
            targets += [replay_worker] * replay_procs
        groups, targets = zip(*[(g, t) for i, (g, t) in enumerate(zip(groups, targets))
                                if g or i == 0])     # the victims first: procs[0]
        self.code_procs = [i for i, t in enumerate(targets) if t is worker and i > 0]
        ctx = multiprocessing.get_context("fork")
        self.key = os.urandom(32)
        self.conns, self.procs = [], []
        for group, target in zip(groups, targets):
            a, b = ctx.Pipe()
            p = ctx.Process(target=target, args=(b, group, etcd.url, self.prefix, self.key,
                                                 overrides), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        self.etcd_proc = psutil.Process(etcd.proc.pid)
        self.sim_procs = [psutil.Process(p.pid) for p in self.procs]

    def ask(self, cmd: str, arg=None, which=None) -> list:
        conns = self.conns if which is None else [self.conns[i] for i in which]
        for c in conns:
            c.send((cmd, arg))
        replies = [c.recv() for c in conns]
        for status, value in replies:
            if status != "ok":
                raise RuntimeError(f"a simulator process failed at {cmd!r}:\n{value}")
        return [value for _, value in replies]

    def counters(self, which=None) -> dict:
        """The counters of the processes ``which`` (None: all), summed."""
        return self._sum(self.ask("counters", which=which))

    def _by_proc(self, which=None) -> dict:
        """Each asked process's counters, by its index in ``conns``."""
        return dict(zip(range(len(self.conns)) if which is None else which,
                        self.ask("counters", which=which)))

    @staticmethod
    def _sum(replies) -> dict:
        total = {"ops": Counter(), "delivered": Counter(), "revisions": [], "errors": 0,
                 "phase_writes": Counter(), "followers": Counter(), "lapsed": 0,
                 "digest_writes": Counter(), "record_writes": Counter(), "readers": Counter(),
                 "node_puts": 0, "row_puts": 0, "error_kinds": Counter()}
        for got in replies:
            for node in got["nodes"]:
                total["ops"].update(node["ops"])
                total["delivered"].update(node["delivered"])
                total["phase_writes"].update(node["phase_writes"])
                total["digest_writes"].update(node.get("digest_writes", {}))
                total["record_writes"].update(node.get("record_writes", {}))
                total["readers"].update(node.get("reads", {}).items())
                total["followers"].update(node["follows"])
                total["revisions"].append(node["revision"])
                total["errors"] += node["errors"]
                total["error_kinds"].update(node.get("error_kinds", {}))
                total["lapsed"] += node["lapsed"]
                total["node_puts"] += node["node_puts"]
                total["row_puts"] += node.get("row_puts", 0)
        return total

    def threads(self) -> int:
        def count(p):
            try:
                return p.num_threads()
            except psutil.Error:
                return 0
        return sum(count(p) for p in self.sim_procs)

    def cpu(self) -> tuple[float, list]:
        def busy(p):
            try:
                t = p.cpu_times()
                return t.user + t.system
            except psutil.Error:
                return 0.0
        return busy(self.etcd_proc), [busy(p) for p in self.sim_procs]

    def window(self, name: str, seconds: float, alive=None) -> dict:
        """Counters over ``seconds`` of steady state."""
        r0, e0, (ecpu0, scpu0) = self._by_proc(alive), scrape(self.etcd.url), self.cpu()
        t0 = time.monotonic()
        time.sleep(seconds)
        r1, e1, (ecpu1, scpu1) = self._by_proc(alive), scrape(self.etcd.url), self.cpu()
        span = time.monotonic() - t0
        c0, c1 = self._sum(r0.values()), self._sum(r1.values())
        code_node = None   # with replay nodes: what reached the daemon-code nodes, apart
        code = [i for i in self.code_procs if i in r1] if self.full < self.n else []
        if code:
            f0, f1 = (self._sum(r[i] for i in code) for r in (r0, r1))
            code_node = (_delivered(f1["delivered"]) - _delivered(f0["delivered"])) \
                / max(1, len(f1["revisions"])) / span
        nodes = len(c1["revisions"])
        ops = {k: (c1["ops"][k] - c0["ops"].get(k, 0)) / span for k in c1["ops"]}
        got = {k: (c1["delivered"][k] - c0["delivered"].get(k, 0)) / span
               for k in c1["delivered"]}
        key_writes = sum(v for k, v in ops.items()
                         if k in ("put", "create", "compare_and_swap", "delete"))
        phase_writes = {j: (c1["phase_writes"][j] - c0["phase_writes"].get(j, 0)) / span
                        for j in c1["phase_writes"]}
        digest_writes = {j: (c1["digest_writes"][j] - c0["digest_writes"].get(j, 0)) / span
                         for j in c1["digest_writes"]}
        record_writes = {j: (c1["record_writes"][j] - c0["record_writes"].get(j, 0)) / span
                         for j in c1["record_writes"]}
        node_puts = (c1["node_puts"] - c0["node_puts"] + c1["row_puts"] - c0["row_puts"]) \
            / span      # neither is watched
        delivered = _delivered(got)
        # Every watcher gets every write of the job list and every delete of a node key
        # (no node's puts: the node watch is of deletes only); a write of a job's rounds
        # reaches the nodes that follow its job, a phase record the node that reads the
        # job's records (the round's first member), a digest those that read its digests
        # (of those counted: alive; after the loss, a job whose first member was lost has
        # no reader of its records until a new round, which the simulator does not open).
        scoped = sum(phase_writes.values()) + sum(digest_writes.values()) \
            + sum(record_writes.values())
        readers = c1["readers"]
        expected = (key_writes - scoped - node_puts) * nodes \
            + sum(w * c1["followers"][j] for j, w in phase_writes.items()) \
            + sum(w * readers[(j, "records")] for j, w in record_writes.items()) \
            + sum(w * readers[(j, "digests")] for j, w in digest_writes.items())
        sim = [(b - a) / span * 100 for a, b in zip(scpu0, scpu1)]
        return {"window": name, "n": self.n, "writes": (e1["writes"] - e0["writes"]) / span,
                "req_node": (e1["requests"] - e0["requests"]) / span / nodes,
                "ops_node": sum(ops.values()) / nodes, "ops": ops,
                "delivered": delivered, "per_node": delivered / nodes, "by_kind": got,
                "per_code_node": code_node,
                "kept_up": delivered / expected * 100 if expected else 100.0,
                "etcd_cpu": (ecpu1 - ecpu0) / span * 100, "sim_cpu": sum(sim),
                "sim_max": max(sim), "threads": self.threads(), "load": os.getloadavg()[0],
                "errors": c1["errors"] - c0["errors"]}

    def stop(self) -> None:
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    c.send(("stop", None))
                    if c.poll(10):
                        c.recv()   # ("ok", True) or what failed: stopping either way
                except (OSError, EOFError):
                    pass
            p.join(5)
            if p.is_alive():
                p.kill()


def _delivered(by_kind: dict) -> float:
    """The deliveries of every kind ("again" counts some of them a second time)."""
    return sum(v for k, v in by_kind.items() if k != "again")


def verdict(w: dict) -> str:
    """Who limits this window: etcd, the simulator (its Python processes), or neither."""
    if w["etcd_cpu"] >= 85:
        return "etcd-bound"
    if w["sim_max"] >= 85 and w["kept_up"] < 95:
        return "simulator-bound (watchers behind)"
    if w["sim_max"] >= 85:
        return "simulator near its limit"
    if w["kept_up"] < 95:
        return "watchers behind (machine loaded)"
    return "ok"


def form(sim: Sim, jobs: dict, stagger: float = 0.0) -> dict:
    """Create the jobs (``{node: (job, its nodes)}``; node None: every node) and
    release every node's next_round at once (``stagger``: each job's nodes that many
    seconds after the last job's): seconds from the first release until the last node
    has its result."""
    from elasticd.rendezvous.round import create_job
    from elasticd.store import open_store
    from elasticd.trust.sealed import SealedRecords
    if None in jobs:
        jobs = {node: jobs[None] for node in sim.ids}
    store = open_store("etcd3", [sim.etcd.url], prefix=sim.prefix, timeout=10.0)
    records = SealedRecords(sim.key, sim.prefix)
    for job in sorted({j for j, _ in jobs.values()}):
        create_job(store, job, {"id": job}, time.time(), records=records)
    store.close()
    names = sorted({j for j, _ in jobs.values()})
    deadline = time.monotonic() + 30
    while not all(sim.ask("holds", names)) and time.monotonic() < deadline:
        time.sleep(0.05)
    release = time.time() + 0.5
    releases = {job: release + i * stagger for i, job in enumerate(names)}
    # a job with a daemon-code member forms its round (its replay members join it); a
    # job of replay nodes alone forms none (no node of it decides a round)
    code = set(sim.ids[:sim.full])
    forming = {job for node, (job, _) in jobs.items() if node in code}
    by_proc = sim.ask("join", (jobs, releases, forming))
    results = [r for got in by_proc for r in got]
    ranks: dict = {}
    for job, _, rank, world in results:
        ranks.setdefault(job, []).append((rank, world))
    ok = all(sorted(r for r, _ in got) == list(range(len(got)))
             and {w for _, w in got} == {len(got)} for got in ranks.values())
    out = {"took": max(r[1] for r in results) - release, "ok": ok}
    times = [t for got in sim.ask("join_times") for t in got]
    if times and len(names) == 1:   # one job with replay members: where its time went
        out["joins_written"] = max(t[0] for t in times) - release
        code = [r[1] for i, got in enumerate(by_proc) if i in sim.code_procs for r in got]
        replay = [r[1] for i, got in enumerate(by_proc) if i not in sim.code_procs
                  for r in got]
        out["code_took"] = max(code) - release if code else None
        out["replay_took"] = max(replay) - release if replay else None
        closed = [t[1] for t in times if t[1]]
        out["closed"] = max(closed) - release if closed else None
    return out


def lost_rows(sim: Sim, since: float, limit: float) -> dict:
    """{victim: when a loss witness saw its key go (its lost row's time; None: no row
    within ``limit`` seconds)}: the lost rows listed every 0.1 s, as `elasticctl nodes`
    lists them (cluster/lost.py), none older than ``since`` (a lease that lapsed under
    load before the kill is not this loss)."""
    from elasticd.cluster.lost import LOST, open_lost
    from elasticd.store import StoreError, open_store
    from elasticd.trust.sealed import Refused, SealedRecords
    store = open_store("etcd3", [sim.etcd.url], prefix=sim.prefix, timeout=10.0)
    records = SealedRecords(sim.key, sim.prefix)
    seen: dict = {v: None for v in sim.victims}
    deadline = time.monotonic() + limit
    try:
        while None in seen.values() and time.monotonic() < deadline:
            try:
                kvs, _ = store.list(LOST)
            except StoreError:
                kvs = []
            for kv in kvs:
                try:
                    row = open_lost(records, kv.key, kv.value)
                except Refused:
                    continue
                if row.node_id in seen and row.lost_at >= since:
                    seen[row.node_id] = min(seen[row.node_id] or row.lost_at, row.lost_at)
            time.sleep(0.1)
    finally:
        store.close()
    return seen


def run_n(etcd: EtcdServer, n: int, procs: int, seconds: float, overrides: dict,
          job_nodes: int = 0, full: bool = True, stagger: float = 0.0,
          code_nodes: int | None = None, replay_procs: int = 2) -> dict:
    sim = Sim(etcd, n, procs, overrides, code_nodes, replay_procs)
    # the N-node job: its daemon-code nodes decide its round, its replay nodes join it
    out = {"n": n}
    try:
        t0 = time.monotonic()
        # No node receives another's registration (its node watch is of deletes only);
        # the limit keeps room for the N x N that the records' watch once cost.
        limit = max(60.0, n * n / 5000)
        sim.ask("start", limit)
        deadline = t0 + limit
        while not all(min(seen) >= n for seen in sim.ask("seen")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes were not all listed within {limit:g} s")
            time.sleep(0.1)
        out["start"] = time.monotonic() - t0
        print(f"   N = {n}: all up and listed in {out['start']:.1f} s", flush=True)
        out["idle"] = sim.window("idle", seconds)
        w = out["idle"]     # printed now: a later step that fails keeps this
        print(f"   N = {n} idle: etcd {w['etcd_cpu']:.0f} % of a core, {w['writes']:.0f} "
              f"writes/s, {w['req_node']:.2f} etcd requests and {w['per_node']:.1f} "
              f"deliveries a node a second; simulator {w['sim_cpu']:.0f} % (max "
              f"{w['sim_max']:.0f}), {w['threads']} threads, load {w['load']:.1f}", flush=True)
        out["idle_errors"] = sim.counters()["errors"]

        out["rdzv"], out["rdzv_ok"], out["rdzv_errors"] = None, True, 0
        if full or not job_nodes:
            rdzv = form(sim, {None: ("j" + uuid.uuid4().hex[:7], n)})
            out["rdzv"], out["rdzv_ok"] = rdzv["took"], rdzv["ok"]
            out["rdzv_errors"] = sim.counters()["errors"] - out["idle_errors"]
            out["rdzv_joins_written"] = rdzv.get("joins_written")
            out["rdzv_closed"] = rdzv.get("closed")
            out["rdzv_code"], out["rdzv_replay"] = rdzv.get("code_took"), rdzv.get("replay_took")
        if job_nodes and job_nodes < n:   # the running window: jobs of job_nodes nodes
            jobs = {}
            for k in range(0, n, job_nodes):
                job, size = "j" + uuid.uuid4().hex[:7], len(sim.ids[k:k + job_nodes])
                jobs.update({node: (job, size) for node in sim.ids[k:k + job_nodes]})
            before = sim.counters()["delivered"]
            many = form(sim, jobs, stagger)
            out["jobs_rdzv"], out["jobs_ok"] = many["took"], many["ok"]
            # what reached the nodes' job watches (list and rounds) while they formed
            after = sim.counters()["delivered"]
            out["jobs_deliveries"] = sum(after.get(k, 0) - before.get(k, 0)
                                         for k in ("jobs", "rounds")) / n
        # Every node publishes its worker rows once, as its agent does after a start:
        # what they cost the nodes' watches (each row reached every node of the job
        # while the rows lay under the job's rounds).
        before = sim.counters()["delivered"].get("workers", 0)
        sim.ask("rows")
        time.sleep(2.0)
        out["row_deliveries"] = (sim.counters()["delivered"].get("workers", 0) - before) / n
        sim.ask("publish")
        a = sim_config(overrides).agent
        time.sleep(a.phase_refresh_interval + 1.0)   # every publisher started, settled
        out["running"] = sim.window("running", seconds)
        # Every node's workers exit 0: each marks them done (the exit barrier), as its
        # agent does; what the marks cost the watches (every mark reached every node of
        # the job while the marks lay under the job's rounds).
        before = sim.counters()["delivered"].get("done", 0)
        sim.ask("done")
        time.sleep(2.0)
        out["done_deliveries"] = (sim.counters()["delivered"].get("done", 0) - before) / n

        survivors = list(range(1, len(sim.conns)))
        victim = sim.procs[0]
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(5)
        rows = lost_rows(sim, killed_at, 30.0)
        got = [t - killed_at for t in rows.values() if t is not None]
        out["loss_median"] = median(got)
        out["loss_last"] = max(got) if len(got) == len(rows) else None
        out["loss_seen"] = (len(got), len(rows))
        out["witnesses"] = sorted(w for got in sim.ask("witnesses", which=survivors)
                                  for w in got)
        out["after_loss"] = sim.window("after loss", min(seconds, 5.0), alive=survivors)
        last = sim.counters(which=survivors)
        out["lapsed"] = last["lapsed"]
        out["replay_errors"] = dict(last["error_kinds"])   # what the replay nodes saw fail
    finally:
        sim.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", help="comma-separated N (default 20,50,100; --quick: 10)")
    ap.add_argument("--seconds", type=float, help="each measuring window (default 10; "
                                                  "--quick: 2)")
    ap.add_argument("--procs", type=int, default=2,
                    help="worker processes for the surviving 90 %% of the nodes (default 2)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a setting for every simulated node (repeatable)")
    ap.add_argument("--job-nodes", type=int, default=0, metavar="S",
                    help="the running window with jobs of S nodes each (N / S jobs, formed "
                         "at once after the N-node rendezvous) instead of the N-node job")
    ap.add_argument("--lease-transport", choices=("grpc", "gateway"),
                    help="membership.lease_transport for every simulated node (default: "
                         "this tree's setting, grpc)")
    ap.add_argument("--watch-transport", choices=("grpc", "gateway"),
                    help="membership.watch_transport for every simulated node (default: "
                         "this tree's setting, grpc)")
    ap.add_argument("--stagger", type=float, default=0.0, metavar="S",
                    help="with --job-nodes: start the jobs of S nodes one after another, "
                         "S seconds apart (default 0: all at once), as jobs are submitted "
                         "over time; their formation is then timed from the first")
    ap.add_argument("--no-full-job", dest="full", action="store_false",
                    help="with --job-nodes: skip the N-node job's rendezvous (its N "
                         "next_round calls at once)")
    ap.add_argument("--daemon-nodes", type=int, default=None, metavar="F",
                    help="with --job-nodes: only the first F of the N nodes (a multiple of "
                         "S) run the daemon's code; the others, the killed 10 %% among "
                         "them, are replay nodes (bench/scale_replay.py: a daemon's "
                         "steady-state etcd traffic from one asyncio loop a process), so "
                         "etcd can be loaded with more nodes than 2 cores run the daemon's "
                         "code for; in the N-node job's round the replay nodes join and "
                         "the daemon's code decides (default: all N run it)")
    ap.add_argument("--replay-procs", type=int, default=2,
                    help="processes for the surviving replay nodes (default 2)")
    ap.add_argument("--replay-node-watch", action="store_true",
                    help="every replay node watches every node key's deletes, as every "
                         "daemon did before the loss witnesses (cluster/witness.py), "
                         "instead of the witness slots' deletes alone: what that costs "
                         "etcd when many nodes go at once")
    ap.add_argument("--quick", action="store_true", help="N = 10, 2 s windows: well under a "
                                                         "minute")
    ap.add_argument("--json", help="write the measurements here too")
    ap.add_argument("--log", metavar="FILE", default="",
                    help="append the simulated nodes' rendezvous log lines (INFO: why each "
                         "round opened and closed) to FILE")
    args = ap.parse_args(argv)
    global LOG_TO
    LOG_TO = args.log
    scale_replay.NODE_WATCH = args.replay_node_watch   # read in the forked processes
    args.nodes = args.nodes or ("10" if args.quick else "20,50,100")
    args.seconds = args.seconds or (2.0 if args.quick else 10.0)
    if etcd_binary() is None:
        print("no etcd binary (install etcd or set ELASTICD_TEST_ETCD)", file=sys.stderr)
        return 2
    if args.daemon_nodes is not None and (
            not args.job_nodes or args.daemon_nodes % args.job_nodes or args.daemon_nodes < 0):
        ap.error("--daemon-nodes needs --job-nodes S and a multiple of S (a job's nodes "
                 "all run the daemon's code or all replay)")
    overrides = dict(s.split("=", 1) for s in args.set)
    if args.lease_transport:
        overrides["membership.lease_transport"] = args.lease_transport
    if args.watch_transport:
        overrides["membership.watch_transport"] = args.watch_transport
    cfg = sim_config(overrides)
    a, m = cfg.agent, cfg.membership
    print(f"scale simulator: {machine()}; elasticd {revision()}")
    print(f"settings: lease TTL {m.lease_ttl} s, refresh {m.refresh_interval:g} s over "
          f"{m.lease_transport}, watches over {m.watch_transport}; phases "
          f"every {a.phase_publish_interval:g} s"
          + (f", refreshed every {a.phase_refresh_interval:g} s"
             if hasattr(a, "phase_refresh_interval") else "")
          + f"; {args.procs}+1 worker processes, {args.seconds:g} s windows"
          + (f"; running: jobs of {args.job_nodes} nodes" if args.job_nodes else
             "; running: the N-node job"))
    ns = [int(x) for x in args.nodes.split(",") if x.strip()]
    runs = []
    with EtcdServer() as etcd:
        for n in ns:
            print(f"\n-- N = {n}", flush=True)
            code = None if args.daemon_nodes is None or args.daemon_nodes >= n \
                else args.daemon_nodes
            if code is not None and code > n - max(1, n // 10):
                ap.error(f"--daemon-nodes {code} of N = {n}: the killed 10 % (the last "
                         "ids) must be replay nodes")
            if code is not None:
                print(f"   {code} nodes run the daemon's code, {n - code} replay its "
                      "etcd traffic (bench/scale_replay.py)", flush=True)
            r = run_n(etcd, n, args.procs, args.seconds, overrides, args.job_nodes, args.full,
                      args.stagger, code, args.replay_procs)
            runs.append(r)
            if args.json:       # each N as it ends: a later N that fails keeps these
                with open(args.json, "w") as fh:
                    json.dump(runs, fh, indent=1)
            print(f"   all {n} nodes up and listed in {r['start']:.1f} s; "
                  + (f"rendezvous {r['rdzv']:.3f} s ({'ok' if r['rdzv_ok'] else 'WRONG RANKS'}, "
                     f"{r['rdzv_errors']} failed calls retried"
                     + (f"; the replay nodes' joins all written after "
                        f"{fmt(r['rdzv_joins_written'], 3)}, the round closed by its "
                        f"decider after {fmt(r['rdzv_closed'], 3)}; the last daemon-code "
                        f"node had its result after {fmt(r['rdzv_code'], 3)}, the last replay "
                        f"node its closed state after {fmt(r['rdzv_replay'], 3)}"
                        if r.get("rdzv_joins_written") is not None else "")
                     + "); " if r["rdzv"] is not None else "N-node rendezvous skipped; ")
                  + (f"{-(-n // args.job_nodes)} jobs of {args.job_nodes} formed "
                     + (f"{args.stagger:g} s apart" if args.stagger else "at once") + " in "
                     f"{r['jobs_rdzv']:.3f} s ({'ok' if r['jobs_ok'] else 'WRONG RANKS'}, "
                     f"{r['jobs_deliveries']:.0f} job-key deliveries per node); "
                     if 'jobs_rdzv' in r else "")
                  + f"worker rows published by every node: {r['row_deliveries']:.1f} row "
                    f"deliveries per node; done marks by every node: "
                    f"{r['done_deliveries']:.1f} deliveries per node; "
                  + f"loss of {max(1, n // 10)} recorded by the loss witnesses "
                  f"({', '.join(f'{w} (slot {s})' for w, s in r['witnesses']) or 'none'}): "
                  f"median {fmt(r['loss_median'])}, last {fmt(r['loss_last'])} "
                  f"({r['loss_seen'][0]} of {r['loss_seen'][1]} lost rows within 30 s); "
                  f"survivors' leases lapsed and taken again: {r['lapsed']}", flush=True)
    rows = []
    for r in runs:
        for w in (r["idle"], r["running"], r["after_loss"]):
            rows.append([r["n"], w["window"], f"{w['writes']:.0f}", f"{w['req_node']:.2f}",
                         f"{w['ops_node']:.2f}", f"{w['delivered']:.0f}", f"{w['per_node']:.1f}",
                         f"{(w['by_kind'].get('phases', 0) + w['by_kind'].get('digests', 0)) / max(1, r['n']):.1f}",
                         "-" if w.get("per_code_node") is None
                         else f"{w['per_code_node']:.1f}",
                         f"{w['by_kind'].get('again', 0):.0f}",
                         f"{w['kept_up']:.0f} %", f"{w['etcd_cpu']:.0f} %",
                         f"{w['sim_cpu']:.0f} % (max {w['sim_max']:.0f})",
                         w["threads"], f"{w['load']:.1f}", w["errors"], verdict(w)])
    print()
    print(table(rows, ["N", "window", "etcd writes/s", "etcd req/node/s", "store calls/node/s",
                       "deliveries/s", "deliveries/node/s", "of them phases/node/s",
                       "deliveries/node/s, daemon-code nodes", "of all, received again/s",
                       "kept up",
                       "etcd CPU", "simulator CPU", "simulator threads", "load",
                       "failed calls", "limit"]))
    print()
    print(table([[r["n"], fmt(r["rdzv"], 3), fmt(r["loss_median"]), fmt(r["loss_last"])]
                 for r in runs], ["N", "rendezvous (all N)", "loss recorded, median",
                                  "loss recorded, last"]))
    big = runs[-1]
    w = big["running"]
    if args.daemon_nodes is not None and big["n"] > args.daemon_nodes:   # replay nodes
        code = args.daemon_nodes
        emit_row("scale-sim-replay", elasticd=(
            f"N={big['n']} ({code} run the daemon's code, {big['n'] - code} replay its "
            f"traffic), {-(-big['n'] // args.job_nodes)} jobs of {args.job_nodes}: etcd "
            f"{big['idle']['etcd_cpu']:.0f} % of a core idle, {w['etcd_cpu']:.0f} % running; "
            f"{w['per_node']:.1f} deliveries/node/s; loss of {max(1, big['n'] // 10)} recorded "
            f"after {fmt(big['loss_median'])} (median), {fmt(big['loss_last'])} (last)"
            + (f"; the {big['n']}-node job's round: its last join written after "
               f"{fmt(big['rdzv_joins_written'])}, closed after {fmt(big['rdzv_closed'])}, "
               f"every node's result after {fmt(big['rdzv'])}"
               if big.get("rdzv_joins_written") is not None else "")))
    else:
        emit_row("scale-sim", elasticd=(
            f"N={big['n']}: {w['writes']:.0f} etcd writes/s, {w['delivered']:.0f} "
            f"deliveries/s ({w['per_node']:.0f}/node), etcd {w['etcd_cpu']:.0f} % of a core, "
            f"rendezvous {fmt(big['rdzv'])}, loss recorded {fmt(big['loss_last'])}"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=1)
    return 0


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f} s"


if __name__ == "__main__":
    sys.exit(main())
