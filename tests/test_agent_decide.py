"""The agent's pure parts: what to do after a look at the workers, how long to
wait before a restart, and what a worker's torch ``@record`` error file says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from elasticd.agent.decide import Action, Snapshot, decide
from elasticd.jobs.restartpolicy import restart_delay
from elasticd.agent.failures import read_error_file
from elasticd.jobs.ladder import Layer
from elasticd.rendezvous.protocol import RoundCause
from elasticd.rendezvous.status import CURRENT, RoundStatus, StatusKind


def act(returncodes, restarts=0, max_restarts=3, cancel=False, stopping=False):
    return decide(Snapshot(tuple(returncodes), restarts, max_restarts, cancel, stopping))


# ---------------------------------------------------------------- decide()

def test_workers_still_running_continue():
    assert act([None, None]).action is Action.CONTINUE


def test_some_done_some_running_continue():
    assert act([0, None, 0]).action is Action.CONTINUE


def test_every_worker_exited_zero_succeeds():
    d = act([0, 0, 0, 0])
    assert d.action is Action.SUCCEED
    assert d.reason


def test_one_failed_worker_with_restarts_left_restarts():
    d = act([None, 1], restarts=0, max_restarts=3)
    assert d.action is Action.RESTART
    assert "restart 1 of 3" in d.reason


def test_failure_restarts_even_when_the_others_succeeded():
    assert act([0, 0, 2], restarts=1, max_restarts=3).action is Action.RESTART


def test_worker_killed_by_a_signal_is_a_failure():
    assert act([-9, None]).action is Action.RESTART
    assert act([-15, 0], restarts=3, max_restarts=3).action is Action.FAIL


def test_last_restart_is_still_a_restart():
    d = act([1, None], restarts=2, max_restarts=3)
    assert d.action is Action.RESTART
    assert "restart 3 of 3" in d.reason


def test_failure_with_no_restarts_left_fails():
    d = act([1, None], restarts=3, max_restarts=3)
    assert d.action is Action.FAIL
    assert "no restarts left" in d.reason and "3 of 3" in d.reason


def test_max_restarts_zero_fails_on_the_first_failure():
    assert act([None, 1], restarts=0, max_restarts=0).action is Action.FAIL


def test_cancel_wins_over_running_failed_and_finished_workers():
    for rcs in ([None, None], [1, None], [0, 0], [-9, -9]):
        d = act(rcs, cancel=True)
        assert d.action is Action.CANCEL, rcs
        assert "cancel" in d.reason


def test_cancel_wins_over_daemon_shutdown():
    assert act([None], cancel=True, stopping=True).action is Action.CANCEL


def test_daemon_shutdown_suspends_instead_of_counting_a_failure():
    for rcs in ([None, None], [1, None], [0, 0]):
        d = act(rcs, restarts=3, max_restarts=3, stopping=True)
        assert d.action is Action.SUSPEND, rcs
        assert "resume" in d.reason


@pytest.mark.parametrize("returncodes,restarts,max_restarts,expected", [
    ([None], 0, 0, Action.CONTINUE),
    ([0], 0, 0, Action.SUCCEED),
    ([1], 0, 0, Action.FAIL),
    ([1], 0, 1, Action.RESTART),
    ([0, 0, 0, 0, 0, 0, 0, 137], 5, 6, Action.RESTART),
    ([0, 0, 0, 0, 0, 0, 0, 137], 6, 6, Action.FAIL),
    ([255, 255], 99_999, 100_000, Action.RESTART),
])
def test_decision_table(returncodes, restarts, max_restarts, expected):
    assert act(returncodes, restarts, max_restarts).action is expected


# ---------------------------------------------------------------- decide(): the round

def on_round(status, returncodes=(None, None), **rest):
    return decide(Snapshot(tuple(returncodes), round_status=status, **rest))


FINAL = RoundStatus(StatusKind.FINAL, "rank 3 on n2 exited 1; no restarts left")
SUPERSEDED = RoundStatus(StatusKind.SUPERSEDED, "rank 0 exited 1; round 3 opened",
                         cause=RoundCause.FAULT)
LOST = RoundStatus(StatusKind.LOST, "node(s) n2 lost", nodes=("n2",),
                   cause=RoundCause.NODE_LOST)
WAITING = RoundStatus(StatusKind.WAITING, "node(s) n3 waiting to join", nodes=("n3",),
                      cause=RoundCause.NODE_WAITING)


def test_a_round_ended_cluster_wide_is_final_with_its_reason():
    for rcs in ([None, None], [1, None], [0, 0]):
        d = on_round(FINAL, rcs)
        assert (d.action, d.reason) == (Action.FINAL, FINAL.why), rcs


def test_cancel_and_shutdown_come_before_the_clusters_word():
    assert on_round(FINAL, cancel_requested=True).action is Action.CANCEL
    assert on_round(SUPERSEDED, shutting_down=True).action is Action.SUSPEND


def test_a_new_round_a_peer_opened_is_rejoined_even_over_a_local_failure():
    for rcs in ([None, None], [1, None], [0, 0]):
        d = on_round(SUPERSEDED, rcs, restarts=3, max_restarts=3)
        assert (d.action, d.reason, d.layer) == (Action.REJOIN, SUPERSEDED.why, Layer.PROCESS)


def test_a_new_round_for_a_change_of_nodes_is_a_rendezvous_climb():
    moved = RoundStatus(StatusKind.SUPERSEDED, "node(s) n2 lost; round 3 opened",
                        cause=RoundCause.NODE_LOST)
    assert on_round(moved).layer is Layer.RENDEZVOUS


def test_a_lost_member_opens_a_new_round_before_a_local_failure_counts():
    d = on_round(LOST, [1, None], restarts=3, max_restarts=3)
    assert (d.action, d.reason, d.layer) == (Action.NODE_LOST, LOST.why, Layer.RENDEZVOUS)


def test_nodes_waiting_scale_up_only_while_the_workers_run_well():
    d = on_round(WAITING)
    assert (d.action, d.reason) == (Action.SCALE_UP, WAITING.why)
    assert on_round(WAITING, [1, None]).action is Action.RESTART   # a fault comes first
    assert on_round(WAITING, [0, 0]).action is Action.SUCCEED


def test_workers_done_wait_for_the_other_nodes_before_success():
    d = decide(Snapshot((0, 0), peers_done=False))
    assert d.action is Action.CONTINUE and "waiting for the other nodes" in d.reason
    assert decide(Snapshot((0, 0), peers_done=True)).action is Action.SUCCEED
    assert decide(Snapshot((0, None), peers_done=False)).action is Action.CONTINUE


def test_the_round_standing_leaves_the_decision_to_the_workers():
    assert on_round(CURRENT).action is Action.CONTINUE
    assert on_round(CURRENT, [1, None]).action is Action.RESTART


def test_no_lifetime_limit_always_restarts():
    d = decide(Snapshot((1,), restarts=500, max_restarts=-1))
    assert d.action is Action.RESTART and "no lifetime limit" in d.reason


# ---------------------------------------------------------------- restart_delay()

def test_first_restart_waits_the_initial_delay():
    assert restart_delay(1, 0.0, 0.5, 30.0) == 0.0
    assert restart_delay(1, 2.0, 0.5, 30.0) == 2.0


def test_first_restart_wait_is_capped_by_the_maximum():
    assert restart_delay(1, 10.0, 0.5, 3.0) == 3.0


def test_later_restarts_add_a_doubling_step():
    assert [restart_delay(n, 1.0, 0.5, 100.0) for n in (2, 3, 4, 5)] == [1.5, 2.0, 3.0, 5.0]


def test_restart_wait_never_exceeds_the_maximum_and_never_shrinks():
    waits = [restart_delay(n, 0.0, 0.5, 30.0) for n in range(1, 60)]
    assert max(waits) == 30.0
    assert waits == sorted(waits)


def test_zero_step_means_always_the_initial_delay():
    assert {restart_delay(n, 0.25, 0.0, 30.0) for n in range(1, 50)} == {0.25}


def test_restart_wait_after_very_many_restarts_is_the_maximum():
    assert restart_delay(1100, 0.0, 0.5, 30.0) == 30.0
    assert restart_delay(100_000, 1.0, 0.0, 30.0) == 1.0


# ---------------------------------------------------------------- read_error_file()

RECORDING_WORKER = textwrap.dedent("""
    from torch.distributed.elastic.multiprocessing.errors import record

    def inner():
        raise ValueError("boom from the worker")

    @record
    def main():
        inner()

    main()
