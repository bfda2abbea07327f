"""Snapshot replicas on the buddy node (issue 32): two real daemons on a real etcd, a real
2-node job of a real user whose ranks save with elasticd.snapshot, and raw TCP peers.

* each node's newest grid snapshot (snapshot.pin_every) appears in the other node's job
  dir, under ``replicas/<from node>/``, byte for byte, not a newer step off the grid, owned by the job's user (0600 files, 0700
  dirs), and ``status`` says where it went and which step;
* a peer that sends garbage, a wrong key, a frame over the limit or nothing at all is
  dropped and counted by reason, and the daemon goes on serving (a right key still
  gets in);
* a key holder's offer of a job that does not run there, or over the job's budget
  there, is refused and counted; a replica cut off half way leaves the newest one
  whole and nothing else behind;
* a forwarded replica is kept under the node it came from; a node offered its own
  snapshot back says it has it;
* the job's end frees its replicas with its dir on every node.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time

import pytest

from daemons import DaemonProc, cluster_key_path, free_port, real_users, scrape, short_tmpdir
from daemons import wait_logged as wait_for
from etcd_server import EtcdServer, etcd_binary
from elasticd.replication import channel as ch
from elasticd.replication.messages import Ask, Offer, Reply
from elasticd.workers.snapshot_status import SnapshotRow
from elasticd.trust import clusterkey
from elasticd.workers import snapshot_format as fmt

pytestmark = [pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary"),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real users")]

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
GROUP = f"s32r_ctl{_WORKER}"
USER = f"s32r_alice{_WORKER}"
TIMEOUT = 1.0           # snapshot.replication_timeout here
STEPS = 4
PIN_EVERY = 2           # snapshot.pin_every here: steps 0 and 2 are on the grid, 3 is not
GRID = 2                # the newest grid step saved, the one replicated

# Each rank saves STEPS snapshots with elasticd.snapshot, says SAVED and waits.
JOB = r"""
import os, time, torch
from elasticd import snapshot
rank = int(os.environ["RANK"])
for step in range(%d):
    snapshot.save(step, {"w": torch.arange(5000, dtype=torch.float32) * (step + 10 * rank),
                         "rank": rank, "step": step})
print("SAVED", flush=True)
time.sleep(600)
""" % STEPS


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def user():
    with real_users((USER,), GROUP) as made:
        yield made[USER]


@pytest.fixture(scope="module")
def pair(etcd, user):
    """Daemons n1 and n2 on one etcd, and a 2-node job of the user that saved STEPS."""
    prefix = f"/repl-{os.getpid()}-{_WORKER}"
    common = ("--etcd-prefix", prefix, "--set", f"daemon.socket_group={GROUP}",
              "--set", "agent.warm_spares=false", "--set", f"snapshot.replication_timeout={TIMEOUT}",
              "--set", "snapshot.replication_interval=0.2",
              "--set", f"snapshot.pin_every={PIN_EVERY}")
    nodes = {}
    try:
        for node_id in ("n1", "n2"):
            port = free_port()
            d = DaemonProc(short_tmpdir(), node_id=node_id, etcd=etcd.url,
                           extra_args=(*common, "--metrics-port", str(port)))
            d.metrics_port = port
            nodes[node_id] = d.start()
        work = os.path.join(nodes["n1"].root, "work")
        os.makedirs(work)
        os.chown(work, user[0], user[1])
        script = os.path.join(work, "job.py")
        with open(script, "w") as fh:
            fh.write(JOB)
        r = nodes["n1"].ctl("-o", "json", "submit", "--nnodes", "2", "--", sys.executable,
                            "-u", script, cwd=work, user=user)
        assert r.returncode == 0, r.stderr
        job_id = json.loads(r.stdout)["id"]
        yield nodes, job_id
    finally:
        for d in nodes.values():
            d.cleanup()


def newest_slot(job_dir: str, rank: int, slots: tuple = fmt.PIN_SLOTS
                ) -> tuple[str, fmt.Header] | None:
    best = None
    for slot in slots:
        try:
            with open(os.path.join(job_dir, fmt.slot_name(rank, slot)), "rb") as fh:
                h = fmt.parse(fh.read(fmt.HEADER_USED))
        except (OSError, fmt.BadHeader):
            continue
        if h.state is fmt.SlotState.COMPLETE and (best is None or h.step > best[1].step):
            best = (slot, h)
    return best


def replica_of(nodes, job_id: str, here: str, there: str, rank: int):
    """The replica on ``here`` of ``there``'s newest grid slot of ``rank``, once whole."""
    src = os.path.join(nodes[there].snapshot_dir, job_id)
    got = newest_slot(src, rank)
    if got is None or got[1].step != GRID:
        return None
    path = os.path.join(nodes[here].snapshot_dir, job_id, "replicas", there,
                        fmt.slot_name(rank, got[0]))
    try:
        with open(path, "rb") as fh:
            copy = fh.read()
    except FileNotFoundError:
        return None
    with open(os.path.join(src, fmt.slot_name(rank, got[0])), "rb") as fh:
        original = fh.read(got[1].total_bytes)
    return (path, copy, original) if copy[:fmt.HEADER_USED] == original[:fmt.HEADER_USED] \
        else None


