"""The replication channel's frames and the pusher's send of one slot file, in one process
over real sockets (the daemons' end-to-end cases are in test_replication.py).

* frames of every size round-trip through the channel's reused buffers, a large one
  after a small one and back;
* a frame changed on the wire, replayed, or over the frame limit ends the connection
  with the refusal that names it;
* a slot file the receiver wants is sent whole and kept byte for byte; one it holds is
  only offered (never copied out); one whose header changed after the offer is
  ABORTed, leaves the newest replica as it was and nothing behind, and the
  receiver takes the next one;
* a replication thread moves itself from the daemon's raised priority to
  snapshot.replication_nice, never to a higher priority than it has.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from elasticd.config.service import SnapshotSettings
from elasticd.replication import channel as ch
from elasticd.replication import pusher as pusher_mod
from elasticd.replication.niceness import lower_this_thread
from elasticd.replication.pusher import Outgoing, Pusher, PushPlan
from elasticd.replication.receiver import ReplicaTarget, ReplicationServer
from elasticd.replication.stats import ReplicationStats
from elasticd.workers import snapshot_format as fmt

MAX_FRAME = 1 << 16


def _pair(max_frame: int = MAX_FRAME):
    """Two channels on a socket pair, each one's sending key the other's receiving key,
    and the raw socket behind the receiving one (to put bytes on its wire)."""
    k1, k2 = AESGCM(os.urandom(32)), AESGCM(os.urandom(32))
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return ch.Channel(a, "n2", k1, k2, max_frame), ch.Channel(b, "n1", k2, k1, max_frame), a


def test_frames_of_every_size_round_trip_through_the_reused_buffers():
    tx, rx, _ = _pair()
    sizes = [0, 1, 17, MAX_FRAME, 3, MAX_FRAME - 1, 0, 4096]
    for i, n in enumerate(sizes):
        payload = os.urandom(n)
        tx.send(ch.Kind.CHUNK if n else ch.Kind.END, memoryview(payload) if i % 2 else payload)
        kind, got = rx.recv()
        assert kind is (ch.Kind.CHUNK if n else ch.Kind.END) and bytes(got) == payload, n
    assert tx.bytes_sent == rx.bytes_got == sum(4 + 1 + n + 16 for n in sizes)
    with pytest.raises(ValueError):
        tx.send(ch.Kind.CHUNK, b"x" * (MAX_FRAME + 1))


def test_a_frame_changed_replayed_or_too_large_ends_the_connection_by_name():
    for tamper in ("flip", "replay", "too_large"):
        k1 = AESGCM(os.urandom(32))
        a, b = socket.socketpair()        # the sender's wire
        c, d = socket.socketpair()        # what the receiver reads
        for s in (a, b, c, d):
            s.settimeout(5)
        tx = ch.Channel(a, "n2", k1, k1, MAX_FRAME)
        rx = ch.Channel(d, "n1", k1, k1, MAX_FRAME)
        tx.send(ch.Kind.CHUNK, b"first frame")
        frame = b.recv(1 << 20)
        c.sendall(frame)
        assert bytes(rx.recv()[1]) == b"first frame"
        if tamper == "flip":
            tx.send(ch.Kind.CHUNK, b"second frame")
            raw = bytearray(b.recv(1 << 20))
            raw[-1] ^= 1
            c.sendall(bytes(raw))
            want = ch.Refusal.MAC
        elif tamper == "replay":      # the first frame again: its nonce is spent
            c.sendall(frame)
            want = ch.Refusal.MAC
        else:
            c.sendall((MAX_FRAME + 1 + 16 + 1).to_bytes(4, "big"))
            want = ch.Refusal.TOO_LARGE
        with pytest.raises(ch.ChannelError) as got:
            rx.recv()
        assert got.value.why is want, tamper
        for s in (a, b, c, d):
            s.close()


def _write_slot(path: str, step: int, data: bytes) -> fmt.Header:
    h = fmt.Header(fmt.SlotState.COMPLETE, 0, 2, step, time.time_ns(), 10, len(data))
    with open(path, "wb") as f:
        f.write(fmt.pack(h).ljust(fmt.HEADER_BYTES, b"\0"))
        f.write(b"m" * (h.data_offset - fmt.HEADER_BYTES))
        f.write(data)
    return h


@pytest.fixture()
def server(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(mode=0o700)
    dst.mkdir(mode=0o700)
    s = dataclasses.replace(SnapshotSettings(), replication_address="127.0.0.1",
                            replication_port=0, replication_interval=3600,
                            replication_timeout=5, replication_max_frame=MAX_FRAME,
                            replication_rate=1 << 40)
    key, stats = os.urandom(32), ReplicationStats()
    uid, gid = os.geteuid(), os.getegid()
    srv = ReplicationServer(s, key, "/t", "n2", lambda job: ReplicaTarget(str(dst), uid, gid,
                                                                         1 << 40), stats)
    srv.start()
    p = Pusher(s, key, "/t", "n1", lambda: [], stats)
    plan = PushPlan("job1", str(src), uid, (0,), 2, "n2", "127.0.0.1", srv.port)
    yield p, plan, str(src), os.path.join(str(dst), "replicas", "n1")
    srv.stop()
    p.stop()


def test_a_wanted_slot_is_sent_whole_a_held_one_only_offered_a_changed_one_aborted(
        server, monkeypatch):
    p, plan, src, replicas = server
    slot = os.path.join(src, "rank0.p0")
    data = os.urandom(5 * MAX_FRAME + 123)
    h = _write_slot(slot, 10, data)
    assert p.push(plan) == "step 10 replicated to n2"
    kept = os.path.join(replicas, "rank0.p0")
    assert open(kept, "rb").read() == open(slot, "rb").read()

    copies = []
    real_copy = pusher_mod.copy_slot
    monkeypatch.setattr(pusher_mod, "copy_slot", lambda *a: copies.append(a) or real_copy(*a))
    item = Outgoing(slot, 0, "p0", h)
    why, taken = p._send(plan.job_id, plan.uid, "n2", "127.0.0.1", plan.port, [item], "again")
    assert (why, taken, copies) == ("", 0, [])        # held there: offered, not copied

    # The slot changes after the offer (a newer save): ABORT, the old replica stays whole,
    # its temporary file goes, and the receiver takes the next one.
    newer = _write_slot(slot, 20, os.urandom(len(data)))
    stale = Outgoing(slot, 0, "p0", dataclasses.replace(newer, step=30))
    fresh = Outgoing(slot, 0, "p0", newer)
    why, taken = p._send(plan.job_id, plan.uid, "n2", "127.0.0.1", plan.port,
                         [stale], "a stale one")
    assert "changed while it was read" in why and taken == 0
    assert fmt.parse(open(kept, "rb").read(fmt.HEADER_USED)).step == 10
    deadline = time.monotonic() + 10
    while sorted(os.listdir(replicas)) != ["rank0.p0"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(os.listdir(replicas)) == ["rank0.p0"]
    why, taken = p._send(plan.job_id, plan.uid, "n2", "127.0.0.1", plan.port,
                         [fresh], "the newer one")
    assert (why, taken) == ("", 1)
    assert open(kept, "rb").read() == open(slot, "rb").read()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a thread at the daemon's nice -5")
def test_a_replication_thread_moves_to_its_nice_and_never_up():
    got = {}

    def thread():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, -5)          # daemon.nice's default
        got["moved"] = lower_this_thread(0), os.getpriority(os.PRIO_PROCESS, tid)
        got["kept"] = lower_this_thread(-10), os.getpriority(os.PRIO_PROCESS, tid)

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert got == {"moved": (0, 0), "kept": (0, 0)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
