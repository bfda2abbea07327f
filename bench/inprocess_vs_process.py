"""Worker fault -> first training step after recovery: in-process vs process restart vs torchrun.

    python bench/inprocess_vs_process.py [--fault raise|exit] [--reps 3]

One script, ``python -m elasticd.examples.train_inprocess`` (2 ranks, gloo,
180 steps of 0.05 s, an in-memory snapshot every 40), whose rank 1 faults
once at step 160, under three recoveries in one invocation:

  inprocess      ``elasticctl submit --inprocess`` on a standalone elasticd
                 (default settings). --fault raise: the rank's exception is
                 caught by elasticd.inprocess.Wrapper and every rank re-enters
                 the training function in the same process. --fault exit
                 (os._exit(3)): the daemon replaces just that rank with a new
                 process (a warm spare when one is ready) that joins the
                 survivor's next in-process iteration.
  elasticd-warm  the same script submitted without --inprocess (the wrapper
                 then calls the function once): the daemon restarts the
                 node's worker group, warm spares taking over.
  torchrun       torchrun --standalone --nproc-per-node 2 --max-restarts 1
                 --monitor-interval 0.1 (c10d rendezvous), the same script.

Measured from the ``CRASH <unix time>`` line rank 1 prints just before the
fault to the first ``FIRST_STEP <unix time>`` line rank 0 prints after it
(the workers' own clock). A run counts only if it recovered by the layer it
is meant to measure, checked in the job record and the rank logs:

  inprocess      job SUCCEEDED, restarts == 0 (no process restart),
                 restarts_by_layer["inprocess"] >= 1, the first step after
                 the fault in attempt 0, iteration >= 1, and for --fault exit
                 a "replace" event for rank 1
  elasticd-warm  job SUCCEEDED, restarts >= 1 with restarts_by_layer["process"]
                 >= 1, first step after the fault in attempt 1
  torchrun       exit 0, first step after the fault in attempt 1

A run that does not pass is reported as INVALID with the reason, never as a
number. Prints medians, torchrun / this, and PASS/MISS against the design
targets (in-process >= 10x, process restart >= 2x). Never asserts a timing.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BenchDaemon, fault_marks, last_error, machine, median,  # noqa: E402
                    read_text, revision, run_each, secs, start_torchrun, stop_torchrun,
                    table, tempdir, torchrun_env)
from rows import emit_row  # noqa: E402

from elasticd.v1 import control_pb2 as pb  # noqa: E402

LAUNCHERS = ("inprocess", "elasticd-warm", "torchrun")
GOALS = {"inprocess": 10.0, "elasticd-warm": 2.0}  # torchrun / this, ../shared/DESIGN.md
SCRIPT = ["-m", "elasticd.examples.train_inprocess"]


class Run:
    def __init__(self, launcher: str, rep: int):
        self.launcher, self.rep = launcher, rep
        self.crash = self.first = None
        self.attempt = self.iteration = None
        self.invalid = ""        # why this run does not measure its layer ('' = valid)
        self.detail = ""         # what the launcher recorded (layers, events)
        self.daemon_duration = None  # the daemon's own fault -> running again
        self.busy = None

    @property
    def total(self):
        return None if self.crash is None or self.first is None else self.first - self.crash

    @property
    def ok(self) -> bool:
        return not self.invalid and self.total is not None

    def line(self) -> str:
        busy = f"; machine {self.busy:.0f} % busy before" if self.busy is not None else ""
        if not self.ok:
            return f"{self.launcher:14s} rep {self.rep}: INVALID ({self.invalid}){busy}"
        return f"{self.launcher:14s} rep {self.rep}: {secs(self.total)}  ({self.detail}{busy})"


def script_args(a) -> list[str]:
    return ["--steps", str(a.steps), "--crash-at-step", str(a.crash_at_step), "--crash-rank", "1",
            "--crash-mode", a.fault, "--checkpoint-every", str(a.checkpoint_every),
            "--step-time", str(a.step_time), "--log-every", "1000"]


def job_summary(job: pb.Job, events: list) -> tuple[dict, list, str]:
    """(restarts_by_layer, recovery events, one-line description) of a finished job."""
    layers = dict(job.restarts_by_layer)
    recov = [e for e in events if e.kind in ("replace", "restart")]
    kinds = ", ".join(f"{e.kind}[{e.layer}]" + (f" {e.duration_seconds:.3f}s"
                                                if e.duration_seconds else "") for e in recov)
    text = (f"restarts {job.restarts}, by layer {layers or '{}'}; "
            f"events: {kinds or 'none'}")
    return layers, recov, text


def run_daemon(d: BenchDaemon, run: Run, a, work: str) -> None:
    inprocess = run.launcher == "inprocess"
    job_id = d.submit([sys.executable, *SCRIPT, *script_args(a)], cwd=work, nproc=2,
                      max_restarts=1, env=torchrun_env(), inprocess=inprocess)
    try:
        job = d.wait_job(job_id, timeout=a.timeout)
    except TimeoutError as exc:
        d.cancel(job_id)
        run.invalid = str(exc)
        return
    text = d.rank_log(job_id, 0) + "\n" + d.rank_log(job_id, 1)
    run.crash, run.first, run.attempt, run.iteration = fault_marks(text)
    layers, recov, run.detail = job_summary(job, d.events(job_id))
    durations = [e.duration_seconds for e in recov if e.kind == "restart" and e.duration_seconds]
    run.daemon_duration = durations[0] if durations else None
    marks = [ln for ln in text.splitlines() if ln.startswith("==== elasticd:")]
    if inprocess:
        run.detail += f"; first step after the fault: attempt {run.attempt} iteration {run.iteration}"
        repl = [ln for ln in marks if " replacing pid " in ln]
        if repl:
            run.detail += "; replacement " + ("from a warm spare" if "from a warm spare" in
                                              repl[0] else "started cold")
    else:
        warm = sum("from a warm spare (restart 1" in ln for ln in marks)
        run.detail += f"; {warm}/2 ranks from warm spares"
    state = pb.JobState.Name(job.state)
    why = []
    if state != "SUCCEEDED":
        why.append(f"job ended {state}: {job.reason}")
    if run.crash is None or run.first is None:
        why.append(f"no CRASH/FIRST_STEP pair in the rank logs (crash {run.crash}, "
                   f"first {run.first})")
    if inprocess:
        if job.restarts != 0:
            why.append(f"a process restart happened (restarts {job.restarts})")
        if layers.get("inprocess", 0) < 1:
            why.append(f"restarts_by_layer.inprocess is {layers.get('inprocess', 0)}")
        if run.first is not None and (run.attempt != 0 or not run.iteration):
            why.append(f"first step after the fault is attempt {run.attempt} "
                       f"iteration {run.iteration}, not an in-process iteration")
        if a.fault == "exit" and not any(e.kind == "replace" and e.rank == 1 for e in recov):
            why.append("no 'replace' event for rank 1")
    else:
        if job.restarts < 1 or layers.get("process", 0) < 1:
            why.append(f"no process restart recorded (restarts {job.restarts}, by layer "
                       f"{layers})")
        if run.first is not None and run.attempt != 1:
            why.append(f"first step after the fault is in attempt {run.attempt}, not 1")
    run.invalid = "; ".join(why)


def run_torchrun(run: Run, a, work: str) -> None:
    base = os.path.join(work, f"torchrun-{run.rep}")
    proc = start_torchrun(["--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                           "--max-restarts", "1", "--monitor-interval", "0.1", *SCRIPT,
                           *script_args(a)], work, base)
    try:
        rc = proc.wait(timeout=a.timeout)
    except Exception:  # TimeoutExpired: hung
        rc = None
    stop_torchrun(proc)
    run.crash, run.first, run.attempt, run.iteration = fault_marks(read_text(base + ".out"))
    run.detail = f"exit {rc}, first step after the fault in attempt {run.attempt}"
    why = []
    if rc != 0:
        why.append(("timed out (hung)" if rc is None else f"torchrun exit {rc}")
                   + (f": {last_error(read_text(base + '.err'))}"
                      if last_error(read_text(base + ".err")) else ""))
    if run.crash is None or run.first is None:
        why.append(f"no CRASH/FIRST_STEP pair (crash {run.crash}, first {run.first})")
    elif run.attempt != 1:
        why.append(f"first step after the fault is in attempt {run.attempt}, not 1")
    run.invalid = "; ".join(why)


def report(runs: list[Run], launchers: list[str], a) -> None:
    ok = {L: [r for r in runs if r.launcher == L and r.ok] for L in launchers}
    med = {L: median([r.total for r in ok[L]]) for L in launchers}
    base = med.get("torchrun")
    print(f"\n== fault ({a.fault}) -> first step after recovery (median over valid runs) ==")
    rows = []
    for L in launchers:
        totals = [r.total for r in ok[L]]
        n = sum(r.launcher == L for r in runs)
        ratio = base / med[L] if base and med[L] else None
        goal = GOALS.get(L)
        verdict = ("-" if goal is None else "no ratio" if ratio is None else
                   f"{'PASS' if ratio >= goal else 'MISS'} (goal >= {goal:g}x)")
        rows.append([L, secs(med[L]),
                     f"{secs(min(totals))} .. {secs(max(totals))}" if totals else "-",
                     f"{len(totals)}/{n}",
                     secs(median([r.daemon_duration for r in ok[L]])),
                     f"{ratio:.1f}x" if ratio else "-", verdict])
    print(table(rows, ["recovery", "median", "min .. max", "valid", "daemon's own",
                       "torchrun / this", "target"]))
    print("  daemon's own: the restart event's duration_seconds (fault seen by the daemon "
          "or a rank ->\n  workers running again), not CRASH -> FIRST_STEP.")
    bad = [r for r in runs if not r.ok]
    if bad:
        print("\n== invalid runs (not counted) ==")
        for r in bad:
            print("  " + r.line())
    if "inprocess" in launchers:  # the README's row: torchrun has no setting to match here
        ours = med["inprocess"]
        emit_row(f"inprocess-{a.fault}",
                 elasticd=f"{secs(ours)} ({len(ok['inprocess'])} valid runs, median)",
                 torch=f"{secs(base)} (torchrun)" if base else "not run",
                 ratio=f"{base / ours:.0f}x" if base and ours else "-")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fault", choices=("raise", "exit"), default="raise",
                    help="raise: rank 1 raises; exit: rank 1's process dies (os._exit(3))")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--launchers", default=",".join(LAUNCHERS),
                    help=f"comma list from {', '.join(LAUNCHERS)}")
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--crash-at-step", type=int, default=160)
    ap.add_argument("--checkpoint-every", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each run wait up to this many seconds for the machine to "
                         "be under --quiet-threshold %% busy (0: don't)")
    ap.add_argument("--quiet-threshold", type=float, default=30.0)
    a = ap.parse_args(argv)
    launchers = [x.strip() for x in a.launchers.split(",") if x.strip()]
    for L in launchers:
        if L not in LAUNCHERS:
            ap.error(f"unknown launcher {L!r}")
    print(f"machine: {machine()}\nelasticd: {revision()}")
    print(f"job: 2 ranks, gloo, python {' '.join(SCRIPT + script_args(a))}; fault {a.fault}; "
          f"daemon at default settings")
    work = tempdir("edb-inp-")
    daemon = BenchDaemon(slots=4) if set(launchers) - {"torchrun"} else None

    def run_one(name: str, rep: int, busy) -> Run:
        run = Run(name, rep)
        run.busy = busy
        if name == "torchrun":
            run_torchrun(run, a, work)
        else:
            run_daemon(daemon, run, a, work)
        return run

    try:
        if daemon:
            daemon.start()
        runs = run_each(launchers, a.reps, run_one, a.quiet_wait, a.quiet_threshold)
    finally:
        if daemon:
            daemon.stop()
    report(runs, launchers, a)
    print(f"\nmachine after: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
