"""Goodput under repeated faults: elasticd vs torchrun, a worker SIGKILLed every 10 s.

    python bench/goodput.py                       # 90 s per run, 6 runs: about 10 minutes
    python bench/goodput.py --duration 40 --launchers elasticd,torchrun

Goodput is the share of the training a job does with faults of what the same
job does without faults in the same time: the step it has reached when the
run ends, over the step the fault-free run of the same launcher reached.

The job, under each launcher, 2 ranks on this node, gloo:

    python -m elasticd.examples.train --steps 1000000 --step-time 0.05
        --checkpoint-every 20 --log-every 1 --checkpoint-dir DIR

(0.05 s steps, a disk checkpoint every 20 steps, resumed at every start).
Each launcher runs it twice in the same invocation, ``--duration`` seconds
from launch each: once with no faults, once while a random worker (seeded,
the same sequence for every launcher) is SIGKILLed every ``--fault-every``
seconds, the first that long after the job's first training step (so a slow
cold start on a busy machine is not hit while it imports torch). A kill that
finds no running worker (a restart under way) waits for one, at most
``--fault-every`` seconds.

Launchers:
  torchrun      torchrun --standalone --nnodes 1 --nproc-per-node 2
                --max-restarts 100 --monitor-interval 0.1 -m elasticd.examples.train ...
                (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see restart_vs_torchrun.py)
  elasticd      python -m elasticd --standalone, default settings; the job
                submitted with --max-restarts-per-window 100 (the default of 10
                per hour is spent by a fault every 10 s for longer than 100 s:
                that is what it is for)
  elasticd-old  the same, with the settings that reproduce the restart
                policy before issue 22: agent.progress_min_beats and
                agent.progress_min_runtime at their maxima (no attempt counts
                as progress, so the backoff grows with every restart: 0, 0.5,
                1, 2, ... 30 s) and agent.warm_spare_restart_delay = 3
                (spares refilled 3 s after every start)

Printed per launcher: steps without and with faults, goodput, restarts,
faults injected, the mean time from a kill to the first training step after
it (the worker's FIRST_STEP line; same clock), and the steps lost to
rollback (the step reached before each fault minus the checkpoint step the
next attempt resumed from). Never asserts a timing.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BenchDaemon, machine, read_text, revision, start_torchrun,  # noqa: E402
                    stop_torchrun, table, tempdir, torchrun_env)

LAUNCHERS = ("torchrun", "elasticd", "elasticd-old")
OLD_POLICY = {"ELASTICD_AGENT_PROGRESS_MIN_BEATS": "1000000",
              "ELASTICD_AGENT_PROGRESS_MIN_RUNTIME": str(30 * 86400),
              "ELASTICD_AGENT_WARM_SPARE_RESTART_DELAY": "3.0"}
ATTEMPT_RE = re.compile(r"^attempt (\d+): world size \d+, starting at step (\d+)$")
FIRST_RE = re.compile(r"^FIRST_STEP (\d+\.\d+) attempt=(\d+) step=(\d+)")
STEP_RE = re.compile(r"^step (\d+)/\d+ loss")


@dataclass
class Run:
    launcher: str
    faults: bool
    kills: list = field(default_factory=list)      # unix times of the SIGKILLs
    skipped: int = 0                               # kills that found no worker in time
    final_step: int = 0
    restarts: int = 0
    lost: int = 0                                  # steps rolled back
    recover: list = field(default_factory=list)    # kill -> first step after it (s)
    error: str = ""


def train_args(ckpt: str) -> list[str]:
    return ["--steps", "1000000", "--step-time", "0.05", "--checkpoint-every", "20",
            "--log-every", "1", "--checkpoint-dir", ckpt]


def parse(run: Run, text: str) -> None:
    """Steps reached, restarts, rollback and recovery times from rank 0's output."""
    last = 0
    attempts = 0
    firsts = []
    for line in text.splitlines():
        m = STEP_RE.match(line)
        if m:
            last = max(last, int(m.group(1)))
            continue
        m = ATTEMPT_RE.match(line)
        if m:
            attempts = max(attempts, int(m.group(1)))
            start = int(m.group(2))
            if int(m.group(1)) > 0:
                run.lost += max(0, last - start)
            last = start
            continue
        m = FIRST_RE.match(line)
        if m:
            firsts.append(float(m.group(1)))
    run.final_step = last
    run.restarts = max(run.restarts, attempts)
    for k in run.kills:
        after = [t for t in firsts if t > k]
        if after:
            run.recover.append(after[0] - k)


class Faults:
    """SIGKILL a random running worker every ``every`` seconds."""

    def __init__(self, every: float, seed: int):
        self.every = every
        self.rng = random.Random(seed)

    def drive(self, run: Run, t0: float, duration: float, workers, log_path: str) -> None:
        """Until t0 + duration: kill one of ``workers()`` (pids) at each fault time,
        the first ``every`` seconds after rank 0 wrote its first FIRST_STEP line."""
        next_at = None
        while time.time() < t0 + duration:
            if next_at is None and run.faults and "FIRST_STEP" in read_text(log_path):
                next_at = time.time() + self.every
            if next_at is None or time.time() < next_at:
                time.sleep(0.05)
                continue
            pids = workers()
            if pids:
                pid = self.rng.choice(sorted(pids))
                try:
                    os.kill(pid, signal.SIGKILL)
                    run.kills.append(time.time())
                except ProcessLookupError:
                    continue
                next_at += self.every
            elif time.time() > next_at + self.every:
                run.skipped += 1
                next_at += self.every
            else:
                time.sleep(0.02)