def test_each_nodes_newest_snapshot_is_kept_on_its_buddy_byte_for_byte(pair, user):
    nodes, job_id = pair
    for here, there, rank in (("n1", "n2", 1), ("n2", "n1", 0)):
        path, copy, original = wait_for(lambda: replica_of(nodes, job_id, here, there, rank),
                                        90, f"the replica of {there}'s rank {rank} on {here}",
                                        nodes)
        assert copy == original
        st = os.lstat(path)
        assert (st.st_uid, st.st_mode & 0o7777) == (user[0], 0o600)
        for d in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
            st = os.lstat(d)
            assert (st.st_uid, st.st_mode & 0o7777) == (user[0], 0o700), d
    status = json.loads(nodes["n1"].ctl("-o", "json", "status", job_id).stdout)
    mine = [s for s in status.get("snapshots", []) if s.get("node_id") == "n1"]
    assert mine and mine[0].get("replicas") == [f"n2 step {GRID}"], status
    # n2's row too, which n1 asked n2 for over the replication channel.
    theirs = [s for s in status.get("snapshots", []) if s.get("node_id") == "n2"]
    assert theirs and theirs[0].get("replicas") == [f"n1 step {GRID}"], status
    assert int(theirs[0].get("step", -1)) == int(mine[0].get("step", -2)), status
    assert int(theirs[0].get("ranks", 0)) == 1, status
    # Step 3, newer but off the grid, stays on its node.
    assert newest_slot(os.path.join(nodes["n1"].snapshot_dir, job_id), 0, fmt.SLOTS)[1].step \
        == STEPS - 1
    there = os.path.join(nodes["n2"].snapshot_dir, job_id, "replicas", "n1")
    assert not [n for n in os.listdir(there) if not n.endswith((".p0", ".p1"))], \
        os.listdir(there)
    text = scrape(nodes["n1"].metrics_port)
    sent = re.search(r'^elasticd_replication_bytes_total\{direction="sent"\} (\S+)$', text, re.M)
    assert sent and float(sent.group(1)) > 0, text
    assert re.search(r'^elasticd_replication_lag_seconds\{buddy="n2",job_id="%s"\} ' % job_id,
                     text, re.M), text


def _listener_port(d: DaemonProc) -> int:
    found = re.search(r"replication listener on \S+:(\d+)", d.log())
    assert found, d.log()[-2000:]
    return int(found.group(1))


