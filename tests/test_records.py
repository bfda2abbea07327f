"""The typed failure record: one JSON form, read back across releases."""
from __future__ import annotations

import json

import pytest

from elasticd.jobs.registry import JobRecord
from elasticd.jobs.ladder import Attempt, Layer, Outcome
from elasticd.jobs.records import CAUSE_LIMIT, TRACEBACK_LIMIT, Failure, FailureKind, WorkerRow
from elasticd.jobs.states import WorkerState


def test_a_failure_round_trips_through_its_json_form():
    f = Failure(rank=1, exit_code=3, signal=0, cause="rank 1 exited with exit code 3",
                traceback="tb", time=12.5, restart=2, node_id="n1", kind=FailureKind.HANG)
    assert Failure.from_dict(json.loads(json.dumps(f.to_dict()))) == f


def test_a_worker_fault_is_written_without_a_kind_as_before():
    d = Failure(rank=0, exit_code=1, cause="c", time=1.0, node_id="n").to_dict()
    assert d == {"rank": 0, "exit_code": 1, "signal": 0, "cause": "c", "traceback": "",
                 "time": 1.0, "restart": 0, "node_id": "n"}


def test_an_older_or_partial_record_reads_with_defaults():
    f = Failure.from_dict({"cause": "old", "kind": "something newer"}, node_id="n2")
    assert (f.rank, f.exit_code, f.cause, f.node_id, f.kind) == \
        (-1, 0, "old", "n2", FailureKind.WORKER)
    assert Failure.from_dict({"kind": "unreadable_error_file"}).kind is \
        FailureKind.UNREADABLE_ERROR_FILE


@pytest.mark.parametrize("bad", [{"time": "soon"}, {"rank": "one"}, {"signal": None}, "garbage"])
def test_a_record_of_the_wrong_shape_raises_for_the_caller_to_skip(bad):
    with pytest.raises((TypeError, ValueError)):
        Failure.from_dict(bad)


def test_bounded_cuts_what_is_shared_and_ints_are_clamped():
    f = Failure.from_dict({"cause": "c" * 10_000, "traceback": "t" * 10_000,
                           "rank": 10**20}).bounded()
    assert len(f.cause) == CAUSE_LIMIT and len(f.traceback) == TRACEBACK_LIMIT
    assert f.rank == 2**31 - 1


def test_exit_status_is_the_code_or_128_plus_the_signal():
    assert Failure(exit_code=3).exit_status == 3
    assert Failure(exit_code=-1, signal=9).exit_status == 137


def test_a_job_record_keeps_its_failure_typed_across_a_save():
    f = Failure(rank=1, exit_code=1, cause="c", time=2.0, node_id="n", kind=FailureKind.HANG)
    rec = JobRecord(id="j", command=["x"], cwd="/", uid=0, gid=0, last_failure=f)
    data = json.loads(rec.to_json())
    assert data["last_failure"]["kind"] == "hang"
    assert JobRecord.from_json(rec.to_json()).last_failure == f
    data["last_failure"] = {"rank": 1, "cause": "written by an older release"}
    assert JobRecord.from_json(json.dumps(data)).last_failure.cause == \
        "written by an older release"
    assert JobRecord.from_json(rec.to_json().replace('"kind": "hang"', '"kind": "x"'))\
        .last_failure.kind is FailureKind.WORKER


def test_a_worker_row_round_trips_and_a_peers_node_id_wins():
    w = WorkerRow(rank=1, local_rank=0, pid=42, state=WorkerState.RUNNING, exit_code=0,
                  node_id="n1", create_time=5.5)
    assert WorkerRow.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    assert w.to_dict()["state"] == "running"
    assert WorkerRow.from_dict(dict(w.to_dict(), node_id="liar"), "n2").node_id == "n2"


@pytest.mark.parametrize("bad", [{"rank": "x"}, "garbage", {"rank": 0, "local_rank": 0,
                                                           "pid": 1, "state": "zombie",
                                                           "exit_code": 0}])
def test_a_worker_row_that_does_not_parse_raises(bad):
    with pytest.raises((KeyError, TypeError, ValueError)):
        WorkerRow.from_dict(bad)


def test_a_job_record_drops_a_saved_row_that_does_not_parse_and_keeps_the_rest():
    good = WorkerRow(rank=0, local_rank=0, pid=7, state=WorkerState.STOPPED, node_id="n")
    rec = JobRecord(id="j", command=["x"], cwd="/", uid=0, gid=0, workers=[good])
    data = json.loads(rec.to_json())
    data["workers"].append({"rank": "x"})
    del data["workers"][0]["create_time"]          # as an older release wrote it
    assert JobRecord.from_json(json.dumps(data)).workers == [good]


def test_a_recovery_attempt_round_trips_and_a_job_record_keeps_it_typed():
    a = Attempt(Layer.INPROCESS, "rank 1: boom", 3.0, rank=1, node_id="n1", duration=0.25,
                outcome=Outcome.RECOVERED)
    assert a.to_dict() == {"layer": "inprocess", "cause": "rank 1: boom", "time": 3.0,
                           "rank": 1, "node_id": "n1", "duration": 0.25,
                           "outcome": "recovered"}
    assert Attempt.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    rec = JobRecord(id="j", command=["x"], cwd="/", uid=0, gid=0, attempts=[a])
    data = json.loads(rec.to_json())
    data["attempts"].append({"layer": "teleport", "cause": "a newer layer"})
    assert JobRecord.from_json(json.dumps(data)).attempts == [a]
    assert rec.recovery_summary().to_dict()["attempts"] == [a.to_dict()]


@pytest.mark.parametrize("bad", [{"layer": "process", "time": "soon", "outcome": "failed"},
                                 {"layer": "?", "outcome": "failed"}, "garbage"])
def test_an_attempt_that_does_not_parse_raises(bad):
    with pytest.raises((TypeError, ValueError)):
        Attempt.from_dict(bad)
