"""The safety checker of the netcluster tests: always on, run after every test.

Workers (netcluster_train.py) append one JSON line per start, step, end to
a report file; a monitor thread here reads it as it grows and watches each
reported pid, so it knows every worker's life: [its "start" record, the last
time it was seen alive]. It errs towards short lives (a worker is known
late and counted dead at its last sighting), so an overlap it finds is real.

``check()`` asserts, for every job the test submitted:
1. no two rounds at once: workers of different rounds on different hosts
   with the same rank never both trained at the same time (split brain: their
   first-to-last step spans never overlap); a worker of an older round never
   lived beside a newer round's same rank longer than the collective timeout
   plus twice the grace (the measured worst is in the numbers:
   ``stale_overlap_max_s``); and no host started a round it had already run;
2. no rank held twice: two processes of one round, or of one host, with the
   same rank were never alive at the same time;
3. sums right: every step's all_reduce was right, and a SUCCEEDED job's last
   round ended with "done" on every rank at the full step count;
4. stop in time: no worker lived longer than its daemon's decision to end
   its round (the state event that left RUNNING on that host) plus the stop
   grace (and a second of slack for the monitor and a loaded machine);
5. nothing lost: every live daemon holds the job's record, in the same end
   state as the submitting one; each host's own state events form one
   unbroken chain; every host's own events are mirrored on every other.
It returns the numbers the tests print: rounds, restarts, longest gap
without a training step.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

import psutil

from elasticd.v1 import control_pb2 as pb

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
SLACK = 1.0  # seconds: monitor tick, scheduling on a loaded 2-core machine


@dataclass
class Life:
    job: str
    round: int
    rank: int
    host: str
    pid: int
    start: float
    last_seen: float
    created: float | None = None
    dead: bool = False
    records: dict = field(default_factory=dict)   # the first record of each kind
    last_step: float | None = None


class Safety:
    def __init__(self, cluster):
        self.cluster = cluster
        self.jobs: dict[str, tuple[str, int]] = {}    # job -> (submitted on, steps)
        self.lives: dict[int, Life] = {}
        self.all: list[dict] = []
        self._offset = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ed19-safety", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def watch_job(self, job_id: str, on: str, steps: int) -> None:
        self.jobs[job_id] = (on, steps)

    # -- the monitor -----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.poll()

    def poll(self) -> None:
        with self._lock:
            self._read()
            now = time.time()
            for life in self.lives.values():
                if life.dead:
                    continue
                try:
                    p = psutil.Process(life.pid)
                    if life.created is None:
                        life.created = p.create_time()
                    if p.create_time() != life.created or p.status() == psutil.STATUS_ZOMBIE:
                        raise psutil.NoSuchProcess(life.pid)
                    life.last_seen = now
                except psutil.NoSuchProcess:
                    life.dead = True

    def _read(self) -> None:
        try:
            with open(self.cluster.report, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            rec = json.loads(line)
            self.all.append(rec)
            if rec["ev"] == "start":
                self.lives[rec["pid"]] = Life(rec["job"], rec["round"], rec["rank"], rec["host"],
                                              rec["pid"], rec["t"], rec["t"])
            life = self.lives.get(rec["pid"])
            if life is not None:
                life.records.setdefault(rec["ev"], rec)
                life.last_seen = max(life.last_seen, rec["t"])
                if rec["ev"] == "step":
                    life.last_step = rec["t"]

    def records(self, job_id: str, ev: str) -> list[dict]:
        with self._lock:
            self._read()
            return [r for r in self.all if r["job"] == job_id and r["ev"] == ev]

    # -- the checks ------------------------------------------------------------
    def check(self, settle: float = 20.0) -> dict:
        """Assert the five properties for every submitted job; returns numbers."""
        self.poll()
        problems: list[str] = []
        stats: dict = {}
        for job_id, (on, steps) in self.jobs.items():
            lives = [lf for lf in self.lives.values() if lf.job == job_id]
            problems += self._overlaps(job_id, lives)
            problems += self._sums(job_id, on, steps, lives)
            own = self._own_events(job_id, settle)
            problems += self._rounds_once(job_id, own)
            problems += self._stopped_in_time(job_id, lives, own)
            problems += self._nothing_lost(job_id, on, own, settle)
            stats[job_id] = self._numbers(job_id, lives, own)
        assert not problems, "safety violated:\n  " + "\n  ".join(problems)
        return stats

    @staticmethod
    def active_until(lf: Life) -> float:
        """A worker takes part in its round from its start until it reports
        that it left (its collective failed, or it finished) or dies; after
        that it is only exiting (torch's teardown can take seconds)."""
        left = [lf.records[ev]["t"] for ev in ("error", "done") if ev in lf.records]
        return min([lf.last_seen, *left])

    def lingering(self, job_id: str) -> float:
        """Longest time a worker stayed alive after it reported it had left."""
        return max((lf.last_seen - self.active_until(lf) for lf in self.lives.values()
                    if lf.job == job_id), default=0.0)

    def stale_overlap(self, job_id: str) -> float:
        """Longest time a worker of an older round was alive while a newer round
        ran the same rank on another host: a host cut off from etcd learns late
        that its round is over; its worker goes when its collective (or its
        init) times out, or when its daemon sees the new round."""
        lives = [lf for lf in self.lives.values() if lf.job == job_id]
        worst = 0.0
        for a in lives:
            for b in lives:
                if a.rank == b.rank and a.host != b.host and a.round < b.round:
                    worst = max(worst, min(a.last_seen, b.last_seen) - max(a.start, b.start))
        return worst

    def _overlaps(self, job_id: str, lives: list[Life]) -> list[str]:
        out = []
        for i, a in enumerate(lives):
            for b in lives[i + 1:]:
                if a.rank != b.rank:
                    continue
                what = (f"job {job_id} rank {a.rank}: pid {a.pid} (round {a.round} on {a.host},"
                        f" {a.start:.2f}..{a.last_seen:.2f}, steps "
                        f"{a.records.get('step', {}).get('t', 0):.2f}..{a.last_step or 0:.2f}) "
                        f"and pid {b.pid} (round {b.round} on {b.host}, {b.start:.2f}.."
                        f"{b.last_seen:.2f}, steps {b.records.get('step', {}).get('t', 0):.2f}"
                        f"..{b.last_step or 0:.2f})")
                if a.round == b.round or a.host == b.host:
                    # one round, or one host: the same rank may never live twice at once
                    both = min(a.last_seen, b.last_seen) - max(a.start, b.start)
                    if both > 0:
                        out.append(f"(2) rank held twice, alive together {both:.2f}s: {what}")
                elif a.last_step is not None and b.last_step is not None:
                    # two rounds on two hosts: they may never both train
                    both = (min(a.last_step, b.last_step)
                            - max(a.records["step"]["t"], b.records["step"]["t"]))
                    if both >= 0:
                        out.append(f"(1) two rounds trained at once for {both:.2f}s: {what}")
        stale = self.stale_overlap(job_id)
        bound = self.cluster.collective_timeout + 2 * self.grace + SLACK
        if stale > bound:
            out.append(f"(1) job {job_id}: a worker of an older round lived {stale:.1f}s beside "
                       f"a newer round's same rank (bound {bound:g}s: collective timeout + "
                       f"twice the grace)")
        return out

    def _sums(self, job_id: str, on: str, steps: int, lives: list[Life]) -> list[str]:
        bad = [r for r in self.all if r["job"] == job_id and r["ev"] == "step" and not r["ok"]]
        out = [f"(3) job {job_id}: wrong all_reduce sum at step {r['step']} rank {r['rank']} "
               f"round {r['round']}" for r in bad[:5]]
        job = self.cluster.daemons[on].job(job_id)
        if pb.JobState.Name(job.state) == "SUCCEEDED":
            last = max(lf.round for lf in lives)
            done = sorted(r["rank"] for r in self.all if r["job"] == job_id
                          and r["ev"] == "done" and r["round"] == last and r["step"] == steps)
            world = {lf.records["start"]["world"] for lf in lives if lf.round == last}
            if len(world) != 1 or done != list(range(world.pop())):
                out.append(f"(3) job {job_id} SUCCEEDED but its last round {last} has 'done' "
                           f"at step {steps} from ranks {done} only")
        return out

    def _own_events(self, job_id: str, settle: float) -> dict[str, list]:
        """Each reachable host's own events for the job, from its own daemon."""
        own = {}
        for host, d in self.cluster.daemons.items():
            if d.proc is None or d.proc.poll() is not None:
                continue
            try:
                own[host] = [e for e in d.events(job_id) if e.node_id == host]
            except Exception:  # noqa: BLE001 - a host that never heard of the job
                own[host] = []
        return own

    def _rounds_once(self, job_id: str, own: dict) -> list[str]:
        """(1) also: a host never starts workers for a round it already ran (its
        peers have moved on: that rank would run beside the next round)."""
        out = []
        for host, evs in own.items():
            ran = [e.round for e in evs if e.kind == "state"
                   and pb.JobState.Name(e.to_state) == "RUNNING"]
            again = [r for i, r in enumerate(ran) if any(r <= p for p in ran[:i])]
            if again:
                out.append(f"(1) job {job_id}: {host} ran round(s) {again} again after "
                           f"running rounds {ran}")
        return out

    @property
    def grace(self) -> float:
        return float(self.cluster.settings["agent.stop_grace_period"])

    def _stopped_in_time(self, job_id: str, lives: list[Life], own: dict) -> list[str]:
        grace = self.grace
        out = []
        for lf in lives:
            evs = own.get(lf.host)
            if evs is None:
                continue
            ends = [e.time for e in evs if e.kind == "state" and e.time > lf.start
                    and pb.JobState.Name(e.from_state) == "RUNNING"]
            if ends and lf.last_seen > ends[0] + grace + SLACK:
                out.append(f"(4) job {job_id}: pid {lf.pid} (rank {lf.rank} round {lf.round} on "
                           f"{lf.host}) alive {lf.last_seen - ends[0]:.1f}s after its daemon "
                           f"ended the round (grace {grace:g}s)")
        return out

    def _nothing_lost(self, job_id: str, on: str, own: dict, settle: float) -> list[str]:
        out = []
        want = pb.JobState.Name(self.cluster.daemons[on].job(job_id).state)
        for host, evs in own.items():
            states = [e for e in evs if e.kind == "state"]
            for prev, nxt in zip(states, states[1:]):
                if nxt.from_state != prev.to_state:
                    out.append(f"(5) job {job_id} on {host}: state events jump from "
                               f"{pb.JobState.Name(prev.to_state)} to a move out of "
                               f"{pb.JobState.Name(nxt.from_state)}: an event is missing")
            if states:  # every host that took part ends in the same state (give it time)
                deadline = time.monotonic() + settle
                while True:
                    got = pb.JobState.Name(self.cluster.daemons[host].job(job_id).state)
                    if got == want or time.monotonic() >= deadline:
                        break
                    time.sleep(0.2)
                if got != want:
                    out.append(f"(5) job {job_id}: {host} says {got}, {on} says {want}")
        # Every host's own events end up on every other host (mirrored via etcd).
        deadline = time.monotonic() + settle
        while True:
            missing = []
            for host, evs in own.items():
                mine = {(e.kind, round(e.time, 3), e.reason) for e in evs}
                for other in own:
                    if other == host:
                        continue
                    seen = {(e.kind, round(e.time, 3), e.reason)
                            for e in self.cluster.daemons[other].events(job_id)
                            if e.node_id == host}
                    if mine - seen:
                        missing.append(f"(5) job {job_id}: {len(mine - seen)} of {host}'s "
                                       f"events never reached {other}")
            if not missing or time.monotonic() >= deadline:
                return out + missing
            time.sleep(0.5)

    def _numbers(self, job_id: str, lives: list[Life], own: dict) -> dict:
        steps = sorted(r["t"] for r in self.all if r["job"] == job_id and r["ev"] == "step"
                       and r["rank"] == 0)
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        recoveries = {(e.round, e.layer or "?") for evs in own.values() for e in evs
                      if e.kind == "restart"}   # each node reports a recovery: count it once
        restarts: dict[str, int] = {}
        for _, layer in recoveries:
            restarts[layer] = restarts.get(layer, 0) + 1
        return {"rounds": len({lf.round for lf in lives}), "workers": len(lives),
                "exit_after_leaving_max_s": round(self.lingering(job_id), 2),
                "stale_overlap_max_s": round(self.stale_overlap(job_id), 2),
                "steps": len(steps), "max_gap_s": round(max(gaps, default=0.0), 2),
                "restart_events_by_layer": restarts}

    def first_step_after(self, job_id: str, t: float) -> float | None:
        """Seconds from ``t`` to the first rank-0 step after it (None if none)."""
        later = [r["t"] for r in self.records(job_id, "step") if r["rank"] == 0 and r["t"] > t]
        return (min(later) - t) if later else None

    def first_new_round_step(self, job_id: str, t: float) -> float | None:
        """Seconds from ``t`` to the first step of a round later than the one
        training at ``t`` (None if no later round trained)."""
        steps = self.records(job_id, "step")
        before = [r["round"] for r in steps if r["t"] <= t]
        if not before:
            return None
        later = [r["t"] for r in steps if r["round"] > max(before)]
        return (min(later) - t) if later else None