""")


def test_reads_the_error_file_torch_record_writes(tmp_path):
    path = tmp_path / "error.json"
    proc = subprocess.run([sys.executable, "-c", RECORDING_WORKER], capture_output=True, text=True,
                          env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(path)), timeout=120)
    assert proc.returncode == 1, proc.stderr
    message, tb, mtime, _ = read_error_file(str(path))
    assert message == "ValueError: boom from the worker"
    assert tb.startswith("Traceback (most recent call last)")
    assert "in inner" in tb and tb.rstrip().endswith("ValueError: boom from the worker")
    assert mtime == os.stat(path).st_mtime


def _torch_format(message: str, callstack: str) -> dict:
    # The layout torch's ErrorHandler.record_exception writes.
    return {"message": {"message": message,
                        "extraInfo": {"py_callstack": callstack, "timestamp": "1700000000"}}}


def test_missing_error_file_gives_blanks(tmp_path):
    assert read_error_file(str(tmp_path / "nope.json")) == ("", "", 0.0, None)


@pytest.mark.parametrize("content", [b"", b"not json", b"{", b"\xff\xfe\x00garbage", b"[]",
                                     b"null", b"42", b'{"message": null}', b'{"message": 5}',
                                     b'{"message": {"message": "m", "extraInfo": "flat"}}'],
                         ids=["empty", "text", "truncated", "binary", "list", "null", "number",
                              "message-null", "message-number", "extrainfo-string"])
def test_unreadable_or_odd_error_file_never_raises(tmp_path, content):
    path = tmp_path / "error.json"
    path.write_bytes(content)
    message, tb, mtime, _ = read_error_file(str(path))
    assert isinstance(message, str) and isinstance(tb, str) and isinstance(mtime, float)


def test_error_file_that_is_a_directory_gives_blanks(tmp_path):
    message, tb, _, problem = read_error_file(str(tmp_path))
    assert (message, tb) == ("", "") and problem is not None


def test_error_file_with_a_plain_string_message(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "Signal 6 (SIGABRT) received by PID 42"}))
    message, tb, mtime, _ = read_error_file(str(path))
    assert message == "Signal 6 (SIGABRT) received by PID 42"
    assert tb == "" and mtime > 0


def test_long_message_keeps_its_start_and_long_traceback_keeps_its_end(tmp_path):
    path = tmp_path / "error.json"
    callstack = "Traceback (most recent call last):\n" + "  frame\n" * 5000 + "KeyError: 'x'\n"
    path.write_text(json.dumps(_torch_format("RuntimeError: " + "m" * 50_000, callstack)))
    message, tb, _, _ = read_error_file(str(path), limit=1000)
    assert len(message) == 1000 and message.startswith("RuntimeError: ")
    assert len(tb) == 1000 and tb.endswith("KeyError: 'x'\n")


def test_deeply_nested_error_file_gives_blanks(tmp_path):
    path = tmp_path / "error.json"
    path.write_text('{"message": ' + "[" * 100_000 + "]" * 100_000 + "}")
    message, tb, _, _ = read_error_file(str(path))
    assert (message, tb) == ("", "")


def test_no_lifetime_limit_always_restarts_and_leaves_the_window_to_the_round():
    d = act([None, 1], restarts=10_000, max_restarts=-1)
    assert d.action is Action.RESTART and d.reason == "restart 10001 (no lifetime limit)"
