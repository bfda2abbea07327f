"""Learned hang timeouts, the beat record and stragglers: pure decisions, no I/O.

The tracker runs on a fake clock and fake process calls (as in test_hang.py);
the real daemon with real torch workers is in test_hang_acceptance.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from elasticd import config
from elasticd.hangs.timeouts import (
    HangLimits, LearnSettings, PhaseRecord, decode_limits, encode_limits, limits_table, observe,
    phase_limit, read_limits_file, write_limits_file)
from elasticd.hangs.detector import HEARTBEAT_ENV, BeatRecord, ProgressTracker
from elasticd.hangs.stragglers import RankSamples, Straggler, crossed, find_straggler
from elasticd.workers.rank_files import WORKER_SITE
from elasticd.workers.contract import beats as contract
from test_hang import FakeGroup, FakeOps, FakeRegistry, beat

PY = sys.executable
FIXED = HangLimits(soft=60, hard=180, first_step=600)
LEARN = LearnSettings(floor=10, factor=5, warmup=3, dump_fraction=0.5, fixed=FIXED)


# ---------------------------------------------------------------- the rule

def test_a_steady_phase_uses_the_fixed_limits_until_warmed_up_then_the_floor():
    rec = None
    for gap in (0.1, 0.2):
        rec = observe(rec, "train", gap)
    assert (phase_limit("train", rec, LEARN).hard, phase_limit("train", rec, LEARN).learned) \
        == (180, False)
    rec = observe(rec, "train", 0.1)
    limit = phase_limit("train", rec, LEARN)
    assert (limit.soft, limit.hard, limit.learned) == (5, 10, True)
    assert limit.source(LEARN) == "learned train: agent.hang_learn_floor 10s"


def test_the_learned_timeout_is_factor_times_the_longest_gap_and_only_grows():
    rec = None
    for gap in (1.0, 4.0, 3.0):
        rec = observe(rec, "train", gap)
    assert rec == PhaseRecord("train", 3, 4.0)
    limit = phase_limit("train", rec, LEARN)
    assert (limit.hard, limit.soft) == (20.0, 10.0)
    assert limit.source(LEARN) == "learned train: 5 x longest gap 4.0s = 20.0s"
    rec = observe(rec, "train", 0.5)
    assert phase_limit("train", rec, LEARN).hard == 20.0


def test_the_fixed_timeouts_stay_the_upper_bound():
    rec = observe(observe(observe(None, "train", 1), "train", 1), "train", 50)
    limit = phase_limit("train", rec, LEARN)
    assert (limit.soft, limit.hard, limit.learned) == (60, 180, False)
    assert limit.source(LEARN) == "agent.hang_hard_timeout 180s"
    # A fixed soft below the learned fraction bounds the dump too.
    low = LearnSettings(10, 5, 1, 0.5, HangLimits(soft=2, hard=180, first_step=600))
    assert phase_limit("train", observe(None, "train", 1), low).soft == 2


def test_a_bracketed_phase_gets_the_fixed_bound_first_then_learns_from_one_run():
    assert phase_limit("checkpoint", None, LEARN).hard == 180
    assert phase_limit("section:data", None, LEARN).hard == 180
    assert phase_limit("barrier", None, LEARN).hard == 180
    rec = observe(None, "checkpoint", 21.0)
    limit = phase_limit("checkpoint", rec, LEARN)
    assert (limit.hard, limit.learned) == (105.0, True)
    assert phase_limit("section:data", observe(None, "section:data", 1.0), LEARN).hard == 10


def test_phase_records_round_trip_and_refuse_garbage():
    rec = PhaseRecord("section:data", 4, 20.5)
    assert PhaseRecord.from_dict(rec.to_dict()) == rec
    table = limits_table({"train": observe(None, "train", 1.0)}, LEARN)
    assert PhaseRecord.from_dict(table[0].to_dict()) == PhaseRecord("train", 1, 1.0)
    for bad in ({}, {"phase": "x", "gaps": -1, "longest": 1}, {"phase": "", "gaps": 1,
                "longest": 1}, {"phase": "x", "gaps": 1, "longest": "nan?"}, None, "x"):
        assert PhaseRecord.from_dict(bad) is None


def test_limits_file_holds_learned_phases_only_and_reading_refuses_garbage(tmp_path):
    recs = {"train": PhaseRecord("train", 5, 1.0), "checkpoint": PhaseRecord("checkpoint", 0, 0)}
    data = encode_limits(limits_table(recs, LEARN))
    assert decode_limits(data) == {"train": (5.0, 10.0)}
    for bad in (b"", b"{", b'{"version": 2, "phases": {"train": [1, 2]}}',
                b'{"version": 1, "phases": {"train": [3, 2]}}', b'{"version": 1, "phases": 7}',
                b"\xff\xfe"):
        assert decode_limits(bad) == {}
    path = tmp_path / "hang-limits.json"
    write_limits_file(str(path), data)
    assert read_limits_file(str(path)) == {"train": (5.0, 10.0)}
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == ["hang-limits.json"]  # no temp left
    # A link planted where the file goes is replaced, never followed.
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path.unlink()
    path.symlink_to(victim)
    assert read_limits_file(str(path)) == {}
    write_limits_file(str(path), data)
    assert victim.read_text() == "keep" and not path.is_symlink()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_limits_file(str(fifo)) == {}  # never blocks on a FIFO


# ---------------------------------------------------------------- the beat record

def test_beat_records_round_trip_at_a_fixed_size():
    data = contract.format_record(1234, "section:data", 17, 5_000)
    assert len(data) == contract.RECORD_BYTES and data.endswith(b"\n")
    assert BeatRecord.parse(data) == BeatRecord(1234, "section:data", 17, 5000)
    assert BeatRecord.parse(b"77\n") == BeatRecord(77, "train", 0, 0)  # an old record
    assert BeatRecord.parse(contract.format_record(9, "exiting", 3, 1)).exiting


@pytest.mark.parametrize("data", [
    b"", b"   ", b"abc train 1 1", b"12 train -1 1", b"12 nosuchphase 1 1",
    b"12 section: 1 1", b"12 section:a/b 1 1", b"12 section:" + b"x" * 33 + b" 1 1",
    b"0 train 1 1", b"1 train 1 1 1", b"1 train " + b"9" * 30 + b" 1", b"\xff\xfe",
    "١٢ train 1 1".encode()])
def test_beat_records_written_by_an_untrusted_worker_are_checked(data):
    assert BeatRecord.parse(data) is None


def test_section_names_are_cleaned_to_what_the_contract_allows():
    assert contract.section_phase("data") == "section:data"
    assert contract.section_phase("a b/c") == "section:a_b_c"
    assert contract.section_phase("") == "section:unnamed"
    assert len(contract.section_phase("x" * 100)) == len("section:") + contract.NAME_MAX
    assert contract.valid_phase(contract.section_phase("ü" * 5))


# ---------------------------------------------------------------- stragglers

def test_the_slowest_rank_is_named_against_the_lower_median():
    s = find_straggler({0: 0.05, 1: 0.15})
    assert (s.rank, round(s.ratio, 6), s.ranks) == (1, 3.0, 2)
    s = find_straggler({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.4})
    assert (s.rank, round(s.ratio, 6)) == (3, 4.0)
    assert find_straggler({0: 0.1}) is None
    assert find_straggler({0: 0.1, 1: None}) is None
    assert Straggler.from_dict(s.to_dict()).rank == 3


def test_rank_samples_need_enough_steps_and_restart_with_a_new_process():
    r = RankSamples()
    r.add(0.0, 1, 0)
    r.add(1.0, 4, 300_000)
    assert r.step_seconds() is None  # 3 steps: too few
    r.add(2.0, 11, 1_000_000)
    assert r.step_seconds() == pytest.approx(0.1)
    r.add(3.0, 2, 100)  # counters went back: a new process
    assert r.step_seconds() is None


def test_a_straggler_event_when_the_ratio_crosses_the_threshold():
    fast, slow = Straggler(1, 1.2, 0.12, 0.1, 2), Straggler(1, 3.0, 0.3, 0.1, 2)
    assert crossed(None, slow, 2.0) == "above"
    assert crossed(slow, slow, 2.0) is None
    assert crossed(slow, Straggler(0, 3.0, 0.3, 0.1, 2), 2.0) == "above"  # another rank
    assert crossed(slow, fast, 2.0) == "below"
    assert crossed(None, fast, 2.0) is None


# ---------------------------------------------------------------- the tracker learns

def tracker(seed=(), **overrides):
    settings = config.AgentSettings(**{"hang_soft_timeout": 60.0, "hang_hard_timeout": 180.0,
                                       "first_step_timeout": 600.0, "hang_learn_warmup": 3,
                                       "hang_learn_persist_interval": 0.0, **overrides})
    ops, reg = FakeOps(), FakeRegistry()
    return ProgressTracker("j1", settings, reg, "n1", ops=ops, seed=list(seed)), ops, reg


def steady(tr, ops, group, t0, t1, dt=0.1, phase="train", ranks=(0,)):
    t = t0
    while t < t1 - 1e-9:
        t = round(t + dt, 6)
        for r in ranks:
            beat(ops, r, t, phase=phase)
        tr.check(group)
    return t


def test_a_warmed_up_job_is_killed_at_the_learned_timeout_not_the_fixed_one():
    tr, ops, reg = tracker()
    group = FakeGroup([100])
    ops.catching = {100}
    tr.check(group)
    t = steady(tr, ops, group, 0.0, 2.0)
    assert [p.hard for p in tr.learned()] == [10.0]
    ops.now = t + 5.0
    assert tr.check(group) == ["rank 0: no progress for 5s; stacks dumped to its log (pid 100)"]
    ops.now = t + 10.0
    assert tr.check(group) == ["rank 0: no progress for 10s; killed (learned train: "
                               "agent.hang_learn_floor 10s)"]
    assert ops.sent[-1] == ("killpg", 100, signal.SIGKILL)


def test_a_job_across_nodes_keeps_the_fixed_timeouts():
    # Its ranks here may wait in a collective for a peer elsewhere that is in a
    # checkpoint, which this node cannot see: the learned 10 s would kill them.
    tr, ops, reg = tracker()
    group = FakeGroup([100], world_size=2)
    ops.catching = {100}
    tr.check(group)
    t = steady(tr, ops, group, 0.0, 2.0)
    assert [p.learned for p in tr.learned()] == [False]
    ops.now = t + 10.0
    assert not [s for s in tr.check(group) if "killed" in s]
    ops.now = t + 60.0
    assert tr.check(group) == ["rank 0: no progress for 60s; stacks dumped to its log (pid 100)"]
    ops.now = t + 180.0
    done = tr.check(group)
    assert done and done[-1].endswith("killed (agent.hang_hard_timeout 180s)"), done


def test_a_first_long_checkpoint_gets_the_fixed_bound_and_the_next_the_learned_one():
    tr, ops, reg = tracker()
    group = FakeGroup([100])
    ops.catching = {100}
    tr.check(group)
    t = steady(tr, ops, group, 0.0, 2.0)
    beat(ops, 0, t + 0.05, phase="checkpoint", steps=0)  # entering torch.save
    tr.check(group)
    ops.now = t + 20.0
    assert tr.check(group) == []  # past the learned train 10 s: the checkpoint is not known yet
    t = steady(tr, ops, group, t + 20.0, t + 21.0)  # it left: one 19.95 s checkpoint gap
    table = {p.phase: p for p in tr.learned()}
    assert (table["checkpoint"].learned, table["checkpoint"].hard) == (True, 100.25)
    beat(ops, 0, t + 0.05, phase="checkpoint", steps=0)  # the next one hangs
    tr.check(group)
    ops.now = t + 60.0
    assert tr.check(group) == ["rank 0: no progress for 60s in phase checkpoint; stacks dumped "
                               "to its log (pid 100)"]
    ops.now = t + 100.0
    assert tr.check(group) == []
    ops.now = t + 101.0
    assert tr.check(group) == ["rank 0: no progress for 101s in phase checkpoint; killed "
                               "(learned checkpoint: 5 x longest gap 20.1s = 100.2s)"]


def test_what_was_learned_goes_to_the_record_and_the_limits_file_and_seeds_the_next_life():
    tr, ops, reg = tracker()
    group = FakeGroup([100])
    tr.check(group)
    t = steady(tr, ops, group, 0.0, 1.0)
    beat(ops, 0, t + 0.1, phase="section:data", steps=0)
    tr.check(group)
    steady(tr, ops, group, t + 20.1, t + 21.0)
    saved = reg.records[-1]["hang_timeouts"]
    assert {p["phase"]: (p["learned"], p["hard"]) for p in saved} == {
        "section:data": (True, 100.5), "train": (True, 10.0)}
    assert ops.limits["/run/j/hang-limits.json"] == {
        "version": 1, "phases": {"section:data": [50.25, 100.5], "train": [5.0, 10.0]}}
    # A daemon restart: the new tracker starts from the record, the job already watched.
    again, ops2, _ = tracker(seed=saved)
    assert {p.phase: p.hard for p in again.learned()} == {"section:data": 100.5, "train": 10.0}


def test_gaps_before_the_first_step_are_not_learned_and_have_the_first_step_allowance():
    tr, ops, reg = tracker()
    group = FakeGroup([100])
    tr.check(group)
    beat(ops, 0, 0.1, phase="forward", steps=0)  # a forward pass before any step
    tr.check(group)
    ops.now = 400.0
    assert tr.check(group) == []
    beat(ops, 0, 400.0)  # its first step
    tr.check(group)
    assert tr.learned() == []


def test_stragglers_are_named_recorded_and_announced_once():
    tr, ops, reg = tracker()
    group = FakeGroup([100, 101])
    tr.check(group)
    t = 0.0
    for _ in range(40):
        t = round(t + 0.3, 6)
        beat(ops, 0, t, busy=0.05, steps=2)
        beat(ops, 1, t, busy=0.15, steps=2)
        tr.check(group)
    s = tr.straggler()
    assert (s.rank, round(s.ratio, 3)) == (1, 3.0)
    events = [e for e in reg.events if e[0] == "straggler"]
    assert len(events) == 1 and events[0][1] == 1
    assert events[0][2].startswith("rank 1 is a straggler: 3.0x the median rank's work per step")
    assert reg.records[-1]["straggler"]["rank"] == 1
    assert reg.records[-1]["straggler"]["node_id"] == "n1"


# ---------------------------------------------------------------- the worker side, real torch

WORKER = textwrap.dedent("""
    import os, time, torch
    from elasticd_heartbeat import elasticd_section
    path = os.environ["ELASTICD_HEARTBEAT_FILE"]
    def record():
        return open(path).read().split()
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.ones(2)).sum().backward(); opt.step()
    print("step", record()[1:3])
    time.sleep(0.3)
    with torch.no_grad():
        m(torch.ones(2))
    print("eval", record()[1:3])
    class Slow:
        def __reduce__(self):
            print("inside", record()[1], flush=True)
            return (int, (1,))
    torch.save({"x": Slow()}, os.environ["CKPT"])
    print("after save", record()[1])
    with elasticd_section("data"):
        print("section", record()[1])
    print("after section", record()[1])
    torch.load(os.environ["CKPT"], weights_only=False)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    print("dcp wrapped", getattr(dcp.save, "__elasticd_phase__", ""),
          getattr(dcp.load, "__elasticd_phase__", ""))
    print("barrier wrapped", getattr(dist.barrier, "__elasticd_phase__", ""))
