"""The pusher: sends this node's newest complete snapshot of each job to the job's buddy,
the next member of the job's round in ring order, rate-limited; and forwards the
replicas this node keeps of ranks another member now holds to that member.

One thread owns it (a stop event; every wait bounded). Each ``replication_interval``
it first sends what forwarder.py says should move (each file once), then asks
``plans()`` for the jobs running here in a closed round of two nodes or
more (a ``PushPlan`` each), reads the headers of this node's ranks' slot files
(workers/snapshot_format.py, through workers/files.py as status does), and when
every rank here holds a complete snapshot of a step other than the one the buddy
last acknowledged, sends those slot files (the newest step only, from the pin
slots when ``pin_every`` is set: the newest grid step; the buddy skips a file it
has) over the channel (channel.py). A file is offered first and, once the peer
wants it, copied out whole (into one buffer kept from look to look while there is
something to send) and its header read again: a save that began meanwhile makes it
an ABORT, tried again next time, never a torn replica. Sending is paced to
``replication_rate`` bytes per second for the node as a whole.
"""
from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..logsetup import ctx
from ..workers import files as workerfiles
from ..workers import snapshot_format as fmt
from ..workers.snapshot_status import Replicated
from .channel import Channel, ChannelError, Kind, Refusal, client_hello
from .forwarder import Forward, ForwardPlan, forwards
from .messages import Offer, Reply
from .niceness import lower_this_thread
from .stats import ReplicationStats

log = logging.getLogger("elasticd.replication.pusher")


@dataclass(frozen=True)
class PushPlan:
    """A job running here whose snapshots go to a buddy."""
    job_id: str
    job_dir: str
    uid: int
    ranks: tuple          # this node's ranks in the round
    world_size: int
    buddy: str            # node id
    address: str
    port: int


@dataclass(frozen=True)
class Outgoing:
    """One slot file to send: where it is here, what the offer says of it."""
    path: str
    rank: int
    slot: str
    header: fmt.Header
    origin: str = ""      # a forwarded replica: the node whose snapshot it is


def buddy_of(member_ids: list[str], me: str) -> str | None:
    """The next member after ``me`` in the round's ring order; None when alone or absent."""
    if me not in member_ids or len(member_ids) < 2:
        return None
    return member_ids[(member_ids.index(me) + 1) % len(member_ids)]


def newest_common(plan: PushPlan, slots: tuple) -> tuple[int, dict] | None:
    """(step, {rank: (slot, header)}) of the newest step every rank here holds complete
    in one of ``slots`` (the pin pair, with a pin grid)."""
    held: dict[int, dict] = {}
    for rank in plan.ranks:
        steps = held.setdefault(rank, {})
        for slot in slots:
            got = workerfiles.read(os.path.join(plan.job_dir, fmt.slot_name(rank, slot)),
                                   plan.uid, fmt.HEADER_USED, whole=False)
            if not got.ok:
                continue
            try:
                h = fmt.parse(got.data)
            except fmt.BadHeader:
                continue
            if h.state is fmt.SlotState.COMPLETE and h.rank == rank \
                    and h.world_size == plan.world_size and got.size >= h.total_bytes:
                steps[h.step] = (slot, h)
    common = set.intersection(*(set(s) for s in held.values())) if held else set()
    if not common:
        return None
    step = max(common)
    return step, {rank: held[rank][step] for rank in plan.ranks}


def copy_slot(path: str, uid: int, header: fmt.Header, buf: bytearray | None = None
              ) -> memoryview | None:
    """The slot file's bytes (header, meta, data) if it still holds ``header`` after the
    copy; None when it changed (a save began) or is not the job's user's plain file.
    They are read into ``buf`` when it is large enough (its first bytes are returned),
    else into a new buffer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_size < header.total_bytes:
            return None
        n = header.total_bytes
        view, at = memoryview(buf if buf is not None and len(buf) >= n else bytearray(n))[:n], 0
        while at < n:
            got = os.preadv(fd, [view[at:]], at)
            if got <= 0:
                return None
            at += got
        again = fmt.parse(os.pread(fd, fmt.HEADER_USED, 0))
        return view if again == header else None
    except (OSError, fmt.BadHeader):
        return None
    finally:
        os.close(fd)


class Pacer:
    """Bytes sent at ``rate`` per second at most, over the pusher's life."""

    def __init__(self, rate: int, stop: threading.Event, clock=time.monotonic):
        self._rate, self._stop, self._clock = rate, stop, clock
        self._free_at = clock()

    def take(self, n: int) -> bool:
        """Wait until the bytes before have had their time, then let ``n`` more go (one
        frame's burst); False when stopped meanwhile."""
        now = self._clock()
        start = max(self._free_at, now)
        self._free_at = start + n / self._rate
        return not (start > now and self._stop.wait(start - now))


