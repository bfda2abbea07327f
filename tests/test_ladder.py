"""The restart ladder's decisions and records, without I/O (jobs/ladder.py, agent.decide,
workers/inprocess_reports.py)."""
from __future__ import annotations

import json
import os

from elasticd.agent.decide import Action, Snapshot, round_layer
from elasticd.agent.decide import decide as decide_on
from elasticd.workers.inprocess_reports import MAX_READ, ReportReader, parse_line
from elasticd.jobs.ladder import Attempt, Ladder, Layer, chain_text
from elasticd.rendezvous.protocol import RoundCause, RoundState
from elasticd.rendezvous.status import RoundStatus, StatusKind


def ladder(budget=8):
    return Ladder("node-a", budget)


# ---------------------------------------------------------------- decide()

def decide(returncodes, restarts, max_restarts, cancel, stopping, **rest):
    return decide_on(Snapshot(tuple(returncodes), restarts, max_restarts, cancel, stopping,
                              **rest))


def test_a_dead_rank_is_replaced_while_the_others_still_train():
    d = decide([None, -9], 0, 3, False, False, inprocess_left=8)
    assert d.action is Action.REPLACE


def test_no_replacement_without_the_inprocess_layer_or_its_budget():
    assert decide([None, 3], 0, 3, False, False).action is Action.RESTART
    assert decide([None, 3, 3], 0, 3, False, False, inprocess_left=1).action is Action.RESTART


def test_no_replacement_once_a_rank_finished_or_all_are_gone():
    # A rank that returned left the function: nobody would meet the newcomer.
    assert decide([0, 3], 0, 3, False, False, inprocess_left=8).action is Action.RESTART
    assert decide([3, 3], 0, 3, False, False, inprocess_left=8).action is Action.RESTART


def test_giving_up_in_process_restarts_the_group_at_once_or_fails_without_budget():
    assert decide([None, None], 0, 3, False, False, inprocess_left=8,
                  gave_up=True).action is Action.RESTART
    assert decide([None, None], 3, 3, False, False, gave_up=True).action is Action.FAIL


def test_cancel_and_node_loss_still_come_before_a_replacement():
    assert decide([None, 3], 0, 3, True, False, inprocess_left=8).action is Action.CANCEL
    assert decide([None, 3], 0, 3, False, False,
                  round_status=RoundStatus(StatusKind.LOST, "node(s) n2 lost", nodes=("n2",)),
                  inprocess_left=8).action is Action.NODE_LOST


# ---------------------------------------------------------------- Ladder

def test_each_iteration_is_counted_once_whichever_rank_reports_it():
    lad = ladder()
    a = lad.iteration_started(1, "rank 1: RuntimeError: boom", 100.0, 100.5, rank=0)
    assert (a.layer, a.rank, a.outcome, a.duration) == ("inprocess", 1, "recovered", 0.5)
    assert lad.iteration_started(1, "rank 0: connection closed", 100.1, 100.6, rank=1) is None
    assert lad.restarts_by_layer == {"inprocess": 1} and len(lad.attempts) == 1


def test_a_replaced_rank_is_the_cause_of_the_next_iteration_not_the_peers_reset():
    lad = ladder()
    lad.replaced("rank 1 exited with exit code 3", at=99.0, rank=1)
    a = lad.iteration_started(1, "rank 0: RuntimeError: Connection closed by peer", 99.2,
                              101.0, rank=0)
    assert (a.cause, a.rank, a.duration) == ("rank 1 exited with exit code 3", 1, 2.0)


def test_replacements_and_iterations_draw_on_one_budget_per_process_attempt():
    lad = ladder(budget=2)
    lad.replaced("rank 1 died", 1.0, 1)
    assert lad.inprocess_left() == 1
    lad.iteration_started(1, "x", 1.0, 2.0, 0)
    lad.iteration_started(2, "x", 3.0, 4.0, 0)
    assert lad.inprocess_left() == 0
    lad.new_process_attempt()
    assert lad.inprocess_left() == 2
    lad.gave_up("3 faults within 30s", rank=0)
    assert lad.inprocess_left() == 0 and lad.abandoned_rank == 0


