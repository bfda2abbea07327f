"""`status` across nodes: this node asks the other members of a job's round for their
snapshot rows, over the replication channel (authenticated and encrypted with the
cluster key, as replicas are; channel.py).

Each peer gets one connection: the hello, one ASK frame naming the job, one ROW frame
back (messages.SnapshotRow, checked field by field where it enters), then hang-up.
The peers are asked at once, each on a thread of its own that ends within
``snapshot.status_ask_timeout`` (connect, hello and answer each bounded by it, and
the whole ask by it too): a peer that is down, slow or answers garbage is left out
of the answer (said in the log at debug), never waited for longer. At most
``snapshot.status_ask_max`` peers are asked, first in the round's order.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from .channel import ChannelError, Kind, Refusal, client_hello
from .messages import Ask
from ..workers.snapshot_status import SnapshotRow

log = logging.getLogger("elasticd.replication.asking")


@dataclass(frozen=True)
class Peer:
    node_id: str
    address: str
    port: int


def ask_rows(key: bytes, domain: str, me: str, peers: list[Peer], job_id: str,
             timeout: float, max_frame: int) -> dict[str, SnapshotRow]:
    """{node: its row} of the peers that answered within ``timeout``."""
    got: dict[str, SnapshotRow] = {}
    lock = threading.Lock()

    def one(peer: Peer) -> None:
        row = _ask(key, domain, me, peer, job_id, timeout, max_frame)
        if row is not None:
            with lock:
                got[peer.node_id] = row

    threads = [threading.Thread(target=one, args=(p,), name="status-ask", daemon=True)
               for p in peers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return dict(got)


def _ask(key: bytes, domain: str, me: str, peer: Peer, job_id: str, timeout: float,
         max_frame: int) -> SnapshotRow | None:
    try:
        sock = socket.create_connection((peer.address, peer.port), timeout=timeout)
    except OSError as exc:
        log.debug("node=%s: no snapshot row from node %s: %s", me, peer.node_id, exc)
        return None
    try:
        chan = client_hello(sock, key, domain, me, peer.node_id, max_frame)
        chan.send(Kind.ASK, Ask(job_id).to_bytes())
        kind, payload = chan.recv()
        if kind is not Kind.ROW:
            raise ChannelError(Refusal.GARBAGE, f"a {kind.name} frame, not a row")
        return SnapshotRow.from_bytes(bytes(payload))
    except (ChannelError, ValueError, OSError) as exc:
        log.debug("node=%s: no snapshot row from node %s: %s", me, peer.node_id, exc)
        return None
    finally:
        sock.close()


class RowAsker:
    """``ask_rows`` with this node's key, domain, id and settings (snapshot.*), the
    peers' replication ports from their node records (``port_of``; 0: none)."""

    def __init__(self, settings, key: bytes, domain: str, node_id: str, port_of):
        self._s, self._key, self._domain, self._me = settings, key, domain, node_id
        self._port_of = port_of

    def rows(self, job_id: str, members: list[tuple[str, str]]) -> dict[str, SnapshotRow]:
        """``members``: (node id, address) of the nodes to ask, in the round's order."""
        if not self._s.status_ask_max:
            return {}
        peers = []
        for node_id, address in members:
            port = self._port_of(node_id)
            if port and len(peers) < self._s.status_ask_max:
                peers.append(Peer(node_id, address, int(port)))
        if not peers:
            return {}
        return ask_rows(self._key, self._domain, self._me, peers, job_id,
                        self._s.status_ask_timeout, self._s.replication_max_frame)