class Pusher:
    def __init__(self, settings, key: bytes, domain: str, node_id: str,
                 plans: Callable[[], list[PushPlan]], stats: ReplicationStats,
                 forward_plans: Callable[[], list[ForwardPlan]] = lambda: []):
        self._s, self._key, self._domain, self._me = settings, key, domain, node_id
        self._plans, self._forward_plans, self.stats = plans, forward_plans, stats
        self._stop = threading.Event()
        self._pacer = Pacer(settings.replication_rate, self._stop)
        self._acked: dict[tuple[str, str], int] = {}   # (job, buddy) -> step acknowledged
        self._forwarded: set[tuple] = set()            # (job, *Forward.key) acknowledged
        # A slot is copied out into this buffer, kept while there is something to send at
        # each look (a fresh one per slot costs more CPU in page faults than the copy
        # itself) and let go at the first look with nothing to send.
        self._buf: bytearray | None = None
        self._copied = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replication-push", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        lower_this_thread(self._s.replication_nice)
        while not self._stop.wait(self._s.replication_interval):
            if not self._copied:
                self._buf = None
            self._copied = False
            try:
                # Forwards first: a rank that took over a lost node's part waits for one.
                fplans = self._forward_plans()
                live = {p.job_id for p in fplans}
                self._forwarded = {k for k in self._forwarded if k[0] in live}
                for fplan in fplans:
                    if self._stop.is_set():
                        return
                    self.forward(fplan)
                plans = self._plans()
                live = {p.job_id for p in plans}
                self.stats.forget_others(live)
                self._acked = {k: v for k, v in self._acked.items() if k[0] in live}
                for plan in plans:
                    if self._stop.is_set():
                        return
                    self.push(plan)
            except Exception:
                log.exception("%s: replication push failed", ctx(node=self._me))

    def push(self, plan: PushPlan) -> str:
        """Send the job's newest snapshot here (its newest grid step, with a pin grid) to
        its buddy if it has not got it; one sentence saying what happened."""
        where = ctx(job=plan.job_id, node=self._me)
        newest = newest_common(plan, fmt.PIN_SLOTS if self._s.pin_every else fmt.SLOTS)
        if newest is None:
            return "no complete snapshot here"
        step, slots = newest
        # Only that very step is skipped: an older one means the ranks went back to it.
        if self._acked.get((plan.job_id, plan.buddy)) == step:
            return f"step {step} already at {plan.buddy}"
        items = [Outgoing(os.path.join(plan.job_dir, fmt.slot_name(rank, slot)), rank, slot,
                          header) for rank, (slot, header) in sorted(slots.items())]
        why, _ = self._send(plan.job_id, plan.uid, plan.buddy, plan.address, plan.port,
                            items, f"step {step}")
        if why:
            return why
        now = time.time()
        saved = max(h.saved_at_ns for _, h in slots.values()) / 1e9
        first = (plan.job_id, plan.buddy) not in self._acked
        self._acked[(plan.job_id, plan.buddy)] = step
        self.stats.replicated(plan.job_id, Replicated(plan.buddy, step, now,
                                                      max(0.0, now - saved)))
        # The first replica to a buddy is news; the next ones (every step) are not.
        (log.info if first else log.debug)(
            "%s: step %d replicated to node %s (%.2f s after the save)", where, step,
            plan.buddy, now - saved)
        return f"step {step} replicated to {plan.buddy}"

    def forward(self, plan: ForwardPlan) -> str:
        """Send the replicas here of ranks another member of the round holds now to that
        member, each once; one sentence saying what happened."""
        todo: dict[str, list[Forward]] = {}
        for fw in forwards(plan, self._me):
            if (plan.job_id, *fw.key) not in self._forwarded:
                todo.setdefault(fw.to.node_id, []).append(fw)
        said = []
        for node, group in sorted(todo.items()):
            to = group[0].to
            items = [Outgoing(fw.path, fw.rank, fw.slot, fw.header, fw.origin) for fw in group]
            steps = sorted({fw.header.step for fw in group})
            why, taken = self._send(plan.job_id, plan.uid, node, to.address, to.port, items,
                                    f"the replica of ranks {sorted({fw.rank for fw in group})} "
                                    f"(steps {steps}) from node {group[0].origin}")
            if why:
                said.append(f"{node}: {why}")
                continue
            self._forwarded.update((plan.job_id, *fw.key) for fw in group)
            if not taken:    # it holds them (its own, offered back): the steady state
                continue
            log.info("%s: replicas of ranks %s (steps %s) of node(s) %s forwarded to node %s, "
                     "which holds those ranks now and did not have them",
                     ctx(job=plan.job_id, node=self._me), sorted({fw.rank for fw in group}),
                     steps, sorted({fw.origin for fw in group}), node)
            said.append(f"{node}: forwarded")
        return "; ".join(said) or "nothing to forward"

    def _send(self, job_id: str, uid: int, to: str, address: str, port: int,
              items: list[Outgoing], what: str) -> tuple[str, int]:
        """Send slot files to node ``to`` over one connection: ('' when it holds all of
        them now, else why not (logged); how many it took, not holding them before)."""
        where = ctx(job=job_id, node=self._me)
        try:
            sock = socket.create_connection((address, port),
                                            timeout=self._s.replication_timeout)
        except OSError as exc:
            log.warning("%s: cannot reach node %s at %s:%d: %s", where, to, address, port,
                        exc.strerror or exc)
            return "node unreachable", 0
        chan, taken = None, 0
        try:
            chan = client_hello(sock, self._key, self._domain, self._me, to,
                                self._s.replication_max_frame)
            for item in items:
                why, took = self._send_file(chan, job_id, uid, item)
                if why:
                    log.warning("%s: %s (rank %d) not replicated to %s: %s", where, what,
                                item.rank, to, why)
                    return why, taken
                taken += took
        except ChannelError as exc:
            self.stats.refused(exc.why)
            log.warning("%s: replication to %s failed: %s", where, to, exc)
            return str(exc), taken
        finally:
            if chan is not None:
                self.stats.sent(chan.bytes_sent)
            sock.close()
        return "", taken

    def _send_file(self, chan: Channel, job_id: str, uid: int, item: Outgoing
                   ) -> tuple[str, bool]:
        """Offer and send one slot file: ('' when the peer holds it now, else why not;
        whether it took it now). It is copied out only once the peer wants it: a replica
        forwarded back to the node it came from is, in steady state, only offered."""
        h = item.header
        offer = Offer(job_id, item.rank, item.slot, h.step, h.saved_at_ns, h.total_bytes,
                      item.origin)
        chan.send(Kind.OFFER, offer.to_bytes())
        reply = self._reply(chan)
        if not reply.ok:
            return f"refused: {reply.why}", False
        if reply.have:
            return "", False
        if self._buf is None or len(self._buf) < h.total_bytes:
            self._buf = None              # the old one goes before the new one is made
            self._buf = bytearray(h.total_bytes)
        self._copied = True
        data = copy_slot(item.path, uid, h, self._buf)
        if data is None:
            chan.send(Kind.ABORT)
            return "the slot changed while it was read (a newer save): next time", False
        step = self._s.replication_max_frame
        for at in range(0, len(data), step):
            chunk = data[at:at + step]
            if not self._pacer.take(len(chunk)):
                chan.send(Kind.ABORT)
                return "stopping", False
            chan.send(Kind.CHUNK, chunk)
        chan.send(Kind.END)
        reply = self._reply(chan)
        return ("", True) if reply.ok else (f"refused: {reply.why}", False)

    @staticmethod
    def _reply(chan: Channel) -> Reply:
        kind, payload = chan.recv()
        if kind is not Kind.REPLY:
            raise ChannelError(Refusal.GARBAGE, f"a {kind.name} frame for a reply")
        try:
            return Reply.from_bytes(payload)
        except ValueError as exc:
            raise ChannelError(Refusal.GARBAGE, f"a reply that does not parse: {exc}") from None
