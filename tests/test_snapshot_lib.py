"""elasticd.snapshot, the worker-side library (issue 32): real torch, real processes
(forked from this one, so torch is loaded once), real files on tmpfs, real users.

* a nested state (a model's and an optimizer's state_dict, RNG states, python
  values) comes back bit for bit; restored tensors are private (changing them
  or saving into their slot never changes the other);
* a process SIGKILLed in the middle of a save (header WRITING) restores the
  previous step; a slot whose meta or size does not match its header is absent;
* BadState, StructureChanged, OverBudget and NoSpace say what and where;
* a planted symbolic link, a dir or file of another real user, and a default
  folder another user planted are refused (NotOwned), never followed;
* two ranks (gloo) where one holds a newer step agree on the common one;
* an asynchronous save equals a synchronous one, and handle.wait() raises what
  failed in the background;
* ``python -m elasticd.snapshot clean`` removes a run's default dir;
* a rank whose node holds no slot of its own but a replica the daemon received
  from the buddy node (``replicas/<node>/``) restores it (source ``peer``); its own
  slot wins for a step both hold; a replica dir that is a link is not followed;
* with a pin grid, a rank keeps its two newest grid steps however often it saves, so
  a rank holding only a grid step (a lost node's replica) and one that saved every
  step agree on it; the ranks' own slots of later steps are retired after;
* restore() waits for a replica only where a rank holds none while another holds
  one: not on a first start; both get None when none arrives, both its step when it does.
"""
from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch

from elasticd import snapshot
from elasticd.snapshot import region as regions
from elasticd.snapshot import slots
from elasticd.workers import env as wenv
from elasticd.workers import snapshot_format as fmt

ROOT = os.geteuid() == 0
FORK = multiprocessing.get_context("fork")


@pytest.fixture
def snapdir(monkeypatch):
    """A fresh private snapshot dir on tmpfs, as the daemon makes one, named in the env."""
    path = tempfile.mkdtemp(prefix="t32-", dir="/dev/shm")
    os.chmod(path, 0o700)
    monkeypatch.setenv(wenv.SNAPSHOT_DIR, path)
    monkeypatch.delenv(wenv.SNAPSHOT_BUDGET, raising=False)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def training_state(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4).to(torch.float64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 8)
    model[2](model[1](model[0](x)).double()).sum().backward()
    opt.step()
    random.seed(seed)
    state = {
        "model": model.state_dict(), "opt": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "loader": {"epoch": 3, "offset": 12345678901234567890123, "name": "shard-7",
                   "raw": b"\x00\xffbytes", "done": False, "none": None},
        "floats": [math.nan, -0.0, math.inf, 1 / 3], 7: (torch.zeros(0, 3), "tuple"),
        "half": torch.randn(5, dtype=torch.bfloat16), "flags": torch.tensor([True, False]),
        "view": torch.arange(12.).reshape(3, 4).t(),    # not contiguous
    }
    return state, model, opt