def _dropped(s: socket.socket) -> bool:
    """The daemon closed the connection (a reset when our bytes were left unread)."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def _refused(d: DaemonProc) -> dict:
    text = scrape(d.metrics_port)
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^elasticd_replication_refused_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def test_garbage_a_wrong_key_a_huge_frame_and_silence_are_dropped_and_counted(pair):
    nodes, _ = pair
    d = nodes["n2"]
    port = _listener_port(d)
    before = _refused(d)
    key = clusterkey.load(cluster_key_path()).replication
    prefix = next(a for a in d.args if a.startswith("/repl-"))

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=10)

    with connect() as s:                      # not our protocol at all
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
        assert _dropped(s)
    with connect() as s:                      # a hello, then a MAC under another key
        s.sendall(ch.MAGIC + bytes([5]) + b"intru" + os.urandom(ch.NONCE_BYTES))
        s.recv(4096)
        s.sendall(os.urandom(ch.MAC_BYTES))
        assert _dropped(s)
    with connect() as s:                      # the right key, then a frame far too large
        ch.client_hello(s, key, prefix, "n9", "n2", 1 << 20)
        s.sendall((1 << 30).to_bytes(4, "big"))
        assert _dropped(s)
    with connect() as s:                      # the right key, then silence
        ch.client_hello(s, key, prefix, "n9", "n2", 1 << 20)
        t0 = time.monotonic()
        assert _dropped(s)
        assert time.monotonic() - t0 < TIMEOUT + 5
    after = wait_for(lambda: (lambda a: a if all(
        a.get(r, 0) > before.get(r, 0) for r in ("garbage", "mac", "too_large", "timeout"))
        else None)(_refused(d)), 10, "every refusal counted", nodes)
    assert after, after
    with connect() as s:                      # still serving, to a holder of the key
        c = ch.client_hello(s, key, prefix, "n9", "n2", 1 << 20)
        c.close()
    assert d.proc.poll() is None


def test_an_ask_for_a_row_is_answered_only_to_a_key_holder_and_only_of_a_job_there(pair):
    nodes, job_id = pair
    d = nodes["n2"]
    key = clusterkey.load(cluster_key_path()).replication
    prefix = next(a for a in d.args if a.startswith("/repl-"))
    before = _refused(d)

    def ask(payload: bytes):
        with socket.create_connection(("127.0.0.1", _listener_port(d)), timeout=10) as s:
            c = ch.client_hello(s, key, prefix, "n9", "n2", 1 << 20)
            c.send(ch.Kind.ASK, payload)
            try:
                kind, body = c.recv()
            except ch.ChannelError:
                return None
            return kind, SnapshotRow.from_bytes(bytes(body))

    kind, row = ask(Ask(job_id).to_bytes())
    assert kind is ch.Kind.ROW and row.ranks == 1 and row.step >= 0, row
    kind, row = ask(Ask("nosuchjob").to_bytes())     # not here: an empty row
    assert kind is ch.Kind.ROW and (row.step, row.ranks) == (-1, 0), row
    assert ask(b'{"job_id": "../../etc"}') is None     # not a job id: dropped, counted
    wait_for(lambda: _refused(d).get("garbage", 0) > before.get("garbage", 0), 10,
             "the bad ask counted", nodes)
    assert d.proc.poll() is None


def test_an_offer_of_a_job_not_running_there_or_over_its_budget_is_refused(pair):
    nodes, job_id = pair
    d = nodes["n2"]
    key = clusterkey.load(cluster_key_path()).replication
    prefix = next(a for a in d.args if a.startswith("/repl-"))
    before = _refused(d).get("refused", 0)
    with socket.create_connection(("127.0.0.1", _listener_port(d)), timeout=10) as s:
        c = ch.client_hello(s, key, prefix, "n1", "n2", 1 << 20)
        for offer, why in ((Offer("nosuchjob", 0, "a", 3, 1, 1 << 20), "does not run"),
                           (Offer(job_id, 0, "a", 3, 1, 1 << 49), "over its budget")):
            c.send(ch.Kind.OFFER, offer.to_bytes())
            kind, payload = c.recv()
            reply = Reply.from_bytes(payload)
            assert kind is ch.Kind.REPLY and not reply.ok and why in reply.why, reply
    assert _refused(d)["refused"] >= before + 2
    assert not os.path.exists(os.path.join(d.snapshot_dir, "nosuchjob"))


def test_a_replica_cut_off_half_way_leaves_the_last_one_whole(pair):
    nodes, job_id = pair
    d = nodes["n2"]
    path, copy, _ = wait_for(lambda: replica_of(nodes, job_id, "n2", "n1", 0), 90,
                             "the replica of n1's rank 0 on n2", nodes)
    key = clusterkey.load(cluster_key_path()).replication
    prefix = next(a for a in d.args if a.startswith("/repl-"))
    with socket.create_connection(("127.0.0.1", _listener_port(d)), timeout=10) as s:
        c = ch.client_hello(s, key, prefix, "n1", "n2", 1 << 20)
        slot = path.rsplit(".", 1)[1]
        c.send(ch.Kind.OFFER, Offer(job_id, 0, slot, STEPS + 5, 1, len(copy)).to_bytes())
        kind, payload = c.recv()
        assert Reply.from_bytes(payload).ok
        c.send(ch.Kind.CHUNK, os.urandom(len(copy) // 2))
    where = os.path.dirname(path)
    wait_for(lambda: not [n for n in os.listdir(where) if n.endswith(".incoming")], 10,
             "the cut-off replica's temporary file gone", nodes)
    with open(path, "rb") as fh:
        assert fh.read() == copy


def test_a_forwarded_replica_is_kept_under_its_origin_and_its_own_is_not_taken_back(pair):
    """A key holder forwards a lost node's replica (Offer.origin): kept under
    ``replicas/<origin>/``; n2 offered its own snapshot back answers it has it."""
    nodes, job_id = pair
    d = nodes["n2"]
    own = wait_for(lambda: newest_slot(os.path.join(d.snapshot_dir, job_id), 1), 90,
                   "n2's own grid slot of rank 1", nodes)
    with open(os.path.join(d.snapshot_dir, job_id, fmt.slot_name(1, own[0])), "rb") as fh:
        data = fh.read(own[1].total_bytes)
    key = clusterkey.load(cluster_key_path()).replication
    prefix = next(a for a in d.args if a.startswith("/repl-"))
    h = own[1]
    with socket.create_connection(("127.0.0.1", _listener_port(d)), timeout=10) as s:
        c = ch.client_hello(s, key, prefix, "n1", "n2", 1 << 20)
        c.send(ch.Kind.OFFER, Offer(job_id, 1, own[0], h.step, h.saved_at_ns, len(data),
                                    "n2").to_bytes())
        kind, payload = c.recv()
        assert Reply.from_bytes(payload) == Reply(ok=True, have=True)
        c.send(ch.Kind.OFFER, Offer(job_id, 1, own[0], h.step, h.saved_at_ns, len(data),
                                    "n7").to_bytes())
        assert Reply.from_bytes(c.recv()[1]) == Reply(ok=True)
        c.send(ch.Kind.CHUNK, data)
        c.send(ch.Kind.END)
        assert Reply.from_bytes(c.recv()[1]) == Reply(ok=True)
    with open(os.path.join(d.snapshot_dir, job_id, "replicas", "n7",
                           fmt.slot_name(1, own[0])), "rb") as fh:
        assert fh.read() == data
    assert not os.path.exists(os.path.join(d.snapshot_dir, job_id, "replicas", "n2"))


def test_the_job_ended_frees_its_replicas_on_every_node(pair):
    """Last in the module: it ends the job."""
    nodes, job_id = pair
    wait_for(lambda: replica_of(nodes, job_id, "n2", "n1", 0), 90,
             "the replica of n1's rank 0 on n2", nodes)
    assert nodes["n1"].ctl("cancel", job_id).returncode == 0
    for d in nodes.values():
        wait_for(lambda: not os.path.lexists(os.path.join(d.snapshot_dir, job_id)), 60,
                 f"{d.node_id}'s snapshot dir of the job, replicas and all, gone", nodes)