def test_a_process_climb_recovers_when_the_workers_run_again():
    lad = ladder()
    lad.begin(Layer.PROCESS, "rank 0 exited with exit code 1", at=10.0, rank=0)
    a = lad.recovered(now=12.5)
    assert (a.outcome, a.duration) == ("recovered", 2.5)
    assert lad.attempts[-1].outcome == "recovered" and len(lad.attempts) == 1
    assert lad.recovered(now=13.0) is None


def test_the_final_failure_returns_the_cause_chain():
    lad = ladder()
    for it in (1, 2):
        lad.iteration_started(it, "rank 1: RuntimeError: boom", it, it + 0.1, 0)
    lad.begin(Layer.PROCESS, "in-process restart gave up: 3 faults", 5.0)
    lad.recovered(6.0)
    chain = lad.failed(Layer.PROCESS, "rank 0 exited with exit code 1", 9.0, 0)
    assert chain == ("inprocess x2 (rank 1: RuntimeError: boom) -> process x2 "
                     "(rank 0 exited with exit code 1)")
    assert [a.outcome for a in lad.attempts] == ["recovered", "recovered", "recovered",
                                                     "failed"]


def test_the_record_keeps_the_latest_fifty_attempts_and_a_bounded_chain():
    lad = ladder(budget=1000)
    for it in range(1, 80):
        lad.iteration_started(it, "rank 1: " + "x" * 500, it, it, 0)
    assert len(lad.attempts) == 50 and lad.restarts_by_layer["inprocess"] == 79
    assert len(chain_text([Attempt(Layer.INPROCESS if i % 2 else Layer.PROCESS, "y" * 200, 0.0)
                           for i in range(50)])) <= 1000


def test_a_peers_new_round_is_a_rendezvous_climb_only_for_membership_changes():
    assert round_layer(RoundCause.NODE_LOST) is Layer.RENDEZVOUS
    assert round_layer(RoundCause.NODE_WAITING) is Layer.RENDEZVOUS
    assert round_layer(RoundCause.FAULT) is Layer.PROCESS
    # The decision carries the layer: nothing downstream reads the reason text.
    superseded = RoundStatus(StatusKind.SUPERSEDED, "rank 3 lost its way; round 2 opened",
                             cause=RoundCause.FAULT)
    d = decide([None, None], 0, 3, False, False, round_status=superseded)
    assert (d.action, d.layer) == (Action.REJOIN, Layer.PROCESS)
    d = decide([None], 0, 3, False, False, round_status=RoundStatus(
        StatusKind.SUPERSEDED, "node(s) n4 waiting to join", cause=RoundCause.NODE_WAITING))
    assert (d.action, d.layer) == (Action.REJOIN, Layer.RENDEZVOUS)


def test_a_round_state_keeps_its_cause_and_reads_an_older_releases_by_its_reason():
    legacy = {"round": 4, "status": "open"}
    for reason, layer in (("node(s) n3 lost; round 4 opened (restart 2 of 3)", Layer.RENDEZVOUS),
                          ("node(s) n4 waiting to join; round 2 opened", Layer.RENDEZVOUS),
                          ("rank 3 exited with exit code 1; round 2 opened", Layer.PROCESS)):
        state = RoundState.from_json(json.dumps(dict(legacy, reason=reason)))
        assert round_layer(state.cause) is layer, reason
    state = RoundState(round=2, status="open", reason="x lost", cause=RoundCause.FAULT)
    assert json.loads(state.to_json())["cause"] == "fault"
    assert RoundState.from_json(state.to_json()) == state
    assert RoundState.from_json(json.dumps(dict(legacy, cause="newer"))).cause \
        is RoundCause.FAULT


# ---------------------------------------------------------------- the wrapper's reports

def test_reports_are_parsed_and_anything_else_is_skipped():
    ok = parse_line(b'{"kind": "restart", "iteration": 2, "fault": "f", "fault_time": 1, '
                    b'"ready_time": 2}')
    assert ok.to_dict() == {"kind": "restart", "iteration": 2, "fault": "f",
                            "fault_time": 1.0, "ready_time": 2.0}
    for junk in (b"not json", b"[1, 2]", b'{"kind": "restart"}', b'{"kind": "rm -rf"}',
                 b'{"kind": "restart", "iteration": "many"}', b"[" * 100000):
        assert parse_line(junk) is None
    long = parse_line(json.dumps({"kind": "abandoned", "reason": "r" * 50000}).encode())
    assert len(long.to_dict()["reason"]) == 2000
    # a line longer than one read (MAX_READ) is skipped whole, as the reader skips it
    assert parse_line(json.dumps({"kind": "abandoned", "reason": "r" * MAX_READ}).encode()) \
        is None
    assert parse_line(b'{"kind": "stuck", "reason": "hang", "pid": 7}').to_dict() == \
        {"kind": "stuck", "reason": "hang"}