def same(a, b, path="state") -> None:
    """``a`` and ``b`` are equal bit for bit, container types and dtypes included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and a.device == b.device, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) \
            if a.numel() else True, path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
        return
    assert type(a) is type(b), (path, a, b)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a.hex() == b.hex(), path
    else:
        assert a == b, path


def test_a_nested_training_state_comes_back_bit_for_bit(snapdir):
    state, model, opt = training_state()
    snapshot.save(5, state)
    step, got = snapshot.restore()
    assert step == 5
    same(state, got)
    # It loads into a fresh model and optimizer, and they then equal the saved ones.
    fresh, fresh_model, fresh_opt = training_state(seed=1)
    fresh_model.load_state_dict(got["model"])
    fresh_opt.load_state_dict(got["opt"])
    same(model.state_dict(), fresh_model.state_dict())
    same(opt.state_dict(), fresh_opt.state_dict())
    t = snapshot.timings()
    assert t.restore_step == 5 and t.restore_source == "local" and t.save_bytes > 0
    # Beside its slots, the rank's costs for the daemon's metrics, as the daemon parses them.
    slots = sorted(n for n in os.listdir(snapdir) if n != "rank0.costs")
    assert slots == ["rank0.a", "rank0.b"] or slots == ["rank0.a"]
    with open(os.path.join(snapdir, "rank0.costs")) as fh:
        costs = fmt.RankCosts.from_doc(json.load(fh))
    assert costs.save_stall_s > 0 and costs.restore_source == "local" \
        and costs.restore_s == t.restore_s
    for name in os.listdir(snapdir):
        assert os.stat(os.path.join(snapdir, name)).st_mode & 0o777 == 0o600


def test_restored_tensors_are_private_to_the_caller(snapdir):
    w = torch.arange(1000.)
    snapshot.save(1, {"w": w})
    _, got = snapshot.restore()
    got["w"].add_(1)                       # changing a restored tensor...
    assert torch.equal(snapshot.restore()[1]["w"], w)   # ...does not change the slot
    held = snapshot.restore()[1]["w"]
    for step in (2, 3, 4):                 # saves overwrite both slots, the held one's too
        snapshot.save(step, {"w": w + step})
    assert torch.equal(held, w)            # the tensors a restore gave stay as they were
    assert snapshot.restore()[0] == 4
    assert sorted(os.listdir(snapdir)) == ["rank0.a", "rank0.b", "rank0.costs"]
    # Once the restored tensors are dropped (no GC needed), saves reuse the slot files.
    del got, held
    def slot_inodes() -> dict:      # the costs file beside them is replaced whole each time
        return {n: os.stat(os.path.join(snapdir, n)).st_ino for n in os.listdir(snapdir)
                if n != "rank0.costs"}
    inodes = slot_inodes()
    got = snapshot.restore()
    del got
    for step in (5, 6):
        snapshot.save(step, {"w": w + step})
    assert slot_inodes() == inodes


def _hold_in_the_middle(pipe, size: int) -> None:
    """Child: save step 1, then step 2 until half its data is in, tell, and wait to die."""
    torch.set_num_threads(1)
    big = torch.full((size,), 1.0)
    snapshot.save(1, {"big": big, "step": 1})

    def fill(m, meta, meta_len, tensors):
        view = torch.frombuffer(m.mm, dtype=torch.uint8, count=meta.data_len // 2,
                                offset=fmt.data_offset(meta_len))
        view.copy_(tensors[0].view(torch.uint8)[:meta.data_len // 2])
        pipe.send("half")
        signal.pause()

    slots.fill = fill
    snapshot.save(2, {"big": big + 1, "step": 2})


def test_a_process_killed_in_the_middle_of_a_save_restores_the_previous_step(snapdir):
    size = 16 << 20    # 64 MiB of float32
    here, there = FORK.Pipe()
    child = FORK.Process(target=_hold_in_the_middle, args=(there, size))
    child.start()
    try:
        assert here.poll(60) and here.recv() == "half"
        headers = []
        for name in ("rank0.a", "rank0.b"):
            with open(os.path.join(snapdir, name), "rb") as fh:
                headers.append(fmt.parse(fh.read(fmt.HEADER_USED)))
        assert sorted((h.state, h.step) for h in headers) == [
            (fmt.SlotState.WRITING, 2), (fmt.SlotState.COMPLETE, 1)]
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(10)
    assert child.exitcode == -signal.SIGKILL
    step, got = snapshot.restore()
    assert step == 1 and got["step"] == 1 and torch.equal(got["big"], torch.full((size,), 1.0))


def _corrupt(path: str, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_a_slot_whose_meta_or_size_does_not_match_its_header_is_absent(snapdir):
    snapshot.save(1, {"w": torch.ones(100)})
    snapshot.save(2, {"w": torch.ones(100) * 2})
    newest = next(n for n in os.listdir(snapdir)
                  if fmt.parse(open(os.path.join(snapdir, n), "rb").read(4096)).step == 2)
    path = os.path.join(snapdir, newest)
    _corrupt(path, fmt.HEADER_BYTES + 20)            # a byte of the meta
    assert snapshot.restore()[0] == 1
    _corrupt(path, fmt.HEADER_BYTES + 20)            # mended
    assert snapshot.restore()[0] == 2
    os.truncate(path, fmt.HEADER_BYTES + 100)        # the data cut off
    step, got = snapshot.restore()
    assert step == 1 and torch.equal(got["w"], torch.ones(100))


def test_a_state_that_is_not_tensors_and_plain_values_is_refused_naming_the_path(snapdir):
    cases = [({"opt": {"x": {1, 2}}}, "state['opt']['x']: a set"),
             ({"a": [1, object()]}, "state['a'][1]: a object"),
             ({"k": {True: 1}}, "state['k']: a key True that is a bool"),
             ({"s": torch.zeros(3).to_sparse()}, "state['s']: a torch.sparse_coo tensor"),
             ({"n": 1.5}, None)]
    for state, message in cases[:-1]:
        with pytest.raises(snapshot.BadState) as err:
            snapshot.save(1, state)
        assert str(err.value).startswith(message), err.value
        assert isinstance(err.value, snapshot.SnapshotError)
    with pytest.raises(snapshot.BadState, match="step must be a whole number"):
        snapshot.save(-1, {})
    assert snapshot.restore() is None     # nothing was written


def test_a_different_structure_than_the_previous_save_is_refused_saying_what_changed(snapdir):
    snapshot.save(1, {"w": torch.zeros(2, 3), "lr": 0.1, "gone": 1})
    with pytest.raises(snapshot.StructureChanged) as err:
        snapshot.save(2, {"w": torch.zeros(2, 4), "lr": None, "new": torch.ones(1)})
    text = str(err.value)
    assert "state['w'] was tensor float32 [2, 3], now tensor float32 [2, 4]" in text
    assert "state['lr'] was float, now None" in text
    assert "state['gone'] (int) is gone" in text and "state['new'] (tensor float32 [1]) is new" \
        in text
    snapshot.save(2, {"w": torch.ones(2, 3), "lr": 0.2, "gone": 5})   # same structure: fine
    assert snapshot.restore()[1]["gone"] == 5


def test_a_save_over_the_budget_fails_naming_the_setting_and_keeps_the_last_one(snapdir,
                                                                            monkeypatch):
    snapshot.save(1, {"w": torch.zeros(1 << 10), "note": ""})
    one = os.path.getsize(os.path.join(snapdir, "rank0.a"))
    # Room for both slots of rank 0, not for rank 1's first.
    monkeypatch.setenv(wenv.SNAPSHOT_BUDGET, str(2 * one + 10))
    snapshot.save(2, {"w": torch.ones(1 << 10), "note": ""})
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(snapshot.OverBudget) as err:
        snapshot.save(2, {"w": torch.ones(1 << 10), "note": ""})
    text = str(err.value)
    assert wenv.SNAPSHOT_BUDGET in text and "snapshot.job_budget" in text \
        and "snapshot.node_budget" in text and str(2 * one + 10) in text \
        and str(3 * one) in text, text
    assert "rank1.a" not in os.listdir(snapdir)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(wenv.SNAPSHOT_BUDGET, str(2 * one))  # a longer meta needs more
    with pytest.raises(snapshot.OverBudget):
        snapshot.save(3, {"w": torch.ones(1 << 10), "note": "x" * 10000})
    monkeypatch.setenv(wenv.SNAPSHOT_BUDGET, "12GB")
    with pytest.raises(snapshot.SnapshotError, match="whole number of bytes"):
        snapshot.save(3, {"w": torch.ones(1 << 10), "note": ""})
    monkeypatch.delenv(wenv.SNAPSHOT_BUDGET)
    step, got = snapshot.restore()
    assert step == 2 and torch.equal(got["w"], torch.ones(1 << 10))


@pytest.mark.skipif(not ROOT, reason="needs root: mounts a small tmpfs")
def test_a_save_the_filesystem_cannot_hold_fails_clearly(monkeypatch):
    mnt = tempfile.mkdtemp(prefix="t32-mnt-")
    try:
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", mnt],
                             capture_output=True, text=True)
        if got.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
        monkeypatch.setenv(wenv.SNAPSHOT_DIR, mnt)
        monkeypatch.delenv(wenv.SNAPSHOT_BUDGET, raising=False)
        snapshot.save(1, {"w": torch.ones(1000)})
        monkeypatch.setenv("RANK", "1")     # a second rank of this node: 4 MiB, 1 MiB free
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(snapshot.NoSpace, match="bytes free"):
            snapshot.save(1, {"w": torch.ones(1 << 20)})
        assert os.listdir(mnt) == ["rank0.a"]
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        assert snapshot.restore()[0] == 1
    finally:
        subprocess.run(["umount", "--lazy", mnt], capture_output=True)  # this process maps it
        os.rmdir(mnt)


def test_a_planted_symbolic_link_is_refused_never_followed(snapdir, tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    os.symlink(target, os.path.join(snapdir, "rank0.a"))
    with pytest.raises(snapshot.NotOwned, match="symbolic link"):
        snapshot.save(1, {"w": torch.ones(3)})
    with pytest.raises(snapshot.NotOwned, match="symbolic link"):
        snapshot.restore()
    assert target.read_bytes() == b"precious"
    link = tmp_path / "dirlink"
    os.symlink(snapdir, link)
    os.environ[wenv.SNAPSHOT_DIR] = str(link)    # the fixture's monkeypatch restores it
    with pytest.raises(snapshot.NotOwned, match="symbolic link"):
        snapshot.save(1, {"w": torch.ones(3)})


@contextlib.contextmanager
def a_real_user(name: str):
    subprocess.run(["userdel", name], capture_output=True)
    subprocess.run(["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)


def _as_user(pipe, uid: int, gid: int) -> None:
    """Child: become the user for real, then save into the default dir."""
    torch.set_num_threads(1)
    os.environ.pop(wenv.SNAPSHOT_DIR, None)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    try:
        snapshot.save(1, {"w": torch.ones(3)})
        pipe.send("saved")
    except BaseException as exc:
        pipe.send(f"{type(exc).__name__}: {exc}")


@pytest.mark.skipif(not ROOT, reason="needs root: a real user made with useradd")
def test_a_region_of_another_user_is_refused(snapdir):
    with a_real_user("h32s_mallory") as other:
        # The daemon's dir, but another user's.
        os.chown(snapdir, other.pw_uid, other.pw_gid)
        with pytest.raises(snapshot.NotOwned, match=f"belongs to uid {other.pw_uid}"):
            snapshot.save(1, {"w": torch.ones(3)})
        with pytest.raises(snapshot.NotOwned, match=f"belongs to uid {other.pw_uid}"):
            snapshot.restore()
        os.chown(snapdir, 0, 0)
        os.chmod(snapdir, 0o755)
        with pytest.raises(snapshot.NotOwned, match="group or others may use it"):
            snapshot.save(1, {"w": torch.ones(3)})
        os.chmod(snapdir, 0o700)
        # A slot file in it that another user owns (planted by root, or left).
        snapshot.save(1, {"w": torch.ones(3)})
        os.chown(os.path.join(snapdir, "rank0.a"), other.pw_uid, other.pw_gid)
        with pytest.raises(snapshot.NotOwned, match="slot file .*rank0.a belongs to uid"):
            snapshot.restore()
        # Without a daemon: a default folder in /dev/shm that someone else made first.
        planted = regions.base_dir(other.pw_uid)
        shutil.rmtree(planted, ignore_errors=True)
        os.mkdir(planted, 0o700)          # root's, not the user's
        try:
            here, there = FORK.Pipe()
            child = FORK.Process(target=_as_user, args=(there, other.pw_uid, other.pw_gid))
            child.start()
            assert here.poll(60)
            said = here.recv()
            child.join(10)
            assert said.startswith(f"NotOwned: snapshot folder {planted} is not uid "
                                   f"{other.pw_uid}'s"), said
            assert os.listdir(planted) == []
            os.rmdir(planted)            # and where nobody planted one, it is made 0700
            child = FORK.Process(target=_as_user, args=(there, other.pw_uid, other.pw_gid))
            child.start()
            assert here.poll(60) and here.recv() == "saved"
            child.join(10)
            st = os.stat(planted)
            assert st.st_uid == other.pw_uid and st.st_mode & 0o777 == 0o700
        finally:
            shutil.rmtree(planted, ignore_errors=True)


def _rank(pipe, rank: int, init: str, steps: tuple, plant: str) -> None:
    """Child: rank ``rank`` of 2 (gloo): save ``steps``, restore, say what it got. With
    ``plant``, its slot of that name is first replaced by a symbolic link."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        for s in steps:
            snapshot.save(s, {"w": torch.full((4,), float(10 * rank + s)), "rank": rank})
        if plant:
            path = os.path.join(os.environ[wenv.SNAPSHOT_DIR], plant)
            os.unlink(path)
            os.symlink("/dev/null", path)
        got = snapshot.restore()
        pipe.send(json.dumps(None if got is None else
                             [got[0], got[1]["rank"], got[1]["w"].tolist()]))
        dist.destroy_process_group()
    except BaseException as exc:
        pipe.send(json.dumps(f"{type(exc).__name__}: {exc}"))