""")


def test_the_worker_site_beats_on_forward_passes_checkpoints_and_sections(tmp_path):
    hb = tmp_path / "hb"
    env = dict(os.environ, PYTHONPATH=WORKER_SITE, CKPT=str(tmp_path / "ckpt"),
               **{HEARTBEAT_ENV: str(hb)})
    out = subprocess.run([PY, "-c", WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "step ['train', '1']", "eval ['forward', '1']", "inside checkpoint", "after save forward",
        "section section:data", "after section forward", "dcp wrapped checkpoint checkpoint",
        "barrier wrapped barrier"]
    assert hb.read_text().split()[1] == "exiting"


def test_peers_waiting_for_a_checkpoint_keep_its_allowance_until_they_beat_again():
    tr, ops, reg = tracker()
    group = FakeGroup([100, 101])
    ops.catching = {100, 101}
    tr.check(group)
    t = steady(tr, ops, group, 0.0, 2.0, ranks=(0, 1))
    beat(ops, 0, t + 0.05, phase="checkpoint", steps=0)  # rank 0 saves, rank 1 waits
    tr.check(group)
    ops.now = t + 20.0
    assert tr.check(group) == []  # rank 1 silent 20 s in train: its peer is in a checkpoint
    beat(ops, 0, t + 20.05)  # rank 0 left it; rank 1's collective has not returned yet
    assert tr.check(group) == []
    beat(ops, 1, t + 20.1)
    beat(ops, 0, t + 20.1)
    tr.check(group)
    table = {p.phase: p for p in tr.learned()}
    assert table["train"].longest < 1  # rank 1's wait was not learned as a training gap
    steady(tr, ops, group, t + 20.1, t + 25.3)  # later, rank 1 silent on its own
    assert [e[2] for e in reg.events] == ["rank 1: no progress for 5s; stacks dumped to its "
                                          "log (pid 101)"]


def test_a_rank_that_waited_for_an_inprocess_restart_has_the_first_step_allowance_again():
    tr, ops, reg = tracker()
    group = FakeGroup([100])
    ops.catching = {100}
    tr.check(group)
    t = steady(tr, ops, group, 0.0, 2.0)
    beat(ops, 0, t + 0.1, phase="wait", steps=0)  # at the restart barrier
    tr.check(group)
    beat(ops, 0, t + 0.2, phase="train", steps=0)  # back in the function, no step yet
    tr.check(group)
    ops.now = t + 60.0
    assert tr.check(group) == []  # building the new process group: not the 10 s limit
    beat(ops, 0, t + 60.1)  # its first step
    tr.check(group)
    assert {p.phase for p in tr.learned()} == {"train"}
    assert max(p.longest for p in tr.learned()) < 1


CHILDREN = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time
    import torch

    def child(path):
        torch.save({"x": 1}, path)    # would say "checkpoint" for the rank
        torch.nn.Linear(2, 1)(torch.ones(2))

    if __name__ == "__main__":
        hb = os.environ["ELASTICD_HEARTBEAT_FILE"]
        for method in ("fork", "spawn"):
            p = mp.get_context(method).Process(target=child, args=(hb + "." + method,))
            p.start()
            p.join()
            assert p.exitcode == 0, method
        print("exists", os.path.exists(hb))
""")