def run_torchrun(run: Run, a, work: str, faults: Faults) -> None:
    tag = f"{run.launcher}-{int(run.faults)}"
    ckpt = os.path.join(work, f"ckpt-{tag}")
    base = os.path.join(work, tag)
    t0 = time.time()
    proc = start_torchrun(["--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                           "--max-restarts", "100", "--monitor-interval", "0.1",
                           "-m", "elasticd.examples.train", *train_args(ckpt)],
                          work, base, env=torchrun_env())

    def workers():
        try:
            kids = psutil.Process(proc.pid).children()
        except psutil.Error:
            return []
        out = []
        for p in kids:
            try:
                if "elasticd.examples.train" in " ".join(p.cmdline()) and p.status() != "zombie":
                    out.append(p.pid)
            except psutil.Error:
                pass
        return out

    faults.drive(run, t0, a.duration, workers, base + ".out")
    stop_torchrun(proc)
    parse(run, read_text(base + ".out"))
    if run.final_step == 0:
        run.error = "no step reached: " + read_text(base + ".err")[-500:]


def run_elasticd(run: Run, a, work: str, faults: Faults) -> None:
    from elasticd.v1 import control_pb2 as pb
    env = dict(os.environ, **(OLD_POLICY if run.launcher == "elasticd-old" else {}))
    d = BenchDaemon(tempdir("edg-"), slots=4, env=env)
    d.start()
    ckpt = os.path.join(work, f"ckpt-{run.launcher}-{int(run.faults)}")
    try:
        t0 = time.time()
        req = pb.SubmitRequest(command=[sys.executable, "-m", "elasticd.examples.train",
                                        *train_args(ckpt)],
                               cwd=work, env=torchrun_env(), nproc_per_node=2,
                               max_restarts=-1, max_restarts_per_window=100)
        job_id = d.client().call("Submit", req).job.id

        def workers():
            job = d.get_job(job_id)
            if pb.JobState.Name(job.state) != "RUNNING":
                return []
            return [w.pid for w in job.workers if w.state == "running" and w.pid]

        log0 = os.path.join(d.state_dir, "logs", job_id, "rank-0.log")
        faults.drive(run, t0, a.duration, workers, log0)
        job = d.get_job(job_id)
        run.restarts = job.restarts
        if pb.JobState.Name(job.state) in ("FAILED", "SUCCEEDED"):
            run.error = f"job ended {pb.JobState.Name(job.state)}: {job.reason}"
        d.cancel(job_id)
        parse(run, d.rank_log(job_id, 0))
        run.restarts = job.restarts
    finally:
        d.stop()


def report(runs: list[Run], launchers: list[str], a) -> None:
    print(f"\n== goodput: {a.duration:g} s per run, a random worker SIGKILLed every "
          f"{a.fault_every:g} s ==")
    rows = []
    for L in launchers:
        base = next((r for r in runs if r.launcher == L and not r.faults), None)
        hit = next((r for r in runs if r.launcher == L and r.faults), None)
        if base is None or hit is None:
            continue
        good = hit.final_step / base.final_step if base.final_step else 0.0
        rec = (sum(hit.recover) / len(hit.recover)) if hit.recover else None
        rows.append([L, base.final_step, hit.final_step, f"{100 * good:.0f} %",
                     hit.restarts, f"{len(hit.kills)}" + (f" ({hit.skipped} skipped)"
                                                           if hit.skipped else ""),
                     f"{rec:.2f} s" if rec is not None else "-", hit.lost,
                     hit.error or base.error or ""])
    print(table(rows, ["launcher", "steps, no faults", "steps, faults", "goodput",
                       "restarts", "faults", "fault -> training", "steps lost to rollback",
                       "error"]))
    good = {r[0]: float(r[3].rstrip(" %")) for r in rows}
    if "elasticd" in good:
        print(f"\ngoal: elasticd >= 90 %: {'PASS' if good['elasticd'] >= 90 else 'MISS'}"
              + (f"; torchrun {good['torchrun']:.0f} %, elasticd ahead by "
                 f"{good['elasticd'] - good['torchrun']:.0f} points" if "torchrun" in good
                 else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=90.0, help="seconds per run (90)")
    ap.add_argument("--fault-every", type=float, default=10.0, help="seconds between kills")
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    a = ap.parse_args(argv)
    launchers = [L for L in a.launchers.split(",") if L]
    bad = [L for L in launchers if L not in LAUNCHERS]
    if bad:
        ap.error(f"unknown launcher(s) {bad}; pick from {LAUNCHERS}")
    print(f"goodput.py  {datetime.datetime.now():%Y-%m-%d %H:%M}  rev {revision()}  "
          f"{machine()}")
    work = tempdir("goodput-")
    runs = []
    for L in launchers:
        for with_faults in (False, True):
            run = Run(L, with_faults)
            faults = Faults(a.fault_every, a.seed)
            started = time.time()
            try:
                (run_torchrun if L == "torchrun" else run_elasticd)(run, a, work, faults)
            except Exception as exc:  # report it, go on with the others
                run.error = f"{type(exc).__name__}: {exc}"
            print(f"  {L:13s} {'faults' if with_faults else 'no faults':9s}: step "
                  f"{run.final_step}, {len(run.kills)} kills, restarts {run.restarts}, "
                  f"lost {run.lost}, fault -> training "
                  f"[{', '.join(f'{t:.1f}' for t in run.recover)}] s  "
                  f"({time.time() - started:.0f} s)"
                  + (f"  ERROR {run.error}" if run.error else ""), flush=True)
            runs.append(run)
    report(runs, launchers, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
