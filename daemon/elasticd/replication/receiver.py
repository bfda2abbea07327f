"""The replication listener: takes peers' snapshot replicas over the authenticated
channel and keeps them in the job's dir here (replica_files.py).

One thread owns the listening socket (accept with a bounded wait, a stop event);
each connection gets a thread of its own, at most ``replication_max_peers`` at
once (one more is closed at once and counted). Every read waits at most
``replication_timeout``, every frame is bounded by ``replication_max_frame``: a
peer that sends garbage, a wrong key or MAC, a frame too large or nothing at all
is dropped and counted by reason, and the daemon goes on serving. An offer is
refused (and counted) unless the job runs on this node and its replicas fit the
job's snapshot budget here with the offered file. A file kept is
``replicas/<node>/`` of the node whose snapshot it is: the sender, or the lost
node a forwarded replica (forwarder.py) came from.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Callable

from ..logsetup import ctx
from . import replica_files as files
from .channel import Channel, ChannelError, Kind, Refusal, server_accept
from ..workers.snapshot_status import SnapshotRow
from .messages import Ask, Offer, Reply
from .niceness import lower_this_thread
from .stats import ReplicationStats

log = logging.getLogger("elasticd.replication.receiver")
ACCEPT_WAIT = 0.5      # seconds the accept loop waits before looking at its stop event


@dataclass(frozen=True)
class ReplicaTarget:
    """Where a job's replicas go on this node and as whom (a job running here)."""
    job_dir: str
    uid: int
    gid: int
    budget_bytes: int


