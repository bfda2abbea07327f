"""Hang detection: watch each rank's progress beats; dump stacks, then kill.

Workers beat without any change to the training script: elasticd puts
``worker_site/`` first on their PYTHONPATH, whose ``sitecustomize`` makes every
``torch.optim`` optimizer step, every module forward pass and every torch.save/load
or distributed checkpoint write a record into the rank's heartbeat file
(``ELASTICD_HEARTBEAT_FILE``; format: the worker contract,
worker_site/elasticd_heartbeat.py) and makes SIGUSR1 dump all Python stacks into
the rank's log. Scripts may also call ``heartbeat()`` and ``elasticd_section(name)``.

Where each rank beats, how its records are read and the OS calls on ranks are
hangs/beat_channel.py's. The agent calls ``ProgressTracker.check(group)`` once per
monitor tick. A beat is a change of the heartbeat file's mtime seen by the daemon,
timed on the daemon's monotonic clock; the record then read says the rank's phase,
steps and busy time. The limits come from hangs/timeouts.py: learned per phase from
the job's own gaps between beats (kept across attempts and daemon restarts in the
job record), the fixed settings as the upper bound. The tracker feeds the ranks'
busy time per step to hangs/stragglers.py, which names the slowest rank. For a job
across nodes the agent hands it the other nodes' records (hangs/phase_board.py:
their ranks' phases, step times and what they learned; or the round's first
member's digest of them, hangs/phase_digest.py) and publishes its
``snapshot()``: a rank here waiting for a checkpoint there gets the checkpoint's
limits, the learned gaps merge, and the straggler is named job-wide. Per rank,
``judge()`` decides:

* A job is only watched once it has shown that it beats: some rank beat in this
  attempt or an earlier one. A script that never beats (no optimizer, no
  ``heartbeat()``; ``python -I``; not Python at all) is never killed for hanging;
  a rank whose process says it cannot beat (an ``off`` record: its sitecustomize
  failed) gets a warning event.
* A watched rank that made its first step in this attempt: no beat for its phase's
  soft limit -> SIGUSR1 once (stacks into its log, an event); for its hard limit ->
  SIGKILL of its process group, and the failure's cause says ``hang``.
* A watched rank with no step yet in this attempt (starting up, loading a
  checkpoint, compiling, stuck in ``init_process_group``): the same, measured from
  its start or latest beat, ``agent.first_step_timeout`` the hard limit and the dump
  the fixed margin (hard - soft) before it.
* A rank whose process said it is exiting (the heartbeat module's atexit hook, run
  once its non-daemon threads ended): the same long allowance, from that word.

A kill always follows a dump by at least one tick, so the stacks are written
before the process dies.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import signal
from dataclasses import dataclass, field
from typing import NamedTuple

from . import phase_board, stragglers
from .beat_channel import (  # noqa: F401
    HEARTBEAT_ENV, BeatRecord, ProcessOps, contract)
from .timeouts import (
    MAX_PHASES, STEADY_PHASES, HangLimits, LearnSettings, PhaseLimit, PhaseRecord, bracketed,
    encode_limits, limits_table, observe, others_wait_for, phase_limit)
from .phase_board import JobPeers, NodePhases, RankPhase
from ..logsetup import ctx
from ..jobs.records import Failure, FailureKind
from ..workers.rank_files import heartbeat_file, limits_file

log = logging.getLogger("elasticd.hangs.detector")

# ---------------------------------------------------------------- the decision

class HangAction(enum.Enum):
    NONE = "none"                # progressing, not watched, or already dumped
    DUMP_STACKS = "dump_stacks"  # soft limit passed: SIGUSR1 (once per idle spell)
    KILL = "kill"                # hard limit passed: SIGKILL the rank


class Verdict(NamedTuple):
    action: HangAction
    idle: float   # seconds since the last beat (or since the start, before one)


def judge(now: float, started: float, last_beat: float | None, watched: bool,
          dumped: bool, limits: HangLimits, exiting: bool = False,
          stepped: bool = True) -> Verdict:
    """What to do about one live rank, from its times (no I/O). ``limits``: its phase's
    (timeouts.phase_limit) soft and hard limits; ``dumped``: its stacks were already
    dumped in this idle spell (a kill needs that first, so the stacks are in the log
    before the process dies); ``exiting``: its last beat said it is shutting down;
    ``stepped``: it made its first step in this attempt (until then, and while exiting,
    it has the first-step allowance)."""
    idle = now - (started if last_beat is None else last_beat)
    if last_beat is None or exiting or not stepped:
        hard, soft = limits.first_step, limits.first_step - (limits.hard - limits.soft)
    else:
        hard, soft = limits.hard, limits.soft
    if not watched or idle < soft:
        return Verdict(HangAction.NONE, idle)
    if idle >= hard and dumped:
        return Verdict(HangAction.KILL, idle)
    if not dumped:
        return Verdict(HangAction.DUMP_STACKS, idle)
    return Verdict(HangAction.NONE, idle)


# ---------------------------------------------------------------- the tracker

@dataclass
class _Rank:
    pid: int                    # the worker process (leader of its process group)
    started: float              # daemon monotonic time it was first seen
    mark: int | None            # heartbeat mtime last seen (ns); a change is a beat
    last_beat: float | None = None
    dumped: bool = False
    exiting: bool = False       # its process said it is shutting down
    phase: str = contract.TRAIN  # the phase its latest beat said it is in
    phase_since: float = 0.0    # daemon time its latest beat put it in that phase
    stepped: bool = False       # it made its first step in this attempt
    off: bool = False           # its process said it cannot beat (warned)
    waits_for: PhaseLimit | None = None  # a peer's checkpoint/section limits, until it beats
    step_base: int = 0          # its step count when it last began waiting (in-process restart)


class _Killed(NamedTuple):
    rank: int
    idle: float
    at: float


@dataclass
class ProgressTracker:
    """Per job, owned by its agent thread: watches beats, dumps stacks, kills hung ranks,
    learns the job's timeouts per phase and names its straggler."""
    job_id: str
    settings: object            # AgentSettings
    registry: object            # JobRegistry: .event(job_id, kind, reason, rank=), .update()
    node_id: str = ""
    ops: ProcessOps = field(default_factory=ProcessOps)
    on_beat: object = None      # called (no arguments) when any rank beats: metrics
    seed: list = field(default_factory=list)  # the job record's hang_timeouts: what was learned
    _group: object = None
    _ranks: dict = field(default_factory=dict)
    _killed: dict = field(default_factory=dict)
    _job_beats: bool = False    # some rank beat in some attempt: the job uses beats
    _phases: dict = field(default_factory=dict)    # phase -> PhaseRecord, job-wide
    _samples: dict = field(default_factory=dict)   # rank -> stragglers.RankSamples
    _straggler: object = None   # stragglers.Straggler last found
    _announced: object = None   # the straggler the latest event was about
    _dirty: bool = False        # learned something not yet in the job record / limits file
    _saved_at: float = float("-inf")
    _table: tuple = ()          # the limits last written to the group's limits file
    _bracket_seen: float = float("-inf")  # latest look that saw a rank in a bracketed phase
    _killed_seen: float = float("-inf")   # latest kill of a hung rank of this job
    _peers: JobPeers = field(default_factory=JobPeers)  # the round's other nodes, latest look

    def __post_init__(self):
        for item in self.seed or []:
            rec = PhaseRecord.from_dict(item)
            if rec is not None and len(self._phases) < MAX_PHASES:
                self._phases[rec.phase] = rec
        self._job_beats = bool(self._phases)  # it beat in an earlier life of this daemon

    def check(self, group, peers: JobPeers | None = None) -> list[str]:
        """Look at every live rank of ``group`` once; returns what was done (sentences).
        ``peers``: the round's other nodes (hangs/phase_board.py), for a job across nodes."""
        if not self.settings.hang_detection:
            return []
        if group is not self._group:
            self._group, self._ranks, self._killed, self._table = group, {}, {}, ()
        self._peers = peers if peers is not None else JobPeers(complete=False)
        for learned in self._peers.learned():  # what the other nodes learned: the max per phase
            if phase_board.merge_learned(self._phases, learned):
                self._dirty = True
        now = self.ops.clock()
        learn = self._learn_settings(group)
        fixed = learn.fixed
        run_dir = group.spec.run_dir
        live = []
        for w in group.workers:
            if w.returncode is not None or w.stopped_by_us:
                continue
            path = heartbeat_file(run_dir, w.rank)
            mark = self.ops.beat_mark(path)
            r = self._ranks.get(w.rank)
            fresh = r is None or r.pid != w.pid  # new, or respawned alone: a fresh start
            if fresh:
                r = self._ranks[w.rank] = _Rank(pid=w.pid, started=now, mark=mark,
                                                phase_since=now)
            if mark is not None and (fresh or mark != r.mark):
                r.mark, rec = mark, self.ops.read_beat(path, group.spec.uid)
                if not self._beats_off(w, r, rec) and not fresh:
                    self._beat(w.rank, r, rec, now)
            live.append((w, r, path))
        watched = self._job_beats
        limits_of = self._rank_limits(live, learn, now)
        done, kill = [], None
        for w, r, path in live:
            if w.rank in self._killed:
                continue
            limit = limits_of.get(w.rank)
            limits = fixed if limit is None else HangLimits(limit.soft, limit.hard,
                                                            fixed.first_step)
            verdict = judge(now, r.started, r.last_beat, watched, r.dumped, limits, r.exiting,
                            r.stepped)
            if verdict.action is HangAction.DUMP_STACKS:
                r.dumped = True
                done.append(self._dump(w, path, group.spec.uid, verdict.idle, _since(r)))
            elif verdict.action is HangAction.KILL and (kill is None or verdict.idle > kill[2]):
                kill = (w, r, verdict.idle, limit)
        if kill is not None:  # one per look: a hung rank's peers usually fail by themselves
            w, r, idle, limit = kill
            self.ops.kill_rank(w, signal.SIGKILL)
            self._killed[w.rank] = _Killed(w.rank, idle, now)
            self._killed_seen = now
            why = (f"agent.first_step_timeout {fixed.first_step:g}s" if limit is None
                   else limit.source(learn))
            done.append(self._record(w.rank, f"rank {w.rank}: no progress for "
                                     f"{idle:.0f}s{_since(r)}; killed ({why})"))
        self._name_straggler(now)
        self._save(now, learn, run_dir, live)
        return done

    def _rank_limits(self, live: list, learn: LearnSettings,
                     now: float) -> dict[int, PhaseLimit]:
        """Each stepped rank's limits: its phase's, or, once a rank of the job on this
        node or on another (its node's phase record) was in a checkpoint or a section
        during the rank's silence, that phase's if longer: its peers wait for it in
        their next collective, silent in their own phase, until it has left and
        reached that collective too."""
        out, widest = {}, None
        for w, r, _ in live:
            if not r.stepped or r.exiting or r.last_beat is None:
                continue
            limit = out[w.rank] = phase_limit(r.phase, self._phases.get(r.phase), learn)
            if others_wait_for(r.phase):
                self._bracket_seen = now
                if widest is None or limit.hard > widest.hard:
                    widest = limit
        for phase in self._peers.waiting_phases(self.node_id):
            self._bracket_seen = now
            limit = phase_limit(phase, self._phases.get(phase), learn)
            if widest is None or limit.hard > widest.hard:
                widest = limit
        for w, r, _ in live:
            if w.rank not in out:
                continue
            # What a peer's checkpoint allowed stays until the rank beats again: its
            # collective returns only after the peer has left the checkpoint.
            if widest is not None and (r.waits_for is None or widest.hard > r.waits_for.hard):
                r.waits_for = widest
            if r.waits_for is not None and r.waits_for.hard > out[w.rank].hard:
                out[w.rank] = r.waits_for
        return out

    def _beat(self, rank: int, r: _Rank, rec: BeatRecord | None, now: float) -> None:
        """A new record: learn the gap it ends (if timeouts.py says it counts), take its
        phase and steps."""
        progress = rec is not None and rec.phase not in (contract.EXITING, contract.WAIT)
        if (progress and r.stepped and r.last_beat is not None and not r.exiting
                and self._killed_seen < r.last_beat
                and (bracketed(r.phase) or self._bracket_seen < r.last_beat)):
            self._learn(r.phase, now - r.last_beat)
        r.last_beat, r.dumped, r.waits_for = now, False, None
        if rec is not None:
            r.exiting = rec.exiting
            if rec.phase == contract.WAIT:
                # Waiting to re-enter the training function (an in-process restart): its
                # next first step (a new process group, maybe a reload) has the allowance.
                r.stepped, r.step_base = False, rec.steps
            elif not rec.exiting:
                if rec.phase != r.phase:
                    r.phase_since = now
                r.phase = rec.phase
                r.stepped = r.stepped or rec.steps > r.step_base
                samples = self._samples.setdefault(rank, stragglers.RankSamples())
                samples.add(now, rec.steps, rec.busy_us)
        self._job_beats = True
        if self.on_beat is not None:
            self.on_beat()

    def _beats_off(self, w, r: _Rank, rec: BeatRecord | None) -> bool:
        """Whether ``rec`` is the rank's own process saying it cannot beat (a fresh rank's
        file may hold an earlier process's record: no beat either way); warns once."""
        off = rec is not None and rec.off and self.ops.pgid(rec.pid) == w.pid
        if off and not r.off:
            r.off = True
            self._record(w.rank, f"rank {w.rank}: pid {rec.pid} sends no progress beats: "
                         "elasticd's sitecustomize could not install them (its log says "
                         "why); hang detection is off for this rank")
        return off

    def _learn(self, phase: str, gap: float) -> None:
        rec = self._phases.get(phase)
        if rec is None and len(self._phases) >= MAX_PHASES:
            return  # bounded: a script that names sections without end learns no more
        new = self._phases[phase] = observe(rec, phase, gap)
        if rec is None or new.longest > rec.longest or rec.gaps < self.settings.hang_learn_warmup:
            self._dirty = True

    def learned(self) -> list[PhaseLimit]:
        """The limits per phase now: what ``elasticctl status`` shows."""
        return limits_table(self._phases, self._learn_settings(self._group))

    def _learn_settings(self, group) -> LearnSettings:
        """How limits are learned for ``group``'s job. A rank here may wait in a collective
        for a peer on another node in a checkpoint or a section, whose phase this node sees
        in that node's record (hangs/phase_board.py): a job across nodes gets learned limits
        only while every other node of its round has a fresh record; else the fixed ones
        (here and in the in-process wrapper's limits file; the gaps are still recorded)."""
        learn = LearnSettings.from_settings(self.settings)
        if group is not None and group.spec.place.world_size > group.spec.nproc \
                and not self._peers.complete:
            return learn.fixed_only()
        return learn

    def snapshot(self, rnd: int) -> NodePhases:
        """This node's record for the job's other nodes (hangs/phase_board.py): each live
        rank's phase and since when, its step statistics, and the gaps learned."""
        now = self.ops.clock()
        ranks = []
        for rank in sorted(self._ranks):
            r = self._ranks[rank]
            if rank in self._killed:
                continue
            samples = self._samples.get(rank)
            steps = samples.window[-1][1] if samples is not None and samples.window else 0
            ranks.append(RankPhase(rank, r.phase, max(0.0, now - r.phase_since), steps,
                                   samples.step_seconds() if samples is not None else None))
        return NodePhases(self.node_id, rnd, tuple(ranks),
                          tuple(self._phases[p] for p in sorted(self._phases)))

    def straggler(self) -> stragglers.Straggler | None:
        return self._straggler

    def forget(self, rank: int) -> None:
        """The rank's process was replaced: watch its successor from its start."""
        self._ranks.pop(rank, None), self._killed.pop(rank, None)

    def explain(self, failure: Failure) -> Failure:
        """The failure record, its cause naming the hang if a rank was killed for one."""
        if not self._killed:
            return failure
        k = self._killed.get(failure.rank)
        first = min(self._killed.values(), key=lambda k: (k.at, -k.idle, k.rank))
        if k is None or k.at > first.at:  # a peer failed as a consequence: blame the first
            k = first
        cause = (f"rank {k.rank} hang: no progress for {k.idle:.0f}s; killed by elasticd "
                 f"(its Python stacks are in its log)")
        return dataclasses.replace(
            failure, rank=k.rank, exit_code=-1, signal=int(signal.SIGKILL), cause=cause,
            kind=FailureKind.HANG, traceback="" if k.rank != failure.rank else failure.traceback)

    # -- stragglers and what was learned ----------------------------------------
    def _name_straggler(self, now: float) -> None:
        a = self.settings
        times = {}
        for rank, samples in self._samples.items():
            samples.drop_older_than(now - a.straggler_window)
            times[rank] = samples.step_seconds()
        nodes = {rank: self.node_id for rank in times}
        for peer in self._peers.records:  # the job's ranks on other nodes: job-wide
            for rp in peer.record.ranks:
                if rp.rank not in times:
                    times[rp.rank], nodes[rp.rank] = rp.step_seconds, peer.record.node_id
        if self._peers.digest is not None:
            # The round's first member compared every rank's (this node's as published).
            found = self._peers.digest.straggler
        else:
            found = stragglers.find_straggler(times, nodes)
        if found != self._straggler:
            self._straggler, self._dirty = found, True
        move = stragglers.crossed(self._announced, found, a.straggler_threshold)
        # Job-wide, every node of the job names the same rank: the node it runs on
        # records the event (events are shared across nodes: one each, not one per node).
        if move == "above":
            self._announced = found
            if self._owns(found):
                where = found.rank_node or self.node_id or "-"
                self._record(found.rank, f"rank {found.rank} is a straggler: {found.ratio:.1f}x "
                             f"the median rank's work per step ({found.step_seconds:.3f}s vs "
                             f"{found.median_step_seconds:.3f}s, {found.ranks} ranks on "
                             f"{found.nodes} node(s); it runs on node {where}; "
                             f"agent.straggler_threshold {a.straggler_threshold:g})",
                             kind="straggler")
        elif move == "below":
            was, self._announced = self._announced, found
            ratio = f"{found.ratio:.1f}x" if found else "unknown"
            if self._owns(was):
                self._record(was.rank, f"rank {was.rank} no longer a straggler (slowest rank "
                                       f"now {ratio} the median)", kind="straggler")

    def _owns(self, s: stragglers.Straggler) -> bool:
        return not s.rank_node or s.rank_node == self.node_id

    def _save(self, now: float, learn: LearnSettings, run_dir: str, live: list) -> None:
        """Put what was learned in the job record, and the learned limits where the
        group's in-process wrappers read them: at most once per persist interval."""
        table = limits_table(self._phases, learn)
        waits = [r.waits_for for _, r, _ in live if r.waits_for is not None]
        if waits:  # the wrappers see their own phase only: while ranks wait for a
            # peer's checkpoint or section, the steady phases get its limits too
            widest = max(waits, key=lambda p: p.hard)
            files = [p if p.phase not in STEADY_PHASES or p.hard >= widest.hard
                     else PhaseLimit(p.phase, widest.soft, widest.hard, widest.learned,
                                     p.longest, p.gaps) for p in table]
        else:
            files = table
        wanted = tuple((p.phase, p.soft, p.hard) for p in files if p.learned)
        if wanted != self._table:
            try:
                self.ops.write_limits(limits_file(run_dir), encode_limits(files))
            except OSError as exc:
                log.warning("%s: cannot write the learned limits for the in-process wrapper: "
                            "%s", ctx(job=self.job_id), exc)
            self._table = wanted  # tried: again only when they change
        if not self._dirty or now - self._saved_at < self.settings.hang_learn_persist_interval:
            return
        self._dirty, self._saved_at = False, now
        s = self._straggler
        try:
            self.registry.update(self.job_id, hang_timeouts=[p.to_dict() for p in table],
                                 straggler=dict(s.to_dict(), node_id=self.node_id) if s else None)
        except Exception:  # a record that cannot be written must not stop the watch
            log.exception("%s: could not record learned hang timeouts", ctx(job=self.job_id))

    # -- actions -------------------------------------------------------------
    def _dump(self, w, path: str, uid: int, idle: float, since: str) -> str:
        rec = self.ops.read_beat(path, uid)
        target = rec.pid if rec is not None else None
        if target is None or self.ops.pgid(target) != w.pid:
            target = w.pid  # only a process of this rank's own group is ever signalled
        what = f"rank {w.rank}: no progress for {idle:.0f}s{since}"
        # SIGUSR1's default action is to terminate: only a process that handles it gets it.
        if self.ops.catches(target, signal.SIGUSR1):
            self.ops.kill(target, signal.SIGUSR1)
            return self._record(w.rank, f"{what}; stacks dumped to its log (pid {target})")
        return self._record(w.rank, f"{what}; stacks not dumped: pid {target} has no SIGUSR1 "
                                    "handler (started without elasticd's sitecustomize, or "
                                    "shutting down)")

    def _record(self, rank: int, sentence: str, kind: str = "hang") -> str:
        log.warning("%s: %s", ctx(job=self.job_id, node=self.node_id, rank=rank), sentence)
        try:
            self.registry.event(self.job_id, kind, sentence, rank=rank)
        except Exception:  # an event that cannot be written must not stop the watch
            log.exception("%s: could not record %s event", ctx(job=self.job_id), kind)
        return sentence


def _since(r: _Rank) -> str:
    if r.last_beat is None:
        return " since it started (no first step yet)"
    if r.exiting:
        return " since it began to exit"
    if not r.stepped:
        return " (no first step yet)"
    return f" in phase {r.phase}" if r.phase != contract.TRAIN else ""