def _ranks(snapdir: str, target, args: tuple, meanwhile=None) -> list:
    """Run ``target(pipe, rank, init, *args[rank])`` as ranks 0 and 1 (forked), call
    ``meanwhile()`` while they run, and return what each sent (JSON)."""
    init = f"file://{snapdir}-store-{uuid.uuid4().hex}"
    pipes, procs = [], []
    for rank, extra in enumerate(args):
        here, there = FORK.Pipe()
        p = FORK.Process(target=target, args=(there, rank, init, *extra))
        p.start()
        pipes.append(here)
        procs.append(p)
    try:
        if meanwhile is not None:
            meanwhile()
        return [json.loads(h.recv()) if h.poll(60) else "no answer" for h in pipes]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init[len("file://"):])


def _two_ranks(snapdir: str, steps0: tuple, steps1: tuple, plant: str = "") -> list:
    return _ranks(snapdir, _rank, ((steps0, ""), (steps1, plant)))


def test_two_ranks_agree_on_the_newest_step_both_hold(snapdir):
    # Rank 0 saved steps 3 and 4; rank 1 died before its save of step 4 completed.
    got = _two_ranks(snapdir, (3, 4), (3,))
    assert got == [[3, 0, [3.0] * 4], [3, 1, [13.0] * 4]], got
    # No step in common (rank 1's slots hold 3; rank 0 goes on to 5 and 6): both None.
    got = _two_ranks(snapdir, (5, 6), ())
    assert got == [None, None], got
    # A rank that finds a planted link raises NotOwned after the exchange; the other,
    # not left waiting, gets None.
    got = _two_ranks(snapdir, (7,), (7,), plant="rank1.a")
    assert got[0] is None and got[1].startswith("NotOwned: slot file") \
        and "symbolic link" in got[1], got


