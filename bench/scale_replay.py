"""Replay nodes for bench/scale_sim.py: a daemon's steady-state etcd traffic, cheaply.

A simulated node of scale_sim.py runs the daemon's own code, which holds about
ten threads (its lease keep-alive stream, its watch stream, a follower a
watch, gRPC's own); on 2 cores the simulator's processes, not etcd, stop
between 200 and 300 such nodes. A replay node sends etcd what such a node
sends in steady state, each over a connection and streams of its own, with
all the replay nodes of a process driven from ONE asyncio loop (grpc.aio)
instead of threads: what etcd receives is the same a node, what the
simulator spends is a fraction (lease_bench: 0.4 ms a keep-alive against the
store's 1.4 ms). So etcd's cost and the loss detection can be measured at
1,000 nodes while the nodes of the daemon's own code stay few enough to run.

A replay node, as a daemon (cluster/membership.py, rendezvous/view.py,
rendezvous/phase_watch.py):
  - grants a lease of membership.lease_ttl and creates its node key under it
    (the daemon's sealed node record), through the JSON gateway with the
    daemon's own store (Etcd3Store, one a node), as the daemon does;
  - refreshes the lease every membership.refresh_interval on its own gRPC
    channel's LeaseKeepAlive stream; a lease found ended is granted again and
    the node key created again (counted as lapsed, as LeaseKeeper's
    re-registrations);
  - keeps one Watch stream on a channel of its own, carrying the watches a daemon
    keeps: the loss witness slots' deletes (NOPUT, the keys alone: a daemon
    without a slot; a witness is a daemon-code node) and the job
    list whole; while its job runs, the job's rounds whole, its joins (whole
    on the job's first member, else their deletes) and the job's phase records
    (the first member) or its phase digests (the others);
  - while its job runs, writes its sealed phase record every
    agent.phase_refresh_interval (the rate at which a steady training node's
    record is rewritten), and the job's first member its sealed digest as
    often, through the gateway.
In a job with daemon-code members (the simulator's N-node job) it writes its
join of the round at the release, as ClusterRendezvous does, and takes the
closed state its rounds watch receives as its result (the daemon-code nodes
decide the round); a job of replay nodes alone forms no round (the parent
gives it its nodes). It writes no worker rows and no done marks, and opens
no record it receives but its round's closed state, once a process: its
events are counted by kind. The gateway calls run in a small thread pool.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import signal
import socket
import threading
import time
from collections import Counter

# Whether a replay node watches every node key's deletes, as every daemon did before
# the loss witnesses (cluster/witness.py); else the witness slots' deletes alone, as a
# daemon without a slot. scale_sim.py --replay-node-watch sets it before the processes
# fork.
NODE_WATCH = False


def _prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range holding every key under ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


RANKS = 4              # training ranks per simulated node (replay or daemon code)


def kind_of(key: str) -> str:
    """What a delivered key (with or without the sim's prefix) is, as the simulator counts
    its deliveries: nodes, phases, digests, workers, done, rounds, else jobs (the job
    list, and a job's joins)."""
    return ("nodes" if "/v1/nodes/" in key else "phases" if "/phases/" in key
            else "digests" if "/phasedigests/" in key else "workers" if "/workers/" in key
            else "done" if "/done/" in key else "rounds" if "/v1/rounds/" in key
            else "jobs")


def node_info(node_id: str, version: str, started_at: float, lease_ttl: int) -> dict:
    """A simulated node's record, as a daemon's says (cluster/node.py): this host and
    this process (after a lapsed lease, LeaseKeeper.register takes back a key that is
    its own)."""
    return {"node_id": node_id, "host": socket.gethostname(), "address": "127.0.0.1",
            "slots": 8, "slots_free": 8, "version": version, "started_at": started_at,
            "pid": os.getpid(), "lease_ttl": lease_ttl, "jobs": []}


def training_phases(node_id: str, rnd: int, first_rank: int, elapsed: float):
    """What the agent's tracker would offer ``elapsed`` seconds into training: RANKS
    ranks from ``first_rank`` at ~10 steps a second."""
    from elasticd.hangs.phase_board import NodePhases, RankPhase
    from elasticd.hangs.timeouts import PhaseRecord
    steps = int(elapsed * 10)
    ranks = tuple(RankPhase(first_rank + i, "train", elapsed, steps,
                            0.08 + 0.002 * ((steps + i) % 5)) for i in range(RANKS))
    return NodePhases(node_id, rnd, ranks, (PhaseRecord("train", steps * RANKS, 0.12),))


class SeenEvents:
    """The events a node's watches received lately, to tell one delivered again (a
    watch made again from too early a revision); scale_sim's nodes count them too."""

    KEEP = 50_000

    def __init__(self):
        self._seen: set = set()

    def once(self, watch: str, key: str, revision: int) -> bool:
        """Whether ``watch`` already received this event (else it is noted)."""
        mark = (watch, key, revision)
        if mark in self._seen:
            return True
        if len(self._seen) >= self.KEEP:
            self._seen.clear()
        self._seen.add(mark)
        return False


class ReplayNode:
    """One node's leases, watches and phase writes; its coroutines run on the process's loop."""

    def __init__(self, node_id: str, url: str, prefix: str, records, cfg, pool):
        from elasticd.store import open_store
        self.node_id, self.url, self.prefix = node_id, url, prefix
        self.records, self.cfg, self.pool = records, cfg, pool
        self.store = open_store("etcd3", [url], prefix=prefix, timeout=cfg.etcd.request_timeout,
                                lease_transport="gateway", watch_transport="gateway")
        self.lease = None
        self.ops: Counter = Counter()
        self.delivered: Counter = Counter()   # by kind; "again": an event received twice
        self.seen = SeenEvents()
        self.record_writes: Counter = Counter()
        self.digest_writes: Counter = Counter()
        self.errors = 0
        self.error_kinds: Counter = Counter()   # what failed, by what and why
        self.lapsed = 0
        self.node_puts = 0
        self.job = None            # (job id, its members sorted) once it runs one
        self.closed_at = None      # when its watch got its joined round's closed state
        self.closed_state = None   # that state's sealed value (bytes)
        self._joined_round = None  # (job id, round) it joined, while it waits
        self.joined_at = None      # when that join was written
        self.synced = asyncio.Event()
        self._watches: list = []       # (path, deletes_only), by watch id - 1
        self._revisions: dict[int, int] = {}   # watch id -> the revision it has seen to
        self._requests: asyncio.Queue | None = None
        self.started_at = time.time()

    # -- the gateway (the daemon's store, in the pool's threads) ---------------------------
    async def _call(self, name: str, fn, *args):
        from elasticd.store import KeyExists
        self.ops[name] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except KeyExists:
            raise         # an answer (the key is there), not a failure
        except Exception as exc:
            self.errors += 1
            self.error_kinds[f"{name}: {type(exc).__name__}"] += 1
            raise

    def _info(self) -> str:
        from elasticd.cluster.membership import node_key
        from elasticd.trust.sealed import Kind
        info = node_info(self.node_id, "sim-replay", self.started_at,
                         self.cfg.membership.lease_ttl)
        return self.records.seal(Kind.NODE, node_key(self.node_id), json.dumps(info))

    async def register(self) -> None:
        """A lease and the node key under it; a key still there under a lapsed lease of
        its own is deleted first and created again (as LeaseKeeper.register does, so
        its peers hear it go)."""
        from elasticd.cluster.membership import node_key
        from elasticd.store import KeyExists
        m = self.cfg.membership
        key = node_key(self.node_id)
        self.lease = await self._call("grant_lease", self.store.grant_lease, m.lease_ttl)
        for _ in range(2):
            try:
                await self._call("create", lambda: self.store.create(key, self._info(),
                                                                     lease=self.lease))
                return
            except KeyExists:
                await self._call("delete", self.store.delete, key)

    # -- the lease ----------------------------------------------------------------------
    async def keep(self, stop: asyncio.Event) -> None:
        """As store/lease_stream.py with one endpoint: a refresh waits etcd.request_timeout
        for its reply; a connected stream heard from within SILENT_FOR timeouts is kept
        (the late reply skipped when it comes), else it and its channel are dropped and
        the next refresh opens new ones."""
        import grpc
        from elasticd.store.etcdpb import lease_pb2, lease_pb2_grpc
        from elasticd.store.lease_stream import SILENT_FOR
        m = self.cfg.membership
        timeout = self.cfg.etcd.request_timeout
        target = self.url.split("://", 1)[-1]
        channel = call = replies = reader = None
        heard, owed = time.monotonic(), 0

        async def read(call, replies):
            try:
                async for reply in call:
                    replies.put_nowait(reply)
            except Exception as exc:
                replies.put_nowait(exc)
            replies.put_nowait(None)

        async def drop():
            nonlocal channel, call, reader
            if call is not None:
                call.cancel()
            if reader is not None:
                reader.cancel()
            if channel is not None:
                await channel.close()
            channel = call = reader = None

        await _sleep(stop, random.uniform(0, m.refresh_interval))   # spread over a period
        while not stop.is_set():
            started = time.monotonic()
            try:
                if call is None:
                    channel = grpc.aio.insecure_channel(
                        target, options=[("grpc.enable_http_proxy", 0)])
                    call = lease_pb2_grpc.LeaseStub(channel).LeaseKeepAlive(
                        metadata=[("hasleader", "true")])
                    replies = asyncio.Queue()
                    reader = asyncio.create_task(read(call, replies))
                    heard, owed = time.monotonic(), 0
                self.ops["refresh_lease"] += 1
                await call.write(lease_pb2.LeaseKeepAliveRequest(ID=self.lease.id))
                end = time.monotonic() + timeout
                while True:
                    reply = await asyncio.wait_for(replies.get(),
                                                   max(0.0, end - time.monotonic()))
                    if not isinstance(reply, lease_pb2.LeaseKeepAliveResponse):
                        raise ConnectionError(f"the keep-alive stream ended: {reply!r}"[:200])
                    heard = time.monotonic()
                    if owed == 0 or reply.TTL <= 0:
                        break
                    owed -= 1
                if reply.TTL <= 0:        # lapsed: register again, as LeaseKeeper does
                    self.lapsed += 1
                    await self.register()
                    self.node_puts += 1
            except asyncio.TimeoutError:
                self.errors += 1
                self.error_kinds["keep-alive: no reply in time"] += 1
                if time.monotonic() - heard < SILENT_FOR * timeout:
                    owed += 1             # slow, not gone: the stream is kept
                else:
                    await drop()
            except (grpc.RpcError, ConnectionError, OSError) as exc:
                self.errors += 1
                self.error_kinds["keep-alive: " + (exc.code().name if isinstance(
                    exc, grpc.RpcError) else type(exc).__name__)] += 1
                await drop()
            except Exception:   # a gateway call of register() failed: the next period
                pass
            await _sleep(stop, max(0.0, m.refresh_interval - (time.monotonic() - started)))
        await drop()

    # -- the watches --------------------------------------------------------------------
    def add_watch(self, path: str, deletes_only: bool = False) -> None:
        """Ask the stream for a watch of ``path``'s keys (a prefix under the sim's); (on
        the loop's thread)."""
        self._watches.append((path, deletes_only))
        if self._requests is not None:
            self._requests.put_nowait(self._create(len(self._watches), path, deletes_only))

    def drop_watches(self, under: str) -> None:
        """Cancel its watches of paths under ``under`` (a job it left: as the daemon's
        rendezvous unfollows it); on the loop's thread."""
        from elasticd.store.etcdpb import watch_pb2
        for i, got in enumerate(self._watches):
            if got is not None and got[0].startswith(under):
                self._watches[i] = None
                if self._requests is not None:
                    self._requests.put_nowait(watch_pb2.WatchRequest(
                        cancel_request=watch_pb2.WatchCancelRequest(watch_id=i + 1)))

    def _create(self, watch_id: int, path: str, deletes_only: bool):
        from elasticd.store.etcdpb import watch_pb2
        key = (self.prefix + path).encode()
        create = watch_pb2.WatchCreateRequest
        return watch_pb2.WatchRequest(create_request=create(
            key=key, range_end=_prefix_end(key), watch_id=watch_id,
            start_revision=self._revisions.get(watch_id, -1) + 1,
            filters=[create.NOPUT] if deletes_only else [],
            prev_kv=False))

    async def watch(self, channel, stop: asyncio.Event) -> None:
        """One stream for all the node's watches; when it breaks, as a daemon's store
        does, they are made again after membership.watch_retry, each from the revision
        it had seen to (etcd keeps each watch of a stream at its own pace)."""
        from elasticd.store.etcdpb import watch_pb2_grpc
        self.add_watch("/v1/nodes/" if NODE_WATCH else "/v1/witnesses/", deletes_only=True)
        self.add_watch("/v1/jobs/")
        while not stop.is_set():
            self._requests = requests = asyncio.Queue()
            for i, got in enumerate(self._watches):
                if got is not None:           # None: cancelled (drop_watches)
                    requests.put_nowait(self._create(i + 1, *got))

            async def feed():
                while True:
                    yield await requests.get()

            call = watch_pb2_grpc.WatchStub(channel).Watch(feed(),
                                                           metadata=[("hasleader", "true")])
            created = 0
            try:
                async for msg in call:
                    if msg.created:
                        created += 1
                        if created >= 2:
                            self.synced.set()
                    for ev in msg.events:
                        key = ev.kv.key.decode("utf-8", "replace")
                        self.delivered[kind_of(key)] += 1
                        if self._joined_round is not None and self.closed_at is None \
                                and key.endswith(f"/v1/rounds/{self._joined_round[0]}/state") \
                                and b'"status": "closed"' in ev.kv.value:
                            # not opened (a 1,000-member state is ~100 KB): the round
                            # closed; its ranks are read once a process (ReplayProcess)
                            self.closed_at, self.closed_state = time.time(), ev.kv.value
                        if self.seen.once(str(msg.watch_id), key, ev.kv.mod_revision):
                            self.delivered["again"] += 1
                    if msg.events:
                        self._revisions[msg.watch_id] = msg.events[-1].kv.mod_revision
                    elif msg.created and msg.watch_id not in self._revisions:
                        self._revisions[msg.watch_id] = msg.header.revision
                    if stop.is_set():
                        break
            except Exception as exc:
                if not stop.is_set():
                    self.errors += 1
                    self.error_kinds[f"watch: {type(exc).__name__}"] += 1
            finally:
                self._requests = None
                call.cancel()
            await _sleep(stop, self.cfg.membership.watch_retry)

    # -- a running job ------------------------------------------------------------------
    def run_job(self, job_id: str, members: list[str]) -> None:
        """Watch what a node of ``job_id`` watches (on the loop's thread)."""
        self.job = (job_id, members)
        first = members[0] == self.node_id
        self.add_watch(f"/v1/rounds/{job_id}/")
        self.add_watch(f"/v1/joins/{job_id}/", deletes_only=not first)
        self.add_watch(f"/v1/phases/{job_id}/" if first else f"/v1/phasedigests/{job_id}/")

    async def join(self, rnd: int, release: float) -> None:
        """Its join of round ``rnd`` of its job at wall time ``release``, as
        ClusterRendezvous._join writes it (a sealed Join under its lease, through the
        gateway); it never decides the round (a daemon-code member does)."""
        from elasticd.rendezvous.records import Join
        from elasticd.trust.sealed import Kind
        job_id, _members = self.job
        self._joined_round = (job_id, rnd)
        await asyncio.sleep(max(0.0, release - time.time()))
        key = f"/v1/joins/{job_id}/round/{rnd}/{self.node_id}"
        join = Join(node_id=self.node_id, address="127.0.0.1", nproc=RANKS, port=29500,
                    time=time.time())
        await self._call("put", lambda: self.store.put(
            key, self.records.seal(Kind.JOIN, key, join.to_json()), lease=self.lease))
        self.joined_at = time.time()

    def leave(self) -> None:
        """The job it ran left, as the daemon's rendezvous leaves one
        (ClusterRendezvous.close): its watches of the job's keys cancelled (its join
        stays until the job's end deletes it, or its lease ends)."""
        if self.job is not None:
            for path in (f"/v1/rounds/{self.job[0]}/", f"/v1/joins/{self.job[0]}/",
                         f"/v1/phases/{self.job[0]}/", f"/v1/phasedigests/{self.job[0]}/"):
                self.drop_watches(path)

    async def publish(self, stop: asyncio.Event) -> None:
        """Its phase record (and, on the first member, the digest) every refresh."""
        from elasticd.hangs.phase_digest import PhaseDigest
        from elasticd.trust.sealed import Kind
        job_id, members = self.job
        refresh = self.cfg.agent.phase_refresh_interval
        rank0 = members.index(self.node_id) * RANKS
        t0 = time.monotonic()
        await _sleep(stop, random.uniform(0, refresh))
        while not stop.is_set():
            rec = training_phases(self.node_id, 1, rank0, time.monotonic() - t0)
            key = f"/v1/phases/{job_id}/{self.node_id}"
            # counted as the call is made, as the store's calls are (scale_sim.CountingStore):
            # a window's writes and their deliveries are compared
            try:
                self.record_writes[job_id] += 1
                await self._call("put", lambda: self.store.put(
                    key, self.records.seal(Kind.PHASES, key, rec.to_json()), lease=self.lease))
                if members[0] == self.node_id:
                    digest = PhaseDigest(self.node_id, 1, len(members))
                    dkey = f"/v1/phasedigests/{job_id}/{self.node_id}"
                    self.digest_writes[job_id] += 1
                    await self._call("put", lambda: self.store.put(
                        dkey, self.records.seal(Kind.PHASES, dkey, digest.to_json()),
                        lease=self.lease))
            except Exception:
                pass      # counted by _call; the next refresh writes it again
            await _sleep(stop, refresh)

    def counters(self) -> dict:
        """As scale_sim.SimNode.counters."""
        reads = {}
        follows = []
        if self.job is not None:
            job_id, members = self.job
            reads = {job_id: "records" if members[0] == self.node_id else "digests"}
            follows = [job_id]
        return {"ops": dict(self.ops), "delivered": dict(self.delivered),
                "errors": self.errors, "revision": 0, "lapsed": self.lapsed,
                "error_kinds": dict(self.error_kinds),
                "phase_writes": {}, "digest_writes": dict(self.digest_writes),
                "record_writes": dict(self.record_writes), "reads": reads,
                "node_puts": self.node_puts, "row_puts": 0, "follows": follows}


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass


class ReplayProcess:
    """A process's replay nodes on one asyncio loop (its own thread); the process's
    main thread answers the parent as scale_sim.worker does."""

    def __init__(self, node_ids: list, url: str, prefix: str, key: bytes, overrides: dict):
        from scale_sim import sim_config
        from elasticd.trust.sealed import SealedRecords
        self.cfg = sim_config(overrides)
        records = SealedRecords(key, prefix)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
        self.nodes = [ReplayNode(n, url, prefix, records, self.cfg, self.pool)
                      for n in node_ids]
        self.url = url
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="replay-loop",
                                        daemon=True)
        self._thread.start()
        self.stop = None
        self._closed_at = None
        self.tasks: list = []
        self.channels: list = []

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, limit: float) -> None:
        import grpc
        from elasticd.store import watch_stream
        self.stop = asyncio.Event()
        target = self.url.split("://", 1)[-1]
        sem = asyncio.Semaphore(16)

        async def one(node):
            async with sem:
                await node.register()
            # as a daemon's store: a channel for the lease stream, one for the watches
            channel = grpc.aio.insecure_channel(target, options=[
                ("grpc.enable_http_proxy", 0), *watch_stream.CHANNEL_OPTIONS])
            self.channels.append(channel)
            self.tasks.append(asyncio.create_task(node.keep(self.stop)))
            self.tasks.append(asyncio.create_task(node.watch(channel, self.stop)))
        await asyncio.gather(*(one(n) for n in self.nodes))
        await asyncio.wait_for(asyncio.gather(*(n.synced.wait() for n in self.nodes)), limit)

    async def _publish(self) -> None:
        for node in self.nodes:
            if node.job is not None:
                self.tasks.append(asyncio.create_task(node.publish(self.stop)))

    async def _assign(self, jobs: dict) -> None:
        for node in self.nodes:
            if node.node_id in jobs and node.job is not None:
                node.leave()
        for node in self.nodes:
            if node.node_id in jobs:
                job_id, members = jobs[node.node_id]
                node.run_job(job_id, members)

    async def _join_all(self, joining: list, releases: dict) -> None:
        for node in joining:
            node.closed_at = node.closed_state = None
        await asyncio.gather(*(n.join(1, releases[n.job[0]]) for n in joining))
        deadline = time.monotonic() + 90
        while any(n.closed_at is None for n in joining) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for node in joining:
            node._joined_round = None

    def _join_times(self) -> list:
        """(when its last node's join was written, the closed state's closed_at: the
        deciding node's clock) of the last round its nodes joined."""
        joined = [n for n in self.nodes if n.joined_at is not None]
        if not joined:
            return []
        return [(max(n.joined_at for n in joined), self._closed_at)]

    def _places(self, joining: list) -> list:
        """(job, when its closed state came, group rank, group world size) of each node,
        from the closed state each received (opened once per distinct value)."""
        from elasticd.rendezvous.records import RoundState
        from elasticd.trust.sealed import Kind
        opened: dict = {}
        out = []
        for node in joining:
            if node.closed_at is None:
                raise RuntimeError(f"{node.node_id}: no closed round within 90 s")
            value = node.closed_state
            if value not in opened:
                key = f"/v1/rounds/{node.job[0]}/state"
                state = RoundState.from_doc(
                    node.records.open(Kind.STATE, key, value.decode()).doc)
                opened[value] = state.member_ids()
                self._closed_at = state.closed_at
            ids = opened[value]
            out.append((node.job[0], node.closed_at, ids.index(node.node_id), len(ids)))
        return out

    async def _read(self, fn):
        return fn()

    async def _stop(self) -> None:
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.channels:
            await c.close()

    def handle(self, cmd: str, arg):
        if cmd == "start":
            self.run(self._start(arg), arg + 30)
            return True
        if cmd == "seen":     # the live node keys, counted (their records not opened)
            from elasticd.cluster.membership import NODES
            kvs, _ = self.nodes[0].store.list(NODES + "/") if self.nodes else ([], 0)
            return [len(kvs)] if self.nodes else []
        if cmd == "join":     # a replay job forms no round: its nodes are told it
            jobs, releases, forming = arg
            members: dict = {}
            for node, (job_id, _size) in jobs.items():
                members.setdefault(job_id, []).append(node)
            mine = {n.node_id for n in self.nodes}
            self.run(self._assign({node: (job_id, sorted(members[job_id]))
                                   for node, (job_id, _s) in jobs.items() if node in mine}))
            joining = [n for n in self.nodes if n.node_id in jobs
                       and jobs[n.node_id][0] in forming]
            if not joining:
                return []
            # a job with daemon-code members: its round forms; these nodes join round 1
            # and wait for its closed state (its ranks read from it once, here)
            self.run(self._join_all(joining, releases), 120)
            return self._places(joining)
        if cmd in ("holds", "rows", "done"):
            return True
        if cmd == "publish":
            self.run(self._publish())
            return True
        if cmd == "counters":     # read on the loop: no count moves while they are read
            return self.run(self._read(lambda: {"nodes": [n.counters() for n in self.nodes],
                                                "pid": os.getpid()}), 60)
        if cmd == "witnesses":   # a replay node takes no witness slot
            return []
        if cmd == "join_times":
            return self._join_times()
        if cmd == "stop":
            self.run(self._stop(), 30)
            for node in self.nodes:     # revoke: at once, not one after another
                if node.lease is not None:
                    self.pool.submit(_quietly, node.store.revoke_lease, node.lease)
            self.pool.shutdown(wait=True)
            return True
        raise ValueError(f"unknown command {cmd!r}")


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        pass


def replay_worker(conn, node_ids: list, url: str, prefix: str, key: bytes,
                  overrides: dict) -> None:
    """scale_sim.worker's contract, for replay nodes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import logging
    logging.basicConfig(level=logging.ERROR)
    proc = ReplayProcess(node_ids, url, prefix, key, overrides)
    while True:
        cmd, arg = conn.recv()
        try:
            conn.send(("ok", proc.handle(cmd, arg)))
        except Exception:
            import traceback
            conn.send(("error", traceback.format_exc()))
        if cmd == "stop":
            return
