"""Snapshot dirs and budgets without a daemon (workers/snapshot_dirs.py,
workers/snapshot_status.py): the ledger's arithmetic, the dirs' safeguards, the
worker environment every start path takes, and reading slot headers. The same
things through a real daemon and real users: tests/test_snapshot_dirs.py."""
from __future__ import annotations

import os
import stat
import time

import pytest

from elasticd import config
from elasticd.workers import env as envnames
from elasticd.workers import snapshot_format as fmt
from elasticd.workers.group import prepare_dirs, worker_env
from elasticd.workers.launch import SpawnError
from elasticd.workers.round_place import RoundPlace
from elasticd.workers.snapshot_dirs import (SnapshotBudgets, SnapshotGrant, ensure_job_dir,
                                            prepare_root)
from elasticd.workers.snapshot_status import read_dir
from elasticd.workers.spec import GroupSpec

MiB = 1 << 20


def test_a_job_gets_the_least_of_its_cap_and_what_the_others_left():
    b = SnapshotBudgets("/x", node_budget=10 * MiB, job_budget=6 * MiB)
    assert b.grant("j1") == SnapshotGrant("/x/j1", 6 * MiB)
    assert b.grant("j2").budget_bytes == 4 * MiB       # 10 - 6
    assert b.grant("j3").budget_bytes == 0             # nothing left: never below 0
    assert b.grant("j1").budget_bytes == 6 * MiB       # its own grant is not an "other"
    assert b.given_bytes() == 10 * MiB and b.granted("j3") == 0
    b.release("j1")
    assert b.granted("j1") is None
    assert b.grant("j3").budget_bytes == 6 * MiB       # j1's share came back
    assert SnapshotBudgets("/x", 10 * MiB).grant("j").budget_bytes == 10 * MiB  # 0: the node's


def test_settings_default_to_half_the_filesystem_and_name_bad_values(tmp_path):
    cfg = config.load(path="/dev/null", env={}, overrides={"snapshot.root": str(tmp_path)})
    assert (cfg.snapshot.node_budget, cfg.snapshot.job_budget) == (0, 0)
    prepare_root(str(tmp_path / "shm"))
    st = os.statvfs(tmp_path)
    b = SnapshotBudgets.for_node(config.SnapshotSettings(root=str(tmp_path / "shm")))
    assert b.node_budget == b.job_budget == st.f_blocks * st.f_frsize // 2
    assert config.load(path="/dev/null", env={}).snapshot.root == (
        "/dev/shm/elasticd" if os.geteuid() == 0 else f"/dev/shm/elasticd-{os.geteuid()}")
    with pytest.raises(config.ConfigError) as err:
        config.load(path="/dev/null", env={}, overrides={
            "snapshot.root": "shm", "snapshot.node_budget": 5, "snapshot.job_budget": 6})
    assert "snapshot.root: must be an absolute path" in str(err.value)
    assert "snapshot.job_budget: must not exceed snapshot.node_budget" in str(err.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="hands dirs to another uid (root)")
def test_the_root_and_a_jobs_dir_refuse_links_and_other_users(tmp_path):
    os.chmod(tmp_path, 0o755)
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, tmp_path / "linked")
    with pytest.raises(OSError, match="not a directory"):
        prepare_root(str(tmp_path / "linked"))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    with pytest.raises(OSError, match="belongs to uid 4242"):
        prepare_root(str(theirs))
    root = str(tmp_path / "shm")
    prepare_root(root)
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o711
    path = ensure_job_dir(root, "j1", 4242, 4243)
    st = os.lstat(path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4242, 4243, 0o700)
    with open(os.path.join(path, "rank0.a"), "w") as fh:
        fh.write("kept")
    assert ensure_job_dir(root, "j1", 4242, 4243) == path          # again: kept as it is
    assert os.listdir(path) == ["rank0.a"]
    with pytest.raises(OSError, match="not to the job's user"):
        ensure_job_dir(root, "j1", 5000, 5000)                      # another user's dir
    os.symlink(target, os.path.join(root, "j2"))
    with pytest.raises(OSError):
        ensure_job_dir(root, "j2", 4242, 4242)                      # never through a link
    assert os.lstat(target).st_uid == 0
    with pytest.raises(OSError):
        ensure_job_dir(root, "..", 4242, 4242)


def spec(tmp_path, snapshot: SnapshotGrant | None) -> GroupSpec:
    return GroupSpec(job_id="j1", command=("python", "x.py"), cwd=str(tmp_path),
                     env={envnames.SNAPSHOT_DIR: "/mine", envnames.SNAPSHOT_BUDGET: "1"},
                     uid=os.geteuid(), gid=os.getegid(), nproc=2, restart_count=0,
                     max_restarts=-1,
                     place=RoundPlace(round=1, group_rank=0, group_world_size=1, world_size=2,
                                      rank_offset=0, master_addr="127.0.0.1", master_port=1),
                     log_dir=str(tmp_path / "logs"), run_dir=str(tmp_path / "run"),
                     node_id="n1", snapshot=snapshot)


def test_every_rank_gets_the_jobs_dir_and_budget_over_the_submitters_values(tmp_path):
    root = str(tmp_path / "shm")
    prepare_root(root)
    s = spec(tmp_path, SnapshotGrant(os.path.join(root, "j1"), 3 * MiB))
    prepare_dirs(s)   # what every start path (cold, template, spare, newcomer) runs first
    assert os.path.isdir(os.path.join(root, "j1"))
    for local_rank in range(2):   # cold, forked, handed to a spare, replaced: this env
        env = worker_env(s, local_rank)
        assert env[envnames.SNAPSHOT_DIR] == os.path.join(root, "j1")
        assert env[envnames.SNAPSHOT_BUDGET] == str(3 * MiB)
    os.rmdir(os.path.join(root, "j1"))
    os.symlink(tmp_path, os.path.join(root, "j1"))
    with pytest.raises(SpawnError, match="snapshot dir"):
        prepare_dirs(s)


def slot(path: str, rank: int, step: int, state=fmt.SlotState.COMPLETE, data: int = 100):
    h = fmt.Header(state, rank=rank, world_size=4, step=step, saved_at_ns=int(time.time_ns()),
                   meta_len=10, data_len=data)
    with open(path, "wb") as fh:
        fh.write(fmt.pack(h))
    return h


def test_the_newest_step_is_the_newest_every_rank_holds_complete(tmp_path):
    d = str(tmp_path)
    assert read_dir(str(tmp_path / "none"), os.geteuid(), 64) is None
    assert not read_dir(d, os.geteuid(), 64).present
    slot(f"{d}/rank0.a", 0, 5)
    h06 = slot(f"{d}/rank0.b", 0, 6)
    h16 = slot(f"{d}/rank1.a", 1, 6)
    slot(f"{d}/rank1.b", 1, 7, state=fmt.SlotState.WRITING)   # being written: not yet
    got = read_dir(d, os.geteuid(), 64)
    assert (got.step, got.ranks, got.bytes) == (6, 2, h06.total_bytes + h16.total_bytes)
    assert got.saved_at == min(h06.saved_at_ns, h16.saved_at_ns) / 1e9
    slot(f"{d}/rank1.b", 0, 7)   # a header whose rank is not its file's: not rank 1's
    assert read_dir(d, os.geteuid(), 64).step == 6
    slot(f"{d}/rank2.a", 2, 4)   # a rank that holds none of the others' steps
    assert read_dir(d, os.geteuid(), 64).step == -1
    assert read_dir(d, os.geteuid() + 1, 64).step == -1   # not the job's user's files
