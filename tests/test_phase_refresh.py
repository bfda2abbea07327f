"""The phase publisher (hangs/phase_board.py) writes what the other nodes decide on when it
changes, and an unchanged record only every refresh interval: a steady job's phase records
cost etcd (and every watching node) a write per refresh, not per second."""
from __future__ import annotations

import threading

from elasticd.config import Config
from elasticd.hangs.phase_board import NodePhases, PhasePublisher, RankPhase
from elasticd.hangs.timeouts import PhaseRecord


def rec(steps=10, step_s=0.1, phase="train", longest=0.12, gaps=40, rnd=2):
    return NodePhases("n1", rnd, (RankPhase(0, phase, steps / 10, steps, step_s),),
                      (PhaseRecord("train", gaps, longest),))


def test_a_record_moved_only_where_peers_decide_on_it_and_not_by_a_wavering_value():
    base = rec()
    assert rec().moved_from(None)
    assert not rec(steps=500, gaps=63).moved_from(base)           # step counts, a few gaps
    assert not rec(step_s=0.115, longest=0.13).moved_from(base)   # under a fifth / a tenth
    # Measured from what was written: wavering about a point never adds up to a move.
    assert not rec(step_s=0.085).moved_from(base) and not rec(step_s=0.115).moved_from(base)
    for moved in (rec(phase="checkpoint"), rec(rnd=3), rec(step_s=0.12), rec(longest=0.14),
                  rec(gaps=64), rec(step_s=None)):
        assert moved.moved_from(base), moved


class Writes:
    def __init__(self, fail_first=False):
        self.records, self.fail, self.event = [], fail_first, threading.Event()

    def put(self, text):
        if self.fail:
            self.fail = False
            raise OSError("etcd away")
        self.records.append(NodePhases.from_json(text, "n1"))
        self.event.set()

    def next(self, timeout=10.0) -> bool:
        got = self.event.wait(timeout)
        self.event.clear()
        return got


def test_an_unchanged_record_waits_for_the_refresh_a_change_peers_decide_on_does_not():
    w = Writes()
    pub = PhasePublisher("j1", "n1", 0.05, w.put, lambda: None, refresh=60.0)
    pub.start()
    try:
        pub.offer(rec())
        assert w.next(), "the first record is written at once"
        for steps in range(11, 30):   # training goes on: nothing peers decide on moves
            pub.offer(rec(steps=steps))
        assert not w.next(0.5), "an unchanged record waits for the refresh (60 s)"
        pub.offer(rec(steps=40, step_s=0.3))   # this node's ranks slowed 3x: stragglers
        assert w.next(), "a change of step time is written within the publish interval"
        assert w.records[-1].ranks[0].step_seconds == 0.3
        pub.offer(rec(steps=41, step_s=0.3, phase="checkpoint"))
        assert w.next() and w.records[-1].ranks[0].phase == "checkpoint"
        assert pub.writes == 3
    finally:
        pub.stop()


def test_an_unchanged_record_is_written_again_every_refresh_and_a_failed_write_retried():
    w = Writes(fail_first=True)
    pub = PhasePublisher("j1", "n1", 0.05, w.put, lambda: None, refresh=0.3)
    pub.start()
    try:
        pub.offer(rec())
        assert w.next(), "the failed first write is tried again within the publish interval"
        assert w.next(), "and the unchanged record is written again at the refresh"
        assert len(w.records) >= 2 and w.records[-1] == rec()
    finally:
        pub.stop()


def test_the_agent_makes_its_publisher_with_both_intervals():
    a = Config().agent
    pub = PhasePublisher.for_agent("j1", "n1", a, lambda text: None, lambda: None)
    assert (pub.interval, pub.refresh) == (a.phase_publish_interval, a.phase_refresh_interval)
    assert a.phase_stale_after > 2 * a.phase_refresh_interval >= 2 * a.phase_publish_interval
