"""agent/newcomer.py: when a node about to join a running job asks for ranks (no I/O here;
tests/test_multinode.py runs it on real daemons)."""
from __future__ import annotations

from elasticd.agent.newcomer import NewcomerWarmup, WarmVerdict, judge
from elasticd.workers.group import GroupSpec
from elasticd.workers.round_place import RoundPlace


def test_asks_once_every_rank_has_an_imported_spare():
    assert judge(imported=1, wanted=2, waited=5, timeout=60) is WarmVerdict.WARMING
    assert judge(imported=2, wanted=2, waited=5, timeout=60) is WarmVerdict.WARM


def test_asks_anyway_after_the_timeout():
    assert judge(imported=0, wanted=2, waited=60, timeout=60) is WarmVerdict.TIMED_OUT


def test_asks_at_once_when_a_spare_exited_before_it_was_ready():
    assert judge(imported=1, wanted=2, waited=5, timeout=60, alive=1) is WarmVerdict.GONE


def test_asks_at_once_without_spares_or_with_the_warm_up_off():
    assert judge(imported=0, wanted=0, waited=0, timeout=60) is WarmVerdict.NOTHING
    assert judge(imported=0, wanted=2, waited=0, timeout=0) is WarmVerdict.NOTHING


class FakeSpares:
    """The part of SparePool the warm-up uses; ``imported`` is set by the test."""

    def __init__(self):
        self.filled = 0
        self.alive = 0
        self.done = 0

    def fill(self, spec, preload, nice):
        self.filled += 1
        self.alive = spec.nproc
        return spec.nproc

    def ready(self):
        return self.alive

    def imported(self):
        return self.done


def spec(tmp_path, command=("python", "-m", "train")):
    return GroupSpec(job_id="j1", command=tuple(command), cwd=str(tmp_path), env={},
                     uid=0, gid=0, nproc=2, restart_count=0, max_restarts=-1,
                     place=RoundPlace(round=3, group_rank=1, group_world_size=2, world_size=4,
                                      rank_offset=2, master_addr="", master_port=0),
                     log_dir=str(tmp_path / "logs"),
                     run_dir=str(tmp_path / "run"), node_id="n2")


def test_warm_up_starts_spares_once_then_asks_when_they_imported(tmp_path):
    now = [100.0]
    spares = FakeSpares()
    w = NewcomerWarmup(spares, timeout=60, preload=[], nice=0, clock=lambda: now[0])
    check, first = w.check(lambda: spec(tmp_path))
    assert (check.verdict, first, spares.filled) == (WarmVerdict.WARMING, False, 1)
    now[0] += 4
    spares.done = 2
    check, first = w.check(lambda: spec(tmp_path))
    assert (check.verdict, first, spares.filled) == (WarmVerdict.WARM, True, 1)
    assert check.sentence() == "warm spares ready after 4.0s; asking to join"
    check, first = w.check(lambda: spec(tmp_path))  # asked: keeps asking, said once
    assert (check.ask, first) == (True, False)
    w.reset()
    spares.done = 0
    check, _ = w.check(lambda: spec(tmp_path))
    assert check.verdict is WarmVerdict.WARMING and spares.filled == 2


def test_a_command_no_spare_can_run_asks_at_once(tmp_path):
    spares = FakeSpares()
    w = NewcomerWarmup(spares, timeout=60, preload=[], nice=0)
    check, _ = w.check(lambda: spec(tmp_path, ("/bin/sh", "-c", "true")))
    assert check.verdict is WarmVerdict.NOTHING and spares.filled == 0
