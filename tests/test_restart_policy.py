"""The wait before a restart and the budget over a window, decided without I/O
(jobs/restartpolicy.py; the window as the round state counts it, protocol.reopen)."""
import pytest

from elasticd.config import AgentSettings
from elasticd.rendezvous.protocol import FAILED, OPEN, JobLimits, RoundState, reopen
from elasticd.jobs.restartpolicy import (
    AttemptProgress, BackoffSettings, RestartPlan, RestartRule, RestartWindow, plan_forgotten,
    plan_restart, spares_due, window_text)

S = BackoffSettings(initial=0.0, step=0.5, maximum=30.0, min_beats=2, min_runtime=600.0)


def crash_loop(n: int, s: BackoffSettings = S) -> list[RestartPlan]:
    """n attempts in a row that die at start."""
    plans, streak = [], 0
    for _ in range(n):
        plan = plan_restart(AttemptProgress(beats=0, ran_for=1.0), streak, s)
        plans.append(plan)
        streak = plan.streak
    return plans


def test_an_attempt_that_made_progress_restarts_at_once_and_resets_the_backoff():
    plan = plan_restart(AttemptProgress(beats=212, ran_for=48.0), streak_before=6, s=S)
    assert (plan.rule, plan.delay, plan.streak) == (RestartRule.AT_ONCE, 0.0, 0)
    assert plan.sentence() == "restart at once: 212 progress beats in 48s since the last restart"


def test_attempts_without_progress_back_off_as_before_doubling_up_to_the_max():
    plans = crash_loop(9)
    assert [p.delay for p in plans] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert {p.rule for p in plans} == {RestartRule.BACKOFF}
    assert [p.streak for p in plans] == list(range(1, 10))
    assert plans[4].sentence() == "backing off 4s: no progress in the last 5 attempts"
    assert plans[0].sentence() == "restart at once: no progress in the last attempt"


def test_progress_between_faults_starts_the_backoff_over():
    streak = crash_loop(5)[-1].streak
    good = plan_restart(AttemptProgress(beats=50, ran_for=20.0), streak, S)
    after = plan_restart(AttemptProgress(beats=0, ran_for=2.0), good.streak, S)
    assert good.delay == 0.0 and after.delay == 0.0 and after.streak == 1
    again = plan_restart(AttemptProgress(beats=0, ran_for=2.0), after.streak, S)
    assert again.delay == 0.5


@pytest.mark.parametrize("beats,ran_for,rule", [
    (0, 0.1, RestartRule.BACKOFF),
    (1, 30.0, RestartRule.BACKOFF),         # one beat: the first step, no more
    (2, 0.5, RestartRule.AT_ONCE),          # beats after the first step
    (0, 599.0, RestartRule.BACKOFF),
    (0, 600.0, RestartRule.AT_ONCE),        # a script that never beats but ran long
])
def test_what_counts_as_progress(beats, ran_for, rule):
    assert plan_restart(AttemptProgress(beats, ran_for), 3, S).rule is rule


def test_the_default_settings_read_as_backoff_settings():
    s = BackoffSettings.from_settings(AgentSettings())
    assert (s.initial, s.step, s.maximum, s.min_beats, s.min_runtime) == (0.0, 0.5, 30.0, 2, 600)


def test_a_plan_survives_its_record_form():
    plan = crash_loop(3)[-1]
    assert RestartPlan.from_dict(plan.to_dict()) == plan


def test_spares_come_back_at_the_first_beat_of_a_warm_start():
    # (now, started, first beat, started warm) with warm_spare_delay 3, restart delay 0
    assert spares_due(10.4, 10.0, 10.3, True, 3.0, 0.0)        # trained: refill now
    assert not spares_due(10.4, 10.0, None, True, 3.0, 0.0)    # still starting up
    assert spares_due(13.0, 10.0, None, True, 3.0, 0.0)        # never beats: as at first start
    assert not spares_due(10.4, 10.0, 10.3, False, 3.0, 0.0)   # cold start: its own imports
    assert spares_due(13.0, 10.0, 10.3, False, 3.0, 0.0)
    assert not spares_due(10.4, 10.0, 10.3, True, 3.0, 0.5)    # a delay after the beat
    assert spares_due(10.8, 10.0, 10.3, True, 3.0, 0.5)


# ---------------------------------------------------------------- the window

def test_window_admits_up_to_its_limit_then_refuses():
    w = RestartWindow(limit=3, seconds=60.0)
    times = ()
    for t in (0.0, 10.0, 20.0):
        fits, times = w.admit(times, t)
        assert fits
    fits, after = w.admit(times, 30.0)
    assert not fits and len(after) == 4


def test_window_forgets_restarts_older_than_the_window():
    w = RestartWindow(limit=2, seconds=60.0)
    fits, times = w.admit((0.0, 30.0), 61.0)
    assert fits and times == (30.0, 61.0)


def test_window_keeps_a_bounded_number_of_times():
    w = RestartWindow(limit=2, seconds=1e9)
    assert len(w.recent(tuple(float(t) for t in range(1000)), 1000.0)) == 3


def test_no_window_budget_admits_everything_and_keeps_nothing():
    w = RestartWindow(limit=-1, seconds=60.0)
    assert w.admit((1.0,) * 50, 2.0) == (True, ())
    assert w.describe(0) == "no budget over a window"


@pytest.mark.parametrize("seconds,text", [(3600, "hour"), (7200, "2 hours"), (600, "10 min"),
                                          (60, "1 min"), (86400, "day"), (45, "45 s"),
                                          (1.5, "1.5 s")])
def test_window_in_words(seconds, text):
    assert window_text(seconds) == text


