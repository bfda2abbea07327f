"""A hung rank -> detected -> killed -> first training step after recovery, at default settings.

    python bench/hang_recovery.py                  # default settings: about 10 minutes
    python bench/hang_recovery.py --quick          # shorter timeouts (NOT the defaults): ~2 min
    python bench/hang_recovery.py --modes inprocess --reps 2 --set agent.hang_hard_timeout=30

One script, ``python -m elasticd.examples.train_inprocess --crash-mode hang``
(2 ranks, gloo, 180 steps of 0.05 s, an in-memory snapshot every 40): at
step 160 rank 1 prints ``CRASH <unix time>`` and sleeps for an hour in C
(``time.sleep``), so rank 0 blocks in its next all_reduce. Under:

  inprocess  ``elasticctl submit --inprocess`` on a standalone elasticd. The
             daemon's hang detection and the in-process wrapper's own stall
             check both watch, with the timeouts the daemon learned from the
             job's 0.05 s steps (at defaults: max(agent.hang_learn_floor 10 s,
             5 x the longest gap): dump at 5 s, kill at 10 s; the wrapper
             stops the iteration at 5 s and a rank not back in Python ends
             itself 5 s later); the fixed ones (agent.hang_soft_timeout 60 s /
             hang_hard_timeout 180 s, inprocess.soft_timeout 60 s /
             hard_timeout 90 s) are only the upper bound now. The ended rank
             is replaced by a new process that joins the survivor's next
             in-process iteration.
  process    the same script submitted without --inprocess (the wrapper then
             just calls the function): after the kill the daemon restarts the
             worker group (process restart, warm spares).
  torchrun   torchrun --max-restarts 1 --monitor-interval 0.1, same script.
             torchrun has no hang detection: a rank asleep in C is alive to it,
             and the blocked gloo collective only fails at its timeout. The run
             is watched for ``--torchrun-window`` seconds (240) after CRASH,
             then killed: "no recovery within N s"; its bound is the collective timeout.

Before this change (tree fd83a09 and earlier) the same defaults meant a
fixed 180 s kill (process restart: first step 180.47 s after CRASH, tree
9d9e8d1) and 90 s in-process (rank 1 ends itself at inprocess.hard_timeout:
90.14 s, tree 2aafa7f): bench/README.md. The report prints the ratios
against those and against NVIDIA's in-process wrapper defaults (60 s soft /
90 s hard: a hang is not even noticed before 60 s).

The collective timeout: without --inprocess the sample's wrapper builds the
process group with ``inprocess.hard_timeout`` (90 s) as its timeout, so rank
0's blocked all_reduce would fail at 90 s and end the hang for the process
and torchrun runs, whatever the launcher's hang detection. Those two runs
get ``--collective-timeout`` (default 1800 s, torch's default for gloo:
ELASTICD_INPROCESS_HARD_TIMEOUT in their environment) so that what is timed
is the launcher's own handling of a hang; ``--collective-timeout 0`` keeps the
sample's 90 s. The inprocess run keeps what the daemon gives it (defaults).

For the daemon runs, the timeline comes from the job's events (the daemon's
clock, same machine) and the rank logs (the workers' clock): CRASH -> first
"stacks dumped" hang event -> first "killed" hang event -> the recovery
(replace / restart event, with its layer) -> first FIRST_STEP after CRASH. A
run is valid only if it recovered by the layer it is meant to show (job
restarts == 0 and restarts_by_layer.inprocess >= 1 for inprocess;
restarts >= 1 with restarts_by_layer.process >= 1 for process); otherwise it
is reported INVALID with what did happen. Settings are printed; --quick and
--set change them and the output says so. Never asserts a timing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BenchDaemon, fault_marks, machine, read_text, revision,  # noqa: E402
                    run_each, secs, start_torchrun, stop_torchrun, table, tempdir,
                    torchrun_env)
from rows import emit_row  # noqa: E402

from elasticd import config  # noqa: E402
from elasticd.v1 import control_pb2 as pb  # noqa: E402

MODES = ("inprocess", "process", "torchrun")
# Before the learned timeouts, same defaults and script (bench/README.md): seconds from
# CRASH to the first step after recovery.
BEFORE = {"process": (180.47, "tree 9d9e8d1, agent.hang_hard_timeout 180 s"),
          "inprocess": (90.14, "tree 2aafa7f, inprocess.hard_timeout 90 s")}
NVRX_SOFT = 60.0  # NVIDIA resiliency-ext in-process wrapper: default soft timeout (s)
SCRIPT = ["-m", "elasticd.examples.train_inprocess"]
QUICK = ("agent.hang_soft_timeout=5", "agent.hang_hard_timeout=15", "inprocess.soft_timeout=5")
WATCHED = ("agent.hang_learn_floor", "agent.hang_learn_factor", "agent.hang_learn_warmup",
           "agent.hang_soft_timeout", "agent.hang_hard_timeout", "agent.first_step_timeout",
           "inprocess.soft_timeout", "inprocess.hard_timeout", "inprocess.barrier_timeout")


class Run:
    def __init__(self, mode: str, rep: int):
        self.mode, self.rep = mode, rep
        self.crash = self.first = self.attempt = self.iteration = None
        self.dumped = self.killed = None  # unix times (the daemon's hang events)
        self.recoveries: list[tuple[float, str]] = []  # replace / restart events
        self.timeline: list[tuple[float, str]] = []
        self.invalid = ""
        self.note = ""
        self.busy = None
        self.learned = ""  # the job's learned timeouts at the end (elasticctl status)

    def rel(self, t):
        return None if t is None or self.crash is None else t - self.crash

    @property
    def total(self):
        return self.rel(self.first)

    def recovery_text(self) -> str:
        return ", ".join(f"{what} {secs(self.rel(t))}" for t, what in self.recoveries) or "-"

    def line(self) -> str:
        busy = f"; machine {self.busy:.0f} % busy before" if self.busy is not None else ""
        if self.mode == "torchrun":
            return f"{self.mode:10s} rep {self.rep}: {self.note}{busy}"
        head = (f"INVALID ({self.invalid}); " if self.invalid else "")
        return (f"{self.mode:10s} rep {self.rep}: {head}CRASH -> stacks dumped "
                f"{secs(self.rel(self.dumped))} -> killed {secs(self.rel(self.killed))} -> "
                f"{self.recovery_text()} -> "
                f"first step {secs(self.total)}; learned: {self.learned or '-'}{busy}")


def script_args(a) -> list[str]:
    return ["--steps", str(a.steps), "--crash-at-step", str(a.crash_at_step), "--crash-rank", "1",
            "--crash-mode", "hang", "--checkpoint-every", str(a.checkpoint_every),
            "--step-time", str(a.step_time), "--log-every", "1000"]


def effective_settings(sets: list[str]) -> dict:
    """The daemon settings that matter here, after the --set overrides (validated)."""
    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise config.ConfigError([f"--set {item!r}: expected SECTION.NAME=VALUE"])
        overrides[key.strip()] = value
    cfg = config.load(None, overrides=overrides)  # what the benchmark's daemon will read
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in WATCHED}


def job_env(a, mode: str) -> dict:
    env = torchrun_env()
    if mode != "inprocess" and a.collective_timeout:
        env["ELASTICD_INPROCESS_HARD_TIMEOUT"] = f"{a.collective_timeout:g}"
        env["ELASTICD_INPROCESS_BARRIER_TIMEOUT"] = f"{a.collective_timeout + 60:g}"
    return env


def run_daemon(d: BenchDaemon, run: Run, a, work: str) -> None:
    job_id = d.submit([sys.executable, *SCRIPT, *script_args(a)], cwd=work, nproc=2,
                      max_restarts=1, env=job_env(a, run.mode),
                      inprocess=run.mode == "inprocess")
    try:
        job = d.wait_job(job_id, timeout=a.timeout)
    except TimeoutError as exc:
        d.cancel(job_id)
        job = d.get_job(job_id)
        run.invalid = f"cancelled by the benchmark: {exc}"
    text = d.rank_log(job_id, 0) + "\n" + d.rank_log(job_id, 1)
    run.crash, run.first, run.attempt, run.iteration = fault_marks(text)
    events = [e for e in d.events(job_id) if run.crash is None or e.time >= run.crash - 1]
    for e in events:
        what = e.kind + (f"[{e.layer}]" if e.layer else "")
        if e.kind == "state":
            what += f" -> {pb.JobState.Name(e.to_state)}"
        run.timeline.append((e.time, f"{what}: {e.reason}"))
        if e.kind == "hang" and "stacks" in e.reason and run.dumped is None:
            run.dumped = e.time
        # the daemon killed it, or its in-process wrapper ended it (not back in Python)
        if e.kind == "hang" and ("killed" in e.reason or "ending the process" in e.reason) \
                and run.killed is None:
            run.killed = e.time
        if e.kind in ("replace", "restart"):
            run.recoveries.append((e.time, f"{e.kind}[{e.layer}]"))
    if run.first is not None:
        run.timeline.append((run.first, f"FIRST_STEP attempt={run.attempt} "
                                        f"iteration={run.iteration} (rank 0)"))
    run.timeline.sort()
    layers = dict(job.restarts_by_layer)
    run.learned = ", ".join(f"{p.phase} kill {p.hard_seconds:g}s (dump {p.soft_seconds:g}s, "
                            f"longest gap {p.longest_gap_seconds:.2f}s)"
                            for p in job.hang_timeouts if p.learned)
    why = [run.invalid] if run.invalid else []
    state = pb.JobState.Name(job.state)
    if state != "SUCCEEDED" and not why:
        why.append(f"job ended {state}: {job.reason}")
    if run.crash is None or run.first is None:
        why.append(f"no CRASH/FIRST_STEP pair (crash {run.crash}, first {run.first})")
    if run.mode == "inprocess" and (job.restarts != 0 or layers.get("inprocess", 0) < 1):
        why.append(f"not recovered in-process (restarts {job.restarts}, by layer {layers})")
    if run.mode == "process" and (job.restarts < 1 or layers.get("process", 0) < 1):
        why.append(f"no process restart (restarts {job.restarts}, by layer {layers})")
    if run.mode == "process" and run.killed is None and run.recoveries:
        why.append("recovered without a hang kill (see the restart's cause: e.g. the "
                   "collective timed out first)")
    run.invalid = "; ".join(why)
    run.note = f"restarts {job.restarts}, by layer {layers}"


def run_torchrun(run: Run, a, work: str) -> None:
    base = os.path.join(work, f"torchrun-{run.rep}")
    proc = start_torchrun(["--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                           "--max-restarts", "1", "--monitor-interval", "0.1", *SCRIPT,
                           *script_args(a)], work, base, env=job_env(a, run.mode))
    try:
        start = time.monotonic()
        while run.crash is None and proc.poll() is None and time.monotonic() - start < a.timeout:
            time.sleep(0.2)
            run.crash = fault_marks(read_text(base + ".out"))[0]
        if run.crash is None:
            run.note = f"INVALID (no CRASH line; torchrun exit {proc.poll()})"
            return
        while proc.poll() is None and time.time() < run.crash + a.torchrun_window:
            time.sleep(0.5)
            run.first = fault_marks(read_text(base + ".out"))[1]
            if run.first is not None:
                break
        _, run.first, run.attempt, _ = fault_marks(read_text(base + ".out"))
        rc = proc.poll()
    finally:
        stop_torchrun(proc)
    if run.first is not None:
        run.note = (f"recovered: first step {secs(run.total)} after CRASH "
                    f"(attempt {run.attempt})")
    elif rc is not None:
        run.note = f"torchrun exited {rc} without a step after CRASH"
    else:
        run.note = (f"no recovery within {a.torchrun_window:g} s of CRASH (still running, "
                    f"killed by the benchmark)")


def report(runs: list[Run], a, settings: dict) -> None:
    print("\n== timelines (seconds after CRASH; events on the daemon's clock, FIRST_STEP on "
          "the workers') ==")
    for r in runs:
        if not r.timeline:
            continue
        print(f"  {r.mode} rep {r.rep}:")
        for t, what in r.timeline:
            print(f"    {r.rel(t):+9.3f} s  {what[:150]}")
    print("\n== hang -> recovery (each run; settings: "
          + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in settings.items()) + ") ==")
    rows = []
    for r in runs:
        if r.mode == "torchrun":
            rows.append([r.mode, r.rep, "-", "-", "-", secs(r.total) if r.first else
                         f"none within {a.torchrun_window:g} s", "no hang detection"])
            continue
        rows.append([r.mode, r.rep, secs(r.rel(r.dumped)), secs(r.rel(r.killed)),
                     r.recovery_text(), secs(r.total),
                     f"INVALID: {r.invalid}" if r.invalid else "valid"])
    print(table(rows, ["mode", "rep", "stacks dumped", "killed/ended", "recovery events",
                       "first step", "check"]))
    print("  all times from rank 1's CRASH line (the start of the hang).")
    print("\n== against before this change and NVIDIA's wrapper defaults ==")
    for mode in ("process", "inprocess"):
        valid = sorted(r.total for r in runs if r.mode == mode and not r.invalid and r.first)
        if not valid:
            continue
        now = valid[len(valid) // 2]
        before, where = BEFORE[mode]
        print(f"  {mode:10s} first step {now:.2f} s after the hang (median of {len(valid)}); "
              f"before {before:.2f} s ({where}): {before / now:.1f}x faster; "
              f"NVIDIA wrapper's soft timeout alone {NVRX_SOFT:g} s: {NVRX_SOFT / now:.1f}x")
    for r in runs:
        if r.mode == "torchrun":
            print(f"  torchrun   {r.note}; no hang detection: its bound is the collective "
                  f"timeout ({a.collective_timeout:g} s here; gloo's default 1800 s)")
    emit_table_row(runs, a)


def emit_table_row(runs: list[Run], a) -> None:
    """The README's row (bench/run_all.py): first step after the hang, medians by mode."""
    ours = []
    for mode, label in (("inprocess", "`--inprocess`"), ("process", "process")):
        valid = sorted(r.total for r in runs if r.mode == mode and not r.invalid and r.first)
        if valid:
            ours.append(f"{valid[len(valid) // 2]:.1f} s ({label}, median of {len(valid)})")
    if not ours:
        return
    torch = [secs(r.total) if r.first else f"none within {a.torchrun_window:g} s"
             for r in runs if r.mode == "torchrun"]
    emit_row("hang", elasticd=", ".join(ours) + (" (--quick settings)" if a.quick else ""),
             torch=(", ".join(torch) + f" (no hang detection; bound: the collective timeout, "
                    f"{a.collective_timeout:g} s here)") if torch else "not run")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list from {', '.join(MODES)}")
    ap.add_argument("--quick", action="store_true",
                    help="NOT the defaults: " + " ".join(QUICK) + ", --torchrun-window 30")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.NAME=VALUE",
                    help="a daemon setting (repeatable; changes what is measured: printed)")
    ap.add_argument("--torchrun-window", type=float, default=None,
                    help="seconds after CRASH to watch torchrun for a recovery (default 240; "
                         "30 with --quick)")
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--crash-at-step", type=int, default=160)
    ap.add_argument("--checkpoint-every", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--collective-timeout", type=float, default=1800.0,
                    help="process group timeout of the process and torchrun runs (0: the "
                         "sample's own, inprocess.hard_timeout = 90 s)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds one daemon run may take (default: agent.hang_hard_timeout + "
                         "inprocess.barrier_timeout + 120, room for a fallback)")
    ap.add_argument("--quiet-wait", type=float, default=60.0)
    ap.add_argument("--quiet-threshold", type=float, default=30.0)
    a = ap.parse_args(argv)
    modes = [x.strip() for x in a.modes.split(",") if x.strip()]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}")
    sets = (list(QUICK) if a.quick else []) + a.set
    try:
        settings = effective_settings(sets)
    except config.ConfigError as exc:
        ap.error(str(exc))
    if a.torchrun_window is None:
        a.torchrun_window = 30.0 if a.quick else 240.0
    if a.timeout is None:
        a.timeout = (float(settings["agent.hang_hard_timeout"])
                     + float(settings["inprocess.barrier_timeout"]) + 120.0)

    print(f"machine: {machine()}\nelasticd: {revision()}")
    print(f"job: 2 ranks, gloo, python {' '.join(SCRIPT + script_args(a))}")
    print("settings: " + ("DEFAULTS (no --set)" if not sets else
                          "CHANGED from the defaults: " + " ".join(sets)))
    print("  " + ", ".join(f"{k}={v}" for k, v in settings.items())
          + f"; torchrun watched {a.torchrun_window:g} s after CRASH")
    print("  collective (process group) timeout of the process and torchrun runs: "
          + (f"{a.collective_timeout:g} s" if a.collective_timeout else
             "the sample's own (inprocess.hard_timeout 90 s)"))
    work = tempdir("edb-hang-")
    extra = tuple(x for s in sets for x in ("--set", s))
    daemon = BenchDaemon(slots=4, extra_args=extra) if set(modes) - {"torchrun"} else None

    def run_one(mode: str, rep: int, busy) -> Run:
        run = Run(mode, rep)
        run.busy = busy
        print(f"-- {mode} rep {rep} ({machine()})", flush=True)
        if mode == "torchrun":
            run_torchrun(run, a, work)
        else:
            run_daemon(daemon, run, a, work)
        return run

    try:
        if daemon:
            daemon.start()
        runs = run_each(modes, a.reps, run_one, a.quiet_wait, a.quiet_threshold, rotate=False)
    finally:
        if daemon:
            daemon.stop()
    report(runs, a, settings)
    print(f"\nmachine after: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