def test_children_of_a_rank_never_write_its_beats(tmp_path):
    hb = tmp_path / "hb"
    script = tmp_path / "children.py"
    script.write_text(CHILDREN)
    env = dict(os.environ, PYTHONPATH=WORKER_SITE, **{HEARTBEAT_ENV: str(hb)})
    out = subprocess.run([PY, str(script)], env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["exists", "False"]


def test_a_rank_in_a_barrier_has_the_barriers_limits_and_never_widens_its_peers():
    """Ranks on other nodes waiting in dist.barrier for rank 0's checkpoint: the
    barrier's first wait gets the fixed bound, later ones the learned one; a rank
    silent outside the barrier (the one the others wait for) keeps its own limits."""
    tr, ops, reg = tracker()
    group = FakeGroup([100, 101])
    ops.catching = {100, 101}
    tr.check(group)
    t = steady(tr, ops, group, 0.0, 2.0, ranks=(0, 1))
    beat(ops, 0, t + 0.05, phase="barrier", steps=0)
    tr.check(group)
    steady(tr, ops, group, t + 0.05, t + 9.0, ranks=(1,))
    ops.now = t + 30.0  # rank 0 waits in the barrier 30 s: not known yet, fixed bound
    assert all("rank 0" not in e[2] for e in reg.events)
    assert "rank 1: no progress for" in tr.check(group)[0]  # rank 1 silent 21 s: its own 10 s
    assert {p.phase for p in tr.learned() if p.learned} == {"train"}