LIMITS = JobLimits(min_nodes=1, max_nodes=1, max_restarts=-1, last_call=0.0, join_timeout=30.0,
                   max_restarts_in_window=3, restart_window=100.0)


def _faults(times, limits=LIMITS):
    state = RoundState(round=1, status="closed")
    for t in times:
        state, why = reopen(state, "rank 0 exited 1", True, limits, t)
        if state.status == FAILED:
            return state, why
        state = RoundState(round=state.round, status="closed", restarts=state.restarts,
                           restart_times=state.restart_times)
    return state, why


def test_reopen_fails_a_job_failing_continuously_once_the_window_is_spent():
    state, why = _faults([1.0, 2.0, 3.0, 4.0])
    assert state.status == FAILED
    assert why == ("rank 0 exited 1; no restarts left in the window "
                   "(3 in the last 100 s of 3 allowed)")


def test_reopen_keeps_a_job_failing_now_and_then_alive_without_a_lifetime_limit():
    state, why = _faults([60.0 * k for k in range(1, 40)])   # one fault a minute, 39 in all
    assert state.status != FAILED and state.restarts == 39
    assert len(state.restart_times) == 2
    assert "restart 39 of unlimited; 2 in the last 100 s of 3 allowed" in why


def test_reopen_still_honours_the_lifetime_budget():
    limits = JobLimits(min_nodes=1, max_nodes=1, max_restarts=2, last_call=0.0,
                       join_timeout=30.0, max_restarts_in_window=10, restart_window=100.0)
    state, why = _faults([1000.0 * k for k in range(1, 5)], limits)
    assert state.status == FAILED and "no restarts left (2 of 2 used)" in why


def test_a_round_state_carries_its_window_through_json():
    state = RoundState(round=3, status=OPEN, restarts=5, restart_times=(1.5, 2.5))
    assert RoundState.from_json(state.to_json()) == state
    old = '{"round": 2, "status": "open", "restarts": 1}'   # written before the window
    assert RoundState.from_json(old).restart_times == ()


# ---------------------------------------------------------------- cluster-wide

def test_the_window_is_counted_cluster_wide_whichever_node_restarts(tmp_path):
    """Two nodes' rendezvous on one store: each one's faults land in the same round
    state, so the budget over the window is the job's, not a node's."""
    import time
    from dataclasses import replace

    from elasticd.rendezvous.round import ClusterRendezvous, create_job
    from elasticd.rendezvous.protocol import CLOSED, Member, Result
    from elasticd.rendezvous.view import JobsView
    from elasticd.store import MemoryStore
    from elasticd.trust.sealed import PLAIN
    from elasticd.workers.round_place import RoundPlace

    store = MemoryStore()
    view = JobsView(store, records=PLAIN, retry=0.2)
    view.start()
    limits = JobLimits(min_nodes=2, max_nodes=2, max_restarts=-1, last_call=0.0,
                       join_timeout=30.0, max_restarts_in_window=2, restart_window=3600.0)
    key = "/v1/rounds/w1/state"
    try:
        create_job(store, "w1", {"id": "w1", "nodes": []}, time.time(), records=PLAIN)
        nodes = {n: ClusterRendezvous(store, view, "w1", n, "127.0.0.1", 1, lambda: None,
                                      limits) for n in ("n1", "n2")}

        def closed_round() -> Result:
            """What the round's decider does: close the open round with both nodes."""
            kv = store.get(key)
            state = RoundState.from_json(kv.value)
            members = (Member("n1", "127.0.0.1", 1, 1), Member("n2", "127.0.0.1", 1, 2))
            rev = store.compare_and_swap(key, replace(state, status=CLOSED,
                                                      members=members).to_json(), kv.revision)
            deadline = time.monotonic() + 10
            while not view.reached(key, rev) and time.monotonic() < deadline:
                view.wait(0.1)
            return Result(RoundPlace(round=state.round, group_rank=0, group_world_size=2,
                                     world_size=2, rank_offset=0, master_addr="127.0.0.1",
                                     master_port=1))

        first = nodes["n1"].reopen(closed_round(), "rank 0 exited 1", True)
        second = nodes["n2"].reopen(closed_round(), "rank 1 exited 1", True)
        assert (first.status, len(first.restart_times)) == (OPEN, 1)
        assert (second.status, second.restarts, len(second.restart_times)) == (OPEN, 2, 2)
        third = nodes["n1"].reopen(closed_round(), "rank 0 exited 1", True)
        assert third.status == FAILED
        assert third.reason.endswith("no restarts left in the window "
                                     "(2 in the last hour of 2 allowed)")
    finally:
        view.stop()


def test_a_forgotten_job_starts_again_as_a_counted_restart_while_its_budgets_allow():
    hour = RestartWindow(2, 3600.0)
    never_started = plan_forgotten(False, 3, 3, hour, [900.0, 950.0], 1000.0)
    assert (never_started.fits, never_started.counted, never_started.restarts,
            never_started.times) == (True, False, 3, (900.0, 950.0))
    again = plan_forgotten(True, 1, 3, hour, [900.0], 1000.0)
    assert (again.fits, again.restarts, again.times) == (True, 2, (900.0, 1000.0))
    spent = plan_forgotten(True, 3, 3, hour, [], 1000.0)
    assert not spent.fits and spent.reason == \
        "daemon restarted and no restarts are left (3 of 3 used)"
    full = plan_forgotten(True, 2, -1, hour, [900.0, 950.0], 1000.0)
    assert not full.fits and full.reason == ("daemon restarted and no restarts are left in "
                                             "the window (2 in the last hour of 2 allowed)")