class ReplicationServer:
    def __init__(self, settings, key: bytes, domain: str, node_id: str,
                 target: Callable[[str], ReplicaTarget | None], stats: ReplicationStats,
                 rows: Callable[[str], "SnapshotRow | None"] = lambda job_id: None):
        self._s, self._key, self._domain, self._me = settings, key, domain, node_id
        # rows: this node's snapshot row of a job running here (peers.py Peers.row), for
        # a peer's status (asking.py)
        self._target, self.stats, self._rows = target, stats, rows
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._serving: set[threading.Thread] = set()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> None:
        """Listen (OSError if the port is taken) and start accepting."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._s.replication_address, self._s.replication_port))
        except OSError as exc:
            sock.close()
            raise OSError(f"replication listener on {self._s.replication_address}:"
                          f"{self._s.replication_port}: {exc.strerror} "
                          "(snapshot.replication_port)") from None
        sock.listen(64)
        sock.settimeout(ACCEPT_WAIT)
        self._sock, self.port = sock, sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="replication-listen",
                                        daemon=True)
        self._thread.start()
        log.info("%s: replication listener on %s:%d", ctx(node=self._me),
                 self._s.replication_address, self.port)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            serving = list(self._serving)
        for t in serving:
            t.join(timeout / max(len(serving), 1))

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.wait(ACCEPT_WAIT):
                    return
                continue
            with self._lock:
                busy = len(self._serving) >= self._s.replication_max_peers
                if not busy:
                    t = threading.Thread(target=self._serve, args=(conn,),
                                         name="replication-peer", daemon=True)
                    self._serving.add(t)
            if busy:
                self.stats.refused(Refusal.BUSY)
                conn.close()
                continue
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        chan: Channel | None = None
        lower_this_thread(self._s.replication_nice)
        try:
            conn.settimeout(self._s.replication_timeout)
            if _probed(conn):
                # Closed before its first byte: a peer's probe of whether this daemon
                # lives (cluster/daemon_probe.py), not a replica and not an attack.
                log.debug("%s: probed by %s", ctx(node=self._me), _address(conn))
                return
            chan = server_accept(conn, self._key, self._domain, self._me,
                                 self._s.replication_max_frame)
            while not self._stop.is_set():
                try:
                    kind, payload = chan.recv()
                except ChannelError as exc:
                    if exc.why is Refusal.CLOSED:   # the peer is done: a clean end
                        return
                    raise
                if kind is Kind.ASK:
                    self._answer(chan, payload)
                    continue
                if kind is not Kind.OFFER:
                    raise ChannelError(Refusal.GARBAGE, f"a {kind.name} frame outside a file")
                self._one_file(chan, payload)
        except ChannelError as exc:
            self.stats.refused(exc.why)
            log.warning("%s: replication peer %s dropped: %s", ctx(node=self._me),
                        chan.peer if chan else _address(conn), exc)
        except Exception:
            self.stats.refused(Refusal.GARBAGE)
            log.exception("%s: replication connection failed", ctx(node=self._me))
        finally:
            if chan is not None:
                self.stats.received(chan.bytes_got)
            conn.close()
            with self._lock:
                self._serving.discard(threading.current_thread())

    def _answer(self, chan: Channel, payload: bytes) -> None:
        """A peer's `status` asks for this node's snapshot row of a job (asking.py): the
        row, or an empty one (step -1) where the job has none here."""
        try:
            ask = Ask.from_bytes(payload)
        except ValueError as exc:
            raise ChannelError(Refusal.GARBAGE, f"an ask that does not parse: {exc}") from None
        row = self._rows(ask.job_id) if self._target(ask.job_id) is not None else None
        chan.send(Kind.ROW, (row or SnapshotRow()).to_bytes())

    def _one_file(self, chan: Channel, payload: bytes) -> None:
        try:
            offer = Offer.from_bytes(payload)
        except ValueError as exc:
            raise ChannelError(Refusal.GARBAGE, f"an offer that does not parse: {exc}") from None
        target = self._target(offer.job_id)
        where = ctx(job=offer.job_id, node=self._me, rank=offer.rank)
        if target is None:
            self._refuse(chan, f"job {offer.job_id} does not run on node {self._me}")
            return
        if offer.origin == self._me and files.holds_own(target.job_dir, offer, target.uid):
            # Its own snapshot back from its buddy: here already, unless this node lost it.
            chan.send(Kind.REPLY, Reply(ok=True, have=True).to_bytes())
            return
        try:
            dir_fd = files.open_from_dir(target.job_dir, offer.origin or chan.peer, target.uid,
                                         target.gid)
        except (files.ReplicaRefused, OSError) as exc:
            self._refuse(chan, f"no replica dir for job {offer.job_id} here: {exc}")
            return
        try:
            if files.holds(dir_fd, offer, target.uid):
                chan.send(Kind.REPLY, Reply(ok=True, have=True).to_bytes())
                return
            held = files.held_bytes(target.job_dir)
            if held + offer.size > target.budget_bytes:
                self._refuse(chan, f"{offer.size} bytes more would make job {offer.job_id}'s "
                             f"snapshots here {held + offer.size} bytes, over its budget of "
                             f"{target.budget_bytes} (snapshot.job_budget / node_budget)")
                return
            try:
                incoming = files.Incoming(dir_fd, offer, target.uid, target.gid)
            except OSError as exc:    # something the job's user put in the way
                self._refuse(chan, f"cannot write the replica of job {offer.job_id}: "
                             f"{exc.strerror or exc}")
                return
            try:
                chan.send(Kind.REPLY, Reply(ok=True).to_bytes())
                kept = self._take(chan, incoming)
            except BaseException:
                incoming.abort()
                raise
        finally:
            os.close(dir_fd)
        if kept:   # every step, on a job that saves every step: not an info line
            log.debug("%s: replica of step %d from node %s kept (%d bytes)", where,
                      offer.step, chan.peer, offer.size)

    def _take(self, chan: Channel, incoming: files.Incoming) -> bool:
        """Receive the offered file into ``incoming``; whether it was kept."""
        while True:
            kind, payload = chan.recv()
            if kind is Kind.CHUNK:
                try:
                    incoming.write(payload)
                except files.ReplicaRefused as exc:
                    raise ChannelError(Refusal.GARBAGE, str(exc)) from None
            elif kind is Kind.ABORT:
                incoming.abort()
                return False
            elif kind is Kind.END:
                try:
                    incoming.finish()
                except (files.ReplicaRefused, OSError) as exc:
                    incoming.abort()
                    self._refuse(chan, f"replica not kept: {exc}")
                    return False
                chan.send(Kind.REPLY, Reply(ok=True).to_bytes())
                return True
            else:
                raise ChannelError(Refusal.GARBAGE, f"a {kind.name} frame inside a file")

    def _refuse(self, chan: Channel, why: str) -> None:
        self.stats.refused(Refusal.REFUSED)
        log.warning("%s: replica from node %s refused: %s", ctx(node=self._me), chan.peer, why)
        chan.send(Kind.REPLY, Reply(ok=False, why=why).to_bytes())


def _address(conn: socket.socket) -> str:
    """The peer's address before it said who it is (it may be anyone)."""
    try:
        return str(conn.getpeername()[0])
    except OSError:
        return "?"


def _probed(conn: socket.socket) -> bool:
    """The peer hung up before sending a byte (a liveness probe); waits for the first
    byte as long as the connection's timeout (a silent peer then fails the hello)."""
    try:
        return not conn.recv(1, socket.MSG_PEEK)
    except (ConnectionResetError, ConnectionAbortedError):
        return True
    except OSError:
        return False
