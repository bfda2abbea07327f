"""The per-job restart loop on this node.

One ``Agent`` thread per active job on this node: rendezvous (join the
job's next round, see rendezvous/round.py) -> start workers -> monitor ->
on a fault stop the group and open a new round (counted against the job's
cluster-wide budgets: max_restarts over its life, max_restarts_per_window
over a window; see jobs/restartpolicy.py) -> wait as ``plan_restart()`` decides
(at once after an attempt that made progress, a growing backoff after
attempts that made none) -> re-rendezvous; when a peer opens
a new round (its fault, a lost node, a node waiting to join) stop and
rejoin; when every node's workers succeeded, finish. A standalone daemon
runs the same loop on the in-memory store, one node per round.

What to do after each look at the workers and the round is decided by the
pure function ``decide()`` (agent/decide.py); ``Agent._apply`` carries it out, and every move
of the job goes through ``JobRegistry.transition``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..config import Config
from ..gpus.alloc import Binding
from ..jobs.registry import JobRecord, JobRegistry
from ..jobs.ladder import Layer
from ..jobs.records import Failure, FailureKind, WorkerRow
from ..logsetup import ctx
from .attempt import AttemptWatch
from .blame import FailureNotes
from .decide import Action, Decision, Snapshot, decide
from .gpu_gate import GpuGate
from .joining import JoinGate
from .monitor_wait import MonitorWait
from .pacing import RestartPacer
from .placement import Placement
from .recovery import Recovery
from .refill import SpareRefill
from .replace import RankReplacer
from .standby import Standby
from .stores import JobStores
from .template import JobTemplate
from ..rendezvous.round import ClusterRendezvous, RendezvousStopped, RoundFinal
from ..rendezvous.protocol import (
    CANCELLED, FAILED, SUCCEEDED, Result, RoundCause, RoundState, final_job_state)
from ..rendezvous.status import CURRENT
from ..jobs.states import TERMINAL_STATES, JobState
from ..store import StoreError
from ..workers.template_pool import TemplatePool
from ..workers.group import SpawnError, WorkerGroup
from ..workers.snapshot_dirs import SnapshotBudgets
from ..workers.spares import SparePool

log = logging.getLogger("elasticd.agent.loop")


class Agent:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry,
                 rendezvous: ClusterRendezvous, on_exit: Callable[[str], None], metrics=None,
                 binding: Binding | None = None, health=None, *, templates: TemplatePool,
                 snapshots: SnapshotBudgets | None = None, quarantine=None, phases):
        self.job_id = job_id
        # The job's GPUs, CPUs and snapshot budget here, the same for every attempt and rank
        # (agent/placement.py); GPU health and quarantine checked before each round (gpu_gate).
        self._place = Placement(cfg, binding or Binding(), snapshots)
        self._gpu_gate = GpuGate(job_id, cfg, registry, rendezvous, self._place.binding, health,
                                 quarantine)
        self._cfg = cfg
        self._registry = registry
        self._rdzv = rendezvous
        self._on_exit = on_exit
        self._metrics = metrics
        self.wake = threading.Event()
        # The monitor's wait, cut short by a worker's end, a poke or a change of the job's
        # round (a peer's fault: its ranks are stopped at once).
        self._monitor_wait = MonitorWait()
        rendezvous.on_change(self._monitor_wait.poke)
        self.shutting_down = False
        self._spares = SparePool()
        # The job's round state as this agent last read it: from the round it joined
        # (next_round's result) and from each status look while it runs.
        self._round_state: RoundState | None = None
        self._tpl = JobTemplate(job_id, cfg, registry, templates)  # agent/template.py
        self._stores = JobStores(job_id, cfg, registry, rendezvous)  # agent/stores.py
        # Before this node asks to join a running round: warm first (agent/joining.py).
        self._join_gate = JoinGate(job_id, cfg, registry, self._tpl, self._spares,
                                   self._place.group_spec, self._where)
        rendezvous.ready_to_join = self._join_gate.ready
        # A spare node of the job, at its max nodes, stands by (agent/standby.py).
        self._standby = Standby(job_id, cfg.daemon.node_id, registry, rendezvous, quarantine,
                                metrics, self._where)
        self._group: WorkerGroup | None = None    # the running attempt's workers
        self._recovery = Recovery(job_id, cfg, registry, metrics)  # the ladder's record
        # What the running attempt did (beats, phases, hangs: agent/attempt.py), for the
        # wait before the next restart and the crash-loop count (agent/pacing.py).
        self._attempt = AttemptWatch(job_id, cfg, registry, phases, metrics)
        self._pacer = RestartPacer(cfg, registry.get(job_id).crash_loop)
        # The spares the next restart takes, started while this attempt runs.
        self._refill = SpareRefill(cfg, self._spares, self._tpl, self._where)
        self._notes = FailureNotes(cfg, registry, self._place, self._recovery, self._attempt)
        self._replacer = RankReplacer(job_id, cfg, registry, self._place, self._notes,
                                      self._recovery, self._attempt, self._spares,
                                      self._publish)
        self._thread = threading.Thread(target=self._run, name=f"agent-{job_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def poke(self) -> None:
        self.wake.set()
        self._monitor_wait.poke()

    def _where(self, rnd: int | None = None) -> str:
        return ctx(job=self.job_id, node=self._cfg.daemon.node_id, round=rnd)

    # -- the loop ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._tpl.start(self._place.node_spec, self.wake)
            self._stores.start_round_stores(self._place.node_spec, self.wake, self._tpl.current)
            self._loop()
        except Exception as exc:
            log.exception("%s: agent crashed", self._where())
            try:
                if self._group is not None:
                    self._group.stop(self._cfg.agent.stop_grace_period)
                # The other nodes would wait in collectives for our ranks: end it everywhere.
                self._finish_cluster(FAILED, f"node {self._cfg.daemon.node_id}: internal error "
                                             f"in elasticd: {exc}")
                job = self._registry.get(self.job_id)
                if job.state not in TERMINAL_STATES:
                    self._registry.transition(self.job_id, JobState.FAILED,
                                              f"internal error in elasticd: {exc}", exit_code=1)
            except Exception:
                log.exception("%s: could not record agent crash", self._where())
        finally:
            self._attempt.stop()
            self._stores.stop()   # a round store server forked from the template first
            try:
                self._tpl.release(keep=not self.shutting_down)
            except Exception:
                log.exception("%s: could not record the template's end", self._where())
            self._spares.clear()
            self._standby.ended()
            self._rdzv.close()    # its listener, its watch of the job's rounds
            self._monitor_wait.close()
            self._on_exit(self.job_id)

    def _loop(self) -> None:
        while True:
            job = self._registry.get(self.job_id)
            if job.state in TERMINAL_STATES:
                return
            if job.cancel_requested:
                self._finish_cluster(CANCELLED, "cancelled by user")
                self._registry.transition(self.job_id, JobState.CANCELLED, "cancelled by user")
                return
            if self.shutting_down:
                return
            if job.state != JobState.RENDEZVOUS:
                self._registry.transition(self.job_id, JobState.RENDEZVOUS,
                                          f"joining round {self._next_round_number(job)}")
            self.wake.clear()
            store_port = self._stores.start_job_store(
                job, self._place.node_spec, self._tpl.current(), self.wake) \
                if job.inprocess else 0
            if store_port is None:  # woken while the template imported: look again
                continue
            try:
                if not self._gpu_gate.healthy(self.wake):
                    continue
                result = self._rdzv.next_round(self.wake, store_port)
            except RoundFinal as final:
                self._end_as(final.state, None)
                return
            except RendezvousStopped:
                continue
            except StoreError as exc:
                log.warning("%s: rendezvous interrupted: %s; trying again", self._where(), exc)
                self.wake.wait(self._cfg.membership.watch_retry)
                continue
            self._join_gate.joined()
            self._standby.joined(result)
            self._round_state = result.state or self._round_state
            state = self._round_state
            job = self._registry.update(
                self.job_id, round=result.place.round,
                **({"restarts": state.restarts, "restart_times": list(state.restart_times)}
                   if state else {}))
            result, spec = self._stores.round_spec(job, result, self._place.group_spec)
            # In-process restart is on where with_job_store gave the ranks a store.
            self._recovery.start_attempt(job, job.inprocess and bool(result.store_port))
            if not self._tpl.ready_for_round(self._place.node_spec, self.wake):
                continue  # woken (a cancel, a shutdown, the job's end): no ranks
            group = self._group = WorkerGroup(
                spec, self._tpl.template if self._cfg.agent.worker_template else None)
            started_warm = self._spares.ready() > 0 or self._tpl.template.ready(0)
            self._attempt.begin()
            try:
                group.start(self._spares)
            except SpawnError as exc:
                self._finish_cluster(FAILED, f"node {self._cfg.daemon.node_id}: {exc}")
                self._registry.transition(self.job_id, JobState.FAILED, str(exc), exit_code=127,
                                          last_failure=self._notes.record(job, -1, 127, 0,
                                                                          str(exc)))
                return
            place, last = result.place, result.place.rank_offset + len(group.workers) - 1
            self._registry.transition(
                self.job_id, JobState.RUNNING,
                f"round {place.round}: ranks {place.rank_offset}..{last} of "
                f"{place.world_size} on {place.group_world_size} node(s)",
                workers=self._place.worker_rows(group))
            self._recovery.recovered()
            self._tpl.note_start(group, result)
            self._publish(group)
            if self._metrics:
                self._metrics.workers_started_n(len(group.workers))
                self._metrics.round_nodes(result.place.group_world_size)  # metrics: participants
            decision = self._monitor(group, result, started_warm)
            if not self._apply(decision, group, result):
                return

    def _next_round_number(self, job: JobRecord) -> int:
        state = self._round_state
        return (state.round + 1) if state and state.status != "open" else job.round + 1

    def _monitor(self, group: WorkerGroup, result: Result, started_warm: bool) -> Decision:
        interval = self._cfg.agent.monitor_interval
        self._refill.arm(self._attempt.started, started_warm)  # spares for the next restart
        marked_done = scale_requested = False
        while True:
            workers = group.poll()
            self._attempt.check(group, result)  # dump stacks, kill hung ranks
            if self._recovery.inprocess_on:
                self._recovery.read_reports(group)
            job_restarts, max_restarts, cancel = self._registry.control_flags(self.job_id)
            outcomes = [w.outcome for w in workers]
            try:
                round_status = self._rdzv.status(result)
                peers_done = True
                if outcomes and all(rc == 0 for rc in outcomes):
                    if not marked_done:
                        self._rdzv.mark_done(result.place.round)
                        marked_done = True
                    peers_done = self._rdzv.all_done(result)
            except StoreError as exc:
                # etcd is away: training goes on; decide on the workers alone.
                log.debug("%s: round status unknown: %s", self._where(result.place.round), exc)
                round_status, peers_done = CURRENT, False
            if round_status.state is not None:
                self._round_state = round_status.state
            state = self._round_state
            restarts = state.restarts if state else job_restarts
            decision = decide(Snapshot(
                tuple(outcomes), restarts, max_restarts, cancel, self.shutting_down,
                round_status=round_status, peers_done=peers_done,
                inprocess_left=self._recovery.inprocess_left(),
                gave_up=self._recovery.gave_up(), remote_ranks=result.place.group_world_size > 1))
            if decision.action is Action.REPLACE:
                self._replacer.replace_dead(group)
                self._refill.arm(time.monotonic(), False)  # the replacement took a spare
            elif decision.action is Action.SCALE_UP:
                if result.place.group_rank == 0 and not scale_requested:
                    scale_requested = True
                    self._try(lambda: self._rdzv.reopen(result, decision.reason, False,
                                                        RoundCause.NODE_WAITING))
            elif decision.action is not Action.CONTINUE:
                return decision
            self._refill.tick(group.spec, self._attempt.first_beat,
                              max_restarts < 0 or restarts < max_restarts, result.place.round)
            self._tpl.note()
            if self._attempt.first_beat is not None and not self._tpl.preload_read:
                self._tpl.learn_preload(group.spec)
            if not self.wake.is_set():
                self._monitor_wait.wait(group.exit_fds(), interval)
            self.wake.clear()

    def _apply(self, decision: Decision, group: WorkerGroup, result: Result) -> bool:
        """Carry out a decision, one method per action; True when the loop should
        go round again."""
        carry_out = {Action.SUCCEED: self._succeed, Action.CANCEL: self._cancel,
                     Action.SUSPEND: self._suspend, Action.FINAL: self._final,
                     Action.REJOIN: self._new_round, Action.NODE_LOST: self._new_round,
                     Action.RESTART: self._restart_or_fail, Action.FAIL: self._restart_or_fail}
        return carry_out[decision.action](decision, group, result)

    def _stop_group(self, group: WorkerGroup, grace: float | None = None) -> None:
        group.stop(self._cfg.agent.stop_grace_period if grace is None else grace)
        group.poll()

    def _succeed(self, decision: Decision, group: WorkerGroup, result: Result) -> bool:
        self._stop_group(group, grace=0)
        self._finish_cluster(SUCCEEDED, "every node's workers exited 0")
        self._registry.transition(self.job_id, JobState.SUCCEEDED, decision.reason,
                                  exit_code=0, workers=self._place.worker_rows(group))
        self._publish(group)
        return False

    def _stopped_rows(self, group: WorkerGroup) -> list[WorkerRow]:
        """Stop the group for good on this node; its rows, published."""
        self._stop_group(group)
        rows = self._place.worker_rows(group)
        self._publish(group)
        return rows

    def _cancel(self, decision: Decision, group: WorkerGroup, result: Result) -> bool:
        rows = self._stopped_rows(group)
        self._finish_cluster(CANCELLED, decision.reason)
        self._registry.transition(self.job_id, JobState.CANCELLED, decision.reason,
                                  exit_code=0, workers=rows)
        return False

    def _suspend(self, decision: Decision, group: WorkerGroup, result: Result) -> bool:
        rows = self._stopped_rows(group)
        self._registry.transition(self.job_id, JobState.RESTARTING, decision.reason,
                                  workers=rows)
        return False

    def _final(self, decision: Decision, group: WorkerGroup, result: Result) -> bool:
        rows = self._stopped_rows(group)
        self._end_as(self._round_state, rows)
        return False

    def _new_round(self, decision: Decision, group: WorkerGroup, result: Result) -> bool:
        """REJOIN (a peer opened a new round) or NODE_LOST (open one ourselves)."""
        act = decision.action
        job = self._registry.get(self.job_id)
        self._pacer.peer_fault(self._attempt.progress())
        self._stop_group(group)
        self._publish(group)
        state = self._round_state
        layer = decision.layer or Layer.PROCESS
        self._recovery.ladder.begin(layer, decision.reason or "a new round opened", time.time())
        if act is Action.NODE_LOST:
            state = self._try(lambda: self._rdzv.reopen(result, decision.reason, True,
                                                        RoundCause.NODE_LOST)) or state
        # A lost node is a fault of this round (metrics); a peer's new round is not ours.
        lost = Failure(cause=decision.reason, kind=FailureKind.NODE_LOST) \
            if act is Action.NODE_LOST else None
        if state is not None and state.final:
            self._recovery.ladder.failed(layer, state.reason or decision.reason, time.time())
            self._registry.update(self.job_id, **self._recovery.fields())
            self._fault_handled(lost, Layer.RENDEZVOUS,
                                self._end_as(state, self._place.worker_rows(group)))
            return False
        self._fault_handled(lost, Layer.RENDEZVOUS, self._registry.transition(
            self.job_id, JobState.RESTARTING, decision.reason or "a new round opened",
            restarts=state.restarts if state else job.restarts,
            restart_times=list(state.restart_times) if state else job.restart_times,
            workers=self._place.worker_rows(group), **self._recovery.fields()))
        return True

    def _restart_or_fail(self, decision: Decision, group: WorkerGroup, result: Result) -> bool:
        """RESTART or FAIL: a local worker failed, or in-process restart gave up."""
        job = self._registry.get(self.job_id)
        plan = self._pacer.plan(self._attempt.progress())
        # Stop the rest of the group before recording: they would hang in collectives.
        # Blame only after the stop: a rank SIGKILLed by someone else (the OOM
        # killer) may not be reaped yet when its peer's error file is seen, on a
        # loaded machine; the stop waits for it and tells its signal from ours.
        self._stop_group(group)
        failure = self._blame(job, group)
        self._publish(group)
        crash_loop = self._pacer.crash_loop(failure, plan)
        if crash_loop and decision.action is Action.RESTART:
            decision = Decision(Action.FAIL, crash_loop)
        state = self._try(lambda: self._rdzv.reopen(result, failure.cause, True))
        if decision.action is Action.FAIL or (state is not None and state.final):
            self._fail(decision, group, failure, state)
            return False
        restart = state.restarts if state is not None else job.restarts + 1
        times = list(state.restart_times) if state is not None else job.restart_times
        self._pacer.restarting(plan)
        record = dict(plan.to_dict(), node_id=self._cfg.daemon.node_id, time=time.time())
        climb = self._recovery.ladder.begin(Layer.PROCESS, failure.cause, failure.time,
                                            failure.rank)
        log.info("%s: %s", self._where(result.place.round), plan.sentence())
        self._fault_handled(failure, Layer.PROCESS, self._registry.transition(
            self.job_id, JobState.RESTARTING,
            f"{climb.cause}; {decision.reason}; {plan.sentence()}",
            plan=plan, restarts=restart, restart_times=times, last_restart_plan=record,
            crash_loop=self._pacer.crash_loop_saved(), last_failure=failure, workers=self._place.worker_rows(group),
            **self._recovery.fields()))
        if plan.delay:
            self.wake.wait(plan.delay)
            self.wake.clear()
        return True

    def _blame(self, job: JobRecord, group: WorkerGroup) -> Failure:
        """The failure a stopped group's restart or end is recorded with."""
        ladder = self._recovery.ladder
        if self._recovery.gave_up():
            return self._notes.record(job, ladder.abandoned_rank, 1, 0,
                                 f"in-process restart gave up: {ladder.abandoned}")
        return self._notes.explain(self._notes.first(job, group))

    def _fail(self, decision: Decision, group: WorkerGroup, failure: Failure,
              state: RoundState | None) -> None:
        """No restart: out of restarts here, or the new round ended the job."""
        code = failure.exit_status
        chain = self._recovery.ladder.failed(Layer.PROCESS, failure.cause,
                                             failure.time, failure.rank)
        why = (state.reason if decision.action is Action.RESTART and state is not None
               and state.reason else f"{failure.cause}; {decision.reason}")
        if len(self._recovery.ladder.attempts) > 1:
            why += f"; cause chain: {chain}"
        self._finish_cluster(FAILED, why)
        self._fault_handled(failure, Layer.PROCESS, self._registry.transition(
            self.job_id, JobState.FAILED, why, exit_code=code, last_failure=failure,
            workers=self._place.worker_rows(group), **self._recovery.fields()))

    # -- the cluster's word ----------------------------------------------------
    def _end_as(self, state: RoundState | None, rows: list[WorkerRow] | None) -> JobRecord:
        """Record the job's cluster-wide end on this node; the record it left."""
        status = state.status if state else FAILED
        reason = (state.reason if state else "") or status
        changes = {"workers": rows} if rows is not None else {}
        if state is not None:
            changes["restarts"] = state.restarts
        target = final_job_state(status)
        job = self._registry.get(self.job_id)
        code = 0 if target is not JobState.FAILED else (job.exit_code or 1)
        return self._registry.transition(self.job_id, target, reason, exit_code=code, **changes)

    def _fault_handled(self, failure: Failure | None, layer: Layer, job: JobRecord) -> None:
        """Count a fault this agent handled, by the move it made (metrics.py)."""
        if self._metrics and failure is not None:
            self._metrics.fault_handled(job, failure, layer)

    def _finish_cluster(self, status: str, reason: str) -> None:
        self._try(lambda: self._rdzv.finish(status, reason))

    def _publish(self, group: WorkerGroup) -> None:
        job = self._registry.get(self.job_id)
        summary = job.recovery_summary() if job is not None else None
        self._try(lambda: self._rdzv.publish_workers(self._place.worker_rows(group), summary))

    def _try(self, call):
        """A store call that must not stop the loop: etcd may be away for a while."""
        try:
            return call()
        except StoreError as exc:
            log.warning("%s: etcd call failed: %s", self._where(), exc)
            return None
