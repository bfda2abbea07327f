"""The daemon's side of in-memory snapshots (issue 32): each job's snapshot dir on its node,
its budget, its end, and what `elasticctl status` shows of it.

A real root daemon (one for the module), real unprivileged users (made here with
useradd, names prefixed ``h32s``, removed on teardown) and tiny stdlib jobs that
print their environment and write a slot file whose header the test packed with
workers/snapshot_format.py (the worker library is not needed for any of this).
"""
from __future__ import annotations

import json
import os
import stat
import sys
import time

import pytest

from daemons import DaemonProc, real_users, scrape, start_with_metrics, wait_logged
from elasticd.v1 import control_pb2 as pb
from elasticd.workers import snapshot_format as fmt

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: real users (useradd), a root daemon")

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
GROUP = f"h32s_ctl{_WORKER}"
USERS = (f"h32s_alice{_WORKER}", f"h32s_bob{_WORKER}")
MiB = 1 << 20
NODE_BUDGET = 10 * MiB
JOB_BUDGET = 6 * MiB
STEP = 7
DATA = 64 * 1024

# Prints what it was given, writes its rank's slot "a" once (the header the test packed,
# then zeros up to the snapshot's size), says READY and waits to be stopped.
JOB = r"""
import os, sys, time
d = os.environ["ELASTICD_SNAPSHOT_DIR"]
rank = int(os.environ["RANK"])
print("SNAPSHOT_DIR=" + d, "BUDGET=" + os.environ["ELASTICD_SNAPSHOT_BUDGET_BYTES"], flush=True)
path = os.path.join(d, "rank%d.a" % rank)
if os.path.exists(path):
    print("HAD", os.path.getsize(path), flush=True)
elif sys.argv[1] != "-":
    header = bytes.fromhex(sys.argv[1])
    with open(path + ".tmp", "wb") as f:
        f.write(header)
        f.write(bytes(int(sys.argv[2]) - len(header)))
    os.rename(path + ".tmp", path)
if len(sys.argv) > 3:    # what the worker library publishes for the metrics
    with open(os.path.join(d, "rank%d.costs" % rank), "w") as f:
        f.write(sys.argv[3])
print("READY", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def users():
    with real_users(USERS, GROUP) as made:
        yield [made[n] for n in USERS]


@pytest.fixture(scope="module")
def node(users):
    d, port = start_with_metrics(extra_args=(
        "--set", f"daemon.socket_group={GROUP}",
        "--set", f"snapshot.node_budget={NODE_BUDGET}",
        "--set", f"snapshot.job_budget={JOB_BUDGET}", "--set", "agent.warm_spares=false"))
    d.metrics_port = port
    try:
        with open(os.path.join(d.root, "job.py"), "w") as fh:
            fh.write(JOB)
        for who in users:
            work = os.path.join(d.root, f"work-{who[0]}")
            os.makedirs(work)
            os.chown(work, who[0], who[1])
        yield d
    finally:
        d.cleanup()


def header(rank: int = 0, step: int = STEP) -> fmt.Header:
    return fmt.Header(fmt.SlotState.COMPLETE, rank=rank, world_size=1, step=step,
                      saved_at_ns=time.time_ns(), meta_len=100, data_len=DATA)


def submit(d: DaemonProc, who: tuple, slot: fmt.Header | None, warm: bool = False,
           costs: fmt.RankCosts | None = None) -> str:
    """The job, started cold (a command no template runs: a shell that execs Python), or
    forked from a worker template (``warm``: it imports torch first, seconds). Every
    start path takes its environment from workers/group.py ``worker_env``
    (tests/test_snapshot_budgets.py); cold keeps these tests to a second a job."""
    args = [fmt.pack(slot).hex(), str(slot.total_bytes)] if slot else ["-", "0"]
    args += [costs.to_json()] if costs else []
    command = [sys.executable, "-u", os.path.join(d.root, "job.py"), *args]
    if not warm:
        command = ["/bin/sh", "-c", 'exec "$@"', "sh", *command]
    r = d.ctl("-o", "json", "submit", "--", *command,
              cwd=os.path.join(d.root, f"work-{who[0]}"), user=who)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["id"]


def rank_log(d: DaemonProc, job_id: str) -> str:
    try:
        return d.rank_log(job_id, 0)
    except FileNotFoundError:  # not started yet
        return ""


def ready(d: DaemonProc, job_id: str, count: int = 1) -> str:
    return wait_logged(lambda: rank_log(d, job_id).count("READY") >= count
                       and rank_log(d, job_id), 60, f"job {job_id} ready", {d.node_id: d})


def started(d: DaemonProc, who: tuple, slot: fmt.Header | None,
            costs: fmt.RankCosts | None = None) -> str:
    job_id = submit(d, who, slot, costs=costs)
    ready(d, job_id)
    return job_id


def gone(d: DaemonProc, job_id: str, what: str) -> None:
    wait_logged(lambda: not os.path.lexists(os.path.join(d.snapshot_dir, job_id)), 15, what,
                {d.node_id: d})


def status(d: DaemonProc, job_id: str) -> dict:
    r = d.ctl("-o", "json", "status", job_id)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def snapshots(d: DaemonProc, job_id: str) -> list:
    """The job's ``snapshots`` as GetJob answers (what `status` prints)."""
    return list(d.job(job_id).snapshots)