def test_the_reader_follows_appends_and_holds_back_a_partial_line(tmp_path):
    path = tmp_path / "r.jsonl"
    reader = ReportReader()
    assert reader.poll({0: str(path)}) == []               # not there yet
    path.write_text('{"kind": "abandoned", "reason": "a"}\n{"kind": "aband')
    assert [(r, rep.to_dict()) for r, rep in reader.poll({0: str(path)})] == \
        [(0, {"kind": "abandoned", "reason": "a"})]
    with open(path, "a") as fh:
        fh.write('oned", "reason": "b"}\n')
    assert [(r, rep.to_dict()) for r, rep in reader.poll({0: str(path)})] == \
        [(0, {"kind": "abandoned", "reason": "b"})]
    assert reader.poll({0: str(path)}) == []


def test_the_reader_never_follows_a_link(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text('{"kind": "abandoned", "reason": "from a link"}\n')
    link = tmp_path / "r.jsonl"
    os.symlink(secret, link)
    assert ReportReader().poll({0: str(link)}) == []


def test_the_only_local_rank_is_replaced_when_other_nodes_still_train():
    assert decide([3], 0, 3, False, False, inprocess_left=8).action is Action.RESTART
    assert decide([3], 0, 3, False, False, inprocess_left=8,
                  remote_ranks=True).action is Action.REPLACE


# ---------------------------------------------------------------- Recovery: record, events, metrics

def test_inprocess_reports_become_events_a_ladder_record_and_metrics(tmp_path):
    from types import SimpleNamespace

    from elasticd.config import Config
    from elasticd.workers.inprocess_reports import report_path
    from elasticd.jobs.registry import JobRecord, JobRegistry
    from elasticd.metrics import Metrics
    from elasticd.agent.recovery import Recovery

    registry = JobRegistry(str(tmp_path / "state"), "node-a")
    job = registry.create(JobRecord(id="j1", command=["python", "t.py"], cwd="/", uid=0, gid=0,
                                    inprocess=True, max_restarts=3))
    metrics = Metrics("node-a")
    rec = Recovery("j1", Config(), registry, metrics)
    rec.start_attempt(job, inprocess_on=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    group = SimpleNamespace(spec=SimpleNamespace(run_dir=str(run_dir), restart_count=0,
                                                 uid=os.geteuid()),
                            workers=[SimpleNamespace(rank=0), SimpleNamespace(rank=1)])
    line = {"kind": "restart", "iteration": 1, "fault": "rank 1: RuntimeError: boom",
            "fault_time": 100.0, "ready_time": 100.25}
    for rank in (0, 1):   # every rank reports the iteration; it counts once
        with open(report_path(str(run_dir), rank, 0), "w") as fh:
            fh.write(json.dumps(line) + "\n")
    rec.read_reports(group)
    job = registry.get("j1")
    assert job.restarts_by_layer == {"inprocess": 1}
    assert job.restart_budget == {"inprocess": 8, "process": 3, "rendezvous": -1}
    assert job.attempts[0].cause == "rank 1: RuntimeError: boom"
    ev = [e.to_dict() for e in registry.events(job_id="j1") if e.kind == "restart"]
    assert len(ev) == 1 and ev[0]["layer"] == "inprocess" and ev[0]["duration_seconds"] == 0.25
    value = metrics.registry.get_sample_value
    assert value("elasticd_restarts_total", {"layer": "inprocess", "cause": "exit"}) == 1
    assert value("elasticd_recovery_duration_seconds_count", {"layer": "inprocess"}) == 1
    assert value("elasticd_recovery_duration_seconds_bucket",
                 {"layer": "inprocess", "le": "0.1"}) == 0   # 0.25 s: finer buckets than 50 ms
    with open(report_path(str(run_dir), 0, 0), "a") as fh:
        fh.write(json.dumps({"kind": "abandoned", "reason": "3 faults within 30s"}) + "\n")
    rec.read_reports(group)
    assert rec.gave_up() and rec.inprocess_left() == 0