def test_an_asynchronous_save_equals_a_synchronous_one(snapdir):
    state, _, _ = training_state()
    handle = snapshot.save(1, state, wait=False)
    handle.wait()
    assert handle.done() and snapshot.timings().save_stall_s is not None
    _, via_async = snapshot.restore()
    snapshot.save(2, state)
    _, via_sync = snapshot.restore()
    same(via_sync, via_async)
    same(state, via_async)
    # The caller may change its tensors as soon as save() returns.
    saved = state["model"]["0.weight"].clone()
    handle = snapshot.save(3, state, wait=False)
    state["model"]["0.weight"].add_(1)
    handle.wait()
    step, got = snapshot.restore()
    assert step == 3 and torch.equal(got["model"]["0.weight"], saved)


def test_a_background_error_is_raised_by_wait_and_the_last_snapshot_stays(snapdir,
                                                                          monkeypatch):
    snapshot.save(1, {"w": torch.ones(8)})

    def broken(m, meta_len, staging):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(slots, "fill_from", broken)
    handle = snapshot.save(2, {"w": torch.ones(8) * 2}, wait=False)
    with pytest.raises(OSError, match="Input/output error"):
        handle.wait()
    assert snapshot.restore()[0] == 1
    # A failed save nobody waited for is raised by the next one.
    snapshot.save(3, {"w": torch.ones(8) * 3}, wait=False)
    with pytest.raises(snapshot.SnapshotError, match="save of step 3 failed: .*Input/output"):
        snapshot.save(4, {"w": torch.ones(8) * 4})
    monkeypatch.undo()
    os.environ[wenv.SNAPSHOT_DIR] = snapdir
    snapshot.save(4, {"w": torch.ones(8) * 4})
    assert snapshot.restore()[0] == 4