def sample(page: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels) on a /metrics page."""
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in the scrape")


def stop(d: DaemonProc, job_id: str) -> None:
    with d.client() as c:
        c.call("CancelJob", pb.CancelJobRequest(id=job_id))
    d.wait_job(job_id)


def test_each_job_gets_its_users_dir_and_budget_and_status_shows_its_snapshot(node, users):
    d, (alice, bob) = node, users
    slot = header()
    first = submit(d, alice, slot, costs=fmt.RankCosts(0.0125, 0.25, "peer"))
    log = ready(d, first)
    path = os.path.join(d.snapshot_dir, first)
    root = os.lstat(d.snapshot_dir)
    assert (root.st_uid, stat.S_IMODE(root.st_mode)) == (0, 0o711)
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (alice[0], alice[1], 0o700)
    assert f"SNAPSHOT_DIR={path} BUDGET={JOB_BUDGET}" in log, log
    # A second job on the node gets what the node's budget leaves: min(job, node - others).
    second = submit(d, bob, None)
    log = ready(d, second)
    assert f"BUDGET={NODE_BUDGET - JOB_BUDGET}" in log, log

    shown = status(d, first)["snapshots"]
    assert len(shown) == 1, shown
    s = shown[0]
    assert (s["node_id"], s["step"], s["bytes"], s["ranks"]) == (
        d.node_id, STEP, slot.total_bytes, 1), s
    assert 0 <= s["age_seconds"] < 120 and s["held_bytes"] >= slot.total_bytes, s
    assert s["budget_bytes"] == JOB_BUDGET and s["replicas"] == [], s
    page = scrape(d.metrics_port)
    held = sample(page, f'elasticd_job_snapshot_bytes{{job_id="{first}"}}')
    assert held >= slot.total_bytes, page
    assert 0 <= sample(page, f'elasticd_job_snapshot_age_seconds{{job_id="{first}"}}') < 120
    assert f'elasticd_job_snapshot_age_seconds{{job_id="{second}"}}' not in page  # none yet
    # What its rank published of its last save and restore (workers/snapshot_format.py).
    assert sample(page, f'elasticd_job_snapshot_save_stall_seconds{{job_id="{first}"}}') \
        == 0.0125
    assert sample(page, f'elasticd_job_snapshot_restore_seconds{{job_id="{first}",'
                        f'source="peer"}}') == 0.25
    assert f'elasticd_job_snapshot_save_stall_seconds{{job_id="{second}"}}' not in page
    assert sample(page, "elasticd_snapshot_budget_bytes") == NODE_BUDGET
    assert sample(page, "elasticd_snapshot_granted_bytes") == NODE_BUDGET  # 6 + 4 MiB
    table = d.ctl("status", first).stdout
    assert "snapshots:" in table and "REPLICAS" in table, table
    row = next(line for line in table.splitlines() if line.strip().startswith(d.node_id))
    assert f" {STEP} " in row and row.rstrip().endswith("none"), row

    for job_id in (first, second):
        stop(d, job_id)
        gone(d, job_id, f"{job_id}'s snapshot dir removed after its end")
    assert os.listdir(d.snapshot_dir) == []


def test_a_planted_link_another_users_file_a_fifo_or_a_torn_header_is_no_snapshot(node, users):
    d, (alice, bob) = node, users
    theirs = started(d, alice, header(), costs=fmt.RankCosts(0.5, None, None))
    mine = started(d, bob, None)
    dir_a, dir_b = (os.path.join(d.snapshot_dir, j) for j in (theirs, mine))
    # Costs files bob's job could plant: a link to alice's, a FIFO, garbage, a huge one,
    # one out of range; and a name with a leading zero beside a good one.
    os.symlink(os.path.join(dir_a, "rank0.costs"), os.path.join(dir_b, "rank0.costs"))
    os.mkfifo(os.path.join(dir_b, "rank1.costs"))
    for name, body in (("rank2.costs", "[" * 400), ("rank3.costs", "x" * 100000),
                       ("rank4.costs", '{"save_stall_s": 1e999, "restore_s": null, '
                                       '"restore_source": null}'),
                       ("rank5.costs", fmt.RankCosts(7.0, None, None).to_json()),
                       ("rank05.costs", fmt.RankCosts(9.0, None, None).to_json())):
        with open(os.path.join(dir_b, name), "w") as fh:
            fh.write(body)
    for name in os.listdir(dir_b):
        os.lchown(os.path.join(dir_b, name), bob[0], bob[1])
    page = scrape(d.metrics_port)
    assert sample(page, f'elasticd_job_snapshot_save_stall_seconds{{job_id="{mine}"}}') == 7.0
    assert sample(page, f'elasticd_job_snapshot_save_stall_seconds{{job_id="{theirs}"}}') == 0.5
    for name in os.listdir(dir_b):
        os.unlink(os.path.join(dir_b, name))
    # What bob's own job could do: link to alice's intact slot, make a FIFO.
    os.symlink(os.path.join(dir_a, "rank0.a"), os.path.join(dir_b, "rank0.a"))
    os.mkfifo(os.path.join(dir_b, "rank1.a"))
    for name in ("rank0.a", "rank1.a"):
        os.lchown(os.path.join(dir_b, name), bob[0], bob[1])
    # A copy of alice's intact slot, still hers, planted in bob's dir (only root could).
    with open(os.path.join(dir_a, "rank0.a"), "rb") as src, \
            open(os.path.join(dir_b, "rank0.b"), "wb") as dst:
        dst.write(src.read())
    os.chown(os.path.join(dir_b, "rank0.b"), alice[0], alice[1])
    t0 = time.monotonic()
    s = snapshots(d, mine)[0]
    assert s.step == -1 and s.bytes == 0, s
    # Bob's own slot, torn mid-write (its CRC no longer matches): no snapshot either.
    raw = bytearray(fmt.pack(header(rank=2)))
    raw[20] ^= 0xFF
    with open(os.path.join(dir_b, "rank2.a"), "wb") as fh:
        fh.write(bytes(raw))
    os.chown(os.path.join(dir_b, "rank2.a"), bob[0], bob[1])
    assert snapshots(d, mine)[0].step == -1
    assert time.monotonic() - t0 < 30
    assert snapshots(d, theirs)[0].step == STEP  # the daemon is unharmed
    assert os.path.exists(os.path.join(dir_a, "rank0.a"))     # and followed no link
    for job_id in (theirs, mine):
        stop(d, job_id)


def test_the_dir_outlives_a_daemon_kill_and_what_a_killed_daemon_left_goes(node, users):
    d, (alice, _) = node, users
    live, ended = started(d, alice, header()), started(d, alice, None)
    stop(d, ended)
    gone(d, ended, "the ended job's dir removed")
    # As if the daemon had been killed before it freed an ended job's dir: it is back.
    left = os.path.join(d.snapshot_dir, ended)
    os.mkdir(left, 0o700)
    with open(os.path.join(left, "rank0.a"), "wb") as fh:
        fh.write(b"x" * 4096)
    os.chown(left, alice[0], alice[1])
    d.kill()
    d.start()
    # The live job resumes with its dir as it was; the ended one's goes in the first pass.
    log = ready(d, live, count=2)
    assert f"HAD {header().total_bytes}" in log, log
    gone(d, ended, "the dir a killed daemon left removed")
    assert snapshots(d, live)[0].step == STEP
    stop(d, live)
    wait_logged(lambda: os.listdir(d.snapshot_dir) == [], 15, "every snapshot dir removed",
                {d.node_id: d})
