"""elasticd.snapshot's restore from a peer's replica (issue 32, replication): a rank whose
node holds no slot of its own, but a replica the daemon received from the buddy node
(``replicas/<node>/rank{r}.{slot}``), restores it and says so (``restore_source`` peer);
its own slot wins for a step both hold; a replica dir that is a link is never followed."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from elasticd import snapshot
from elasticd.workers import env as wenv


@pytest.fixture
def snapdir(monkeypatch):
    path = tempfile.mkdtemp(prefix="t32r-", dir="/dev/shm")
    os.chmod(path, 0o700)
    monkeypatch.setenv(wenv.SNAPSHOT_DIR, path)
    monkeypatch.delenv(wenv.SNAPSHOT_BUDGET, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_replica(snapdir: str, node: str) -> None:
    """Move this rank's slot files into ``replicas/<node>/``, as the daemon keeps them."""
    where = os.path.join(snapdir, "replicas", node)
    os.makedirs(where, mode=0o700)
    os.chmod(os.path.join(snapdir, "replicas"), 0o700)
    for name in os.listdir(snapdir):
        if name.startswith("rank1."):
            os.rename(os.path.join(snapdir, name), os.path.join(where, name))


def test_a_rank_with_no_slot_of_its_own_restores_the_buddys_replica(snapdir):
    state = {"w": torch.arange(6, dtype=torch.float64) * 3, "step": 5}
    snapshot.save(4, {"w": torch.zeros(6, dtype=torch.float64), "step": 4})
    snapshot.save(5, state)
    _as_replica(snapdir, "n2")
    assert not [n for n in os.listdir(snapdir) if n.startswith("rank")]
    step, got = snapshot.restore()
    assert step == 5 and got["step"] == 5 and torch.equal(got["w"], state["w"])
    assert snapshot.timings().restore_source == "peer"


def test_its_own_slot_wins_and_a_linked_replica_dir_is_not_followed(snapdir):
    snapshot.save(7, {"w": torch.ones(3)})
    _as_replica(snapdir, "n2")            # the replica of step 7
    snapshot.save(7, {"w": torch.full((3,), 2.0)})   # and a slot of its own, step 7
    step, got = snapshot.restore()
    assert step == 7 and got["w"].tolist() == [2.0] * 3
    assert snapshot.timings().restore_source == "local"
    # Only a link to the replica left: skipped, never followed.
    for name in os.listdir(snapdir):
        if name.startswith("rank1."):
            os.unlink(os.path.join(snapdir, name))
    elsewhere = os.path.join(snapdir, "elsewhere")
    os.rename(os.path.join(snapdir, "replicas", "n2"), elsewhere)
    os.symlink(elsewhere, os.path.join(snapdir, "replicas", "n2"))
    assert snapshot.restore() is None
    assert snapshot.timings().restore_source == "none"