def test_clean_removes_a_runs_default_dir(monkeypatch):
    run = f"t32-{uuid.uuid4().hex[:8]}"
    monkeypatch.delenv(wenv.SNAPSHOT_DIR, raising=False)
    monkeypatch.delenv(wenv.SNAPSHOT_BUDGET, raising=False)
    monkeypatch.setenv(wenv.TORCHRUN_RUN_ID, run)
    snapshot.save(1, {"w": torch.ones(3)})
    where = os.path.join(regions.base_dir(), run)
    assert os.stat(where).st_mode & 0o777 == 0o700 and os.listdir(where) == ["rank0.a"]
    assert snapshot.restore()[0] == 1
    cmd = [sys.executable, "-m", "elasticd.snapshot"]
    helped = subprocess.run([*cmd, "clean", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "/dev/shm/elasticd-snapshots-<uid>/<run id>" in helped.stdout
    done = subprocess.run([*cmd, "clean", run], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "removed 1 slot file(s)" in done.stdout and not os.path.exists(where)
    bad = subprocess.run([*cmd, "clean", "../etc"], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a plain name" in bad.stderr


@pytest.mark.slow
def test_an_asynchronous_save_in_flight_at_exit_completes(snapdir):
    """A script whose last act is ``save(wait=False)``: the interpreter's exit waits for
    the background copy, so the snapshot is complete (a fresh interpreter: ~3 s)."""
    code = ("import sys, torch\nfrom elasticd import snapshot\n"
            "snapshot.save(9, {'w': torch.full((32 << 20,), 2.0)}, wait=False)\nsys.exit(0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    step, got = snapshot.restore()
    assert step == 9 and torch.equal(got["w"], torch.full((32 << 20,), 2.0))


# ---------------------------------------------------------------- replicas

def _as_replica(snapdir: str, node: str) -> None:
    """Move this rank's slot files into ``replicas/<node>/``, as the daemon keeps them."""
    where = os.path.join(snapdir, "replicas", node)
    os.makedirs(where, mode=0o700)
    os.chmod(os.path.join(snapdir, "replicas"), 0o700)
    for name in os.listdir(snapdir):
        if name.startswith("rank1."):
            os.rename(os.path.join(snapdir, name), os.path.join(where, name))


def test_a_rank_with_no_slot_of_its_own_restores_the_buddys_replica(snapdir, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    state = {"w": torch.arange(6, dtype=torch.float64) * 3, "step": 5}
    snapshot.save(4, {"w": torch.zeros(6, dtype=torch.float64), "step": 4})
    snapshot.save(5, state)
    _as_replica(snapdir, "n2")
    assert not [n for n in os.listdir(snapdir) if n.startswith("rank")]
    step, got = snapshot.restore()
    assert step == 5 and got["step"] == 5 and torch.equal(got["w"], state["w"])
    assert snapshot.timings().restore_source == "peer"


def test_its_own_slot_wins_and_a_linked_replica_dir_is_not_followed(snapdir, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
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


# ---------------------------------------------------------------- the pin grid, the wait

def _headers(snapdir: str, rank: int) -> dict:
    """{slot: the step its complete header says} of the rank's slot files."""
    out = {}
    for slot in fmt.ALL_SLOTS:
        with contextlib.suppress(OSError, fmt.BadHeader):
            with open(os.path.join(snapdir, fmt.slot_name(rank, slot)), "rb") as fh:
                h = fmt.parse(fh.read(fmt.HEADER_USED))
            if h.state is fmt.SlotState.COMPLETE:
                out[slot] = h.step
    return out


def test_the_two_newest_grid_steps_stay_however_often_a_rank_saves(snapdir, monkeypatch):
    monkeypatch.setenv(wenv.SNAPSHOT_PIN_EVERY, "10")
    for s in range(26):
        snapshot.save(s, {"w": torch.full((4,), float(s)), "rank": 0})
    held = _headers(snapdir, 0)
    assert sorted(held.values()) == [10, 20, 24, 25] and held["p0"] in (10, 20), held
    assert snapshot.restore()[0] == 25
    # A rank that holds only grid step 20 (the replica a lost node's buddy kept) and one
    # that saved every step have step 20 in common: without the grid they have none.
    assert _two_ranks(snapdir, tuple(range(30, 56)), (50,)) == \
        [[50, 0, [50.0] * 4], [50, 1, [60.0] * 4]]
    # The ranks went back to 50: rank 0's own slots of 51..55 are no snapshot any more.
    assert max(_headers(snapdir, 0).values()) == 50
    monkeypatch.setenv(wenv.SNAPSHOT_PIN_EVERY, "ten")
    with pytest.raises(snapshot.SnapshotError, match="ELASTICD_SNAPSHOT_PIN_EVERY"):
        snapshot.save(60, {"w": torch.ones(4), "rank": 0})


def _waiting_rank(pipe, rank: int, init: str, steps: tuple) -> None:
    """Child: rank ``rank`` of 2 saves ``steps``, restores; says what, from where, how long."""
    torch.set_num_threads(1)
    import time
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        for s in steps:
            snapshot.save(s, {"w": torch.full((4,), float(10 * rank + s))})
        t0 = time.monotonic()
        got = snapshot.restore()
        took = time.monotonic() - t0
        pipe.send(json.dumps([None if got is None else [got[0], got[1]["w"].tolist()],
                              snapshot.timings().restore_source, took]))
        dist.destroy_process_group()
    except BaseException as exc:
        pipe.send(json.dumps(f"{type(exc).__name__}: {exc}"))


def _wait_case(snapdir: str, steps0: tuple, replica_after: float | None,
               staged: str = "") -> list:
    """Two ranks, rank 1 holding nothing; ``staged`` (a dir of rank 1's slots) moved into
    ``replicas/n3/`` ``replica_after`` seconds after they start, as a forward lands."""
    import time

    def land() -> None:
        time.sleep(replica_after)
        os.rename(staged, os.path.join(snapdir, "replicas", "n3"))
    return _ranks(snapdir, _waiting_rank, ((steps0,), ((),)),
                  land if replica_after is not None else None)


def _stage_rank1(snapdir: str, monkeypatch, steps: tuple) -> str:
    """A dir of rank 1's slots of ``steps`` (what a forward will bring), saved as rank 1
    of 2; then the snapshot dir is ``snapdir`` again and the restore wait 30 s."""
    staged = os.path.join(snapdir, "staged")
    os.mkdir(staged, 0o700)
    monkeypatch.setenv(wenv.SNAPSHOT_DIR, staged)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for step in steps:
        snapshot.save(step, {"w": torch.full((4,), 10.0 + step)})
    monkeypatch.setenv(wenv.SNAPSHOT_DIR, snapdir)
    monkeypatch.setenv(wenv.SNAPSHOT_RESTORE_WAIT, "30")
    return staged


def test_restore_waits_for_a_forwarded_replica_only_where_a_rank_holds_none(snapdir,
                                                                           monkeypatch):
    monkeypatch.setenv(wenv.SNAPSHOT_RESTORE_WAIT, "1.5")
    # Nobody holds anything (a first start): no wait.
    nothing = _wait_case(snapdir, (), None)
    assert [r[:2] for r in nothing] == [[None, "none"]] * 2 and nothing[0][2] < 1.0, nothing
    # Rank 0 holds step 5, rank 1 nothing, and nothing arrives: both None after the wait.
    lost = _wait_case(snapdir, (5,), None)
    assert [r[:2] for r in lost] == [[None, "none"]] * 2 and lost[1][2] >= 1.4, lost
    # The replica of rank 1's step 5 lands 0.5 s in: both go on from step 5, rank 1 from it.
    staged = _stage_rank1(snapdir, monkeypatch, (5,))
    os.mkdir(os.path.join(snapdir, "replicas"), 0o700)
    found = _wait_case(snapdir, (), 0.5, staged)
    assert [r[:2] for r in found] == [[[5, [5.0] * 4], "local"], [[5, [15.0] * 4], "peer"]], \
        found
    assert found[1][2] < 10, found


def test_restore_waits_while_only_a_replica_of_no_common_step_has_landed(snapdir,
                                                                         monkeypatch):
    """A forward lands file by file: rank 1 (it took over a lost node's ranks) holds the
    replica of step 3 first, the step rank 0 still holds (5) arrives 0.5 s later. The
    ranks wait for it, and do not go on from nothing (seen in a 3-node loss on a loaded
    machine: the replica of grid step 10 landed before that of 20)."""
    staged = _stage_rank1(snapdir, monkeypatch, (3, 5))
    replicas = os.path.join(snapdir, "replicas", "n3")
    os.makedirs(replicas, 0o700)
    os.chmod(os.path.join(snapdir, "replicas"), 0o700)
    by_step = {h: slot for slot, h in _headers(staged, 1).items()}
    first, later = (fmt.slot_name(1, by_step[s]) for s in (3, 5))
    os.rename(os.path.join(staged, first), os.path.join(replicas, first))
    import time

    def land() -> None:
        time.sleep(0.5)
        os.rename(os.path.join(staged, later), os.path.join(replicas, later))
    got = _ranks(snapdir, _waiting_rank, (((5,),), ((),)), land)
    assert [r[:2] for r in got] == [[[5, [5.0] * 4], "local"], [[5, [15.0] * 4], "peer"]], got
    assert 0.4 < got[1][2] < 10, got
