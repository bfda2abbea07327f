"""Worker crash -> first training step after the restart: elasticd vs torchrun.

    python bench/restart_vs_torchrun.py [--reps 3] [--crash-mode raise|exit|kill]
                                        [--phase-reps 1] [--launchers ...]

The same job runs under each launcher, 2 ranks on this node, gloo, one
restart allowed:

    python -m elasticd.examples.train --steps 180 --crash-at-step 160
        --crash-rank 1 --crash-mode raise --checkpoint-every 40 --step-time 0.05

Rank 1 fails once at step 160 (about 8 s of steps in, so elasticd's warm
spares, started agent.warm_spare_delay after the workers, have finished
importing torch); the job restarts from the step-160 checkpoint. Measured
from the ``CRASH <unix time>`` line the crashing rank prints just before it
fails to the ``FIRST_STEP <unix time> attempt=1`` line rank 0 prints after
its first step of the new attempt. Both stamps come from the workers' own
clock, so no launcher's log buffering enters the number.

Launchers (run in the same invocation, order rotated each repetition):
  elasticd-warm  python -m elasticd --standalone, default settings (the job's
                 worker template forks every rank; see bench/template_start.py)
  elasticd-cold  the same with --set agent.warm_spares=false
                 --set agent.worker_template=false
  torchrun       torchrun --standalone --nnodes 1 --nproc-per-node 2
                 --max-restarts 1 --monitor-interval 0.1 -m elasticd.examples.train ...
                 with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.13's
                 default (workers share the rendezvous TCPStore) the restarted
                 gloo workers read the previous attempt's addresses and fail
                 or hang in init_process_group (pytorch#135712);
                 --torchrun-shared-store keeps the default to show it.

Breakdown of the restart, from each launcher's own record:
  elasticd  job events (Events RPC) and the rank logs: worker_exit (failure
            seen), RESTARTING (group stopped), the '==== elasticd: ... starting
            (restart 1, ...) at TIME ====' line written into each rank's log
            just before its process is started or handed to a spare (backoff
            and rendezvous done; ms stamps), RUNNING (every worker started)
  torchrun  its INFO log on stderr (LOGLEVEL=INFO, ms stamps): "closing
            signal SIGTERM"/"failed (exitcode" (failure seen), "Rendezvous'ing
            worker group" (stopped), "Rendezvous complete", "Starting worker group"
With --phase-reps N (default 1), N more runs per launcher use
bench/timed_train.py, which runs the same train.main but stamps each
start-up phase of the new workers (interpreter, torch import,
init_process_group, optimizer, checkpoint load, first step).

Prints medians, the ratio torchrun / elasticd, and where the time goes.
Never asserts a timing.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BenchDaemon, REPO, last_error, machine, median, read_text,  # noqa: E402
                    revision, secs, start_torchrun, stop_torchrun, table, tempdir,
                    torchrun_env, wait_quiet)
from rows import emit_row  # noqa: E402

from elasticd.v1 import control_pb2 as pb  # noqa: E402

TIMED_TRAIN = os.path.join(REPO, "bench", "timed_train.py")
LAUNCHERS = ("elasticd-warm", "elasticd-cold", "torchrun")
PHASES = ("detect", "stop", "rendezvous", "spawn", "worker start -> first step")
WORKER_PHASES = (
    ("launch -> interpreter up", "launch", "py_up"),
    ("import torch", "py_up", "torch_imported"),
    ("import train, argparse", "torch_imported", "init_pg_start"),
    ("init_process_group", "init_pg_start", "init_pg_done"),
    ("model + optimizer", "init_pg_done", "opt_done"),
    ("checkpoint load", "opt_done", "ckpt_done"),
    ("first step", "ckpt_done", "first_step"),
)

PEER_LAG = "  (rank 1 calls init_process_group later by)"

CRASH_RE = re.compile(r"^CRASH (\d+\.\d+) rank=(\d+)", re.M)
FIRST_RE = re.compile(r"^FIRST_STEP (\d+\.\d+) attempt=(\d+)", re.M)
PHASE_RE = re.compile(r"^PHASE (\w+) (\d+\.\d+) rank=(\d+) attempt=(\d+)", re.M)
MARK_RE = re.compile(r"^==== elasticd: job \S+ rank (\d+) (.*?) \(restart (\d+), "
                     r"round (\d+)\) at (\S+) ====$", re.M)
TORCH_LOG_RE = re.compile(r"^[IWEC](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ (.*)$")


class Run:
    def __init__(self, launcher: str, rep: int, instrumented: bool):
        self.launcher = launcher
        self.rep = rep
        self.instrumented = instrumented
        self.ok = False
        self.error = ""
        self.crash = None        # unix time of the CRASH line
        self.first = None        # unix time of FIRST_STEP attempt=1
        self.marks: dict = {}    # launcher-side marks: seen, stopped, rdzv, spawned
        self.worker: dict = {}   # rank 0 phase marks of attempt 1 (instrumented)
        self.peer: dict = {}     # rank 1 phase marks of attempt 1 (instrumented)
        self.note = ""
        self.busy = None         # % of all CPUs busy just before the run

    @property
    def total(self):
        return None if self.crash is None or self.first is None else self.first - self.crash

    def phases(self) -> dict:
        m = self.marks
        pts = [self.crash, m.get("seen"), m.get("stopped"), m.get("rdzv"), m.get("spawned"),
               self.first]
        out = {}
        for name, a, b in zip(PHASES, pts, pts[1:]):
            out[name] = None if a is None or b is None else b - a
        return out

    def worker_phases(self) -> dict:
        w = dict(self.worker, launch=self.marks.get("launch"), first_step=self.first)
        out = {name: (w[b] - w[a]) if w.get(a) is not None and w.get(b) is not None else None
               for name, a, b in WORKER_PHASES}
        a, b = self.worker.get("init_pg_start"), self.peer.get("init_pg_start")
        out[PEER_LAG] = None if a is None or b is None else b - a
        return out


# -- the job ---------------------------------------------------------------------
def train_args(a, ckpt_dir: str) -> list[str]:
    return ["--steps", str(a.steps), "--crash-at-step", str(a.crash_at_step),
            "--crash-rank", "1", "--crash-mode", a.crash_mode,
            "--checkpoint-every", str(a.checkpoint_every), "--step-time", str(a.step_time),
            "--log-every", "1000", "--checkpoint-dir", ckpt_dir]


def job_env(a) -> dict:
    return torchrun_env(a.torchrun_shared_store)


def parse_worker_output(run: Run, text: str) -> None:
    crashes = [float(t) for t, _ in CRASH_RE.findall(text)]
    firsts = [float(t) for t, att in FIRST_RE.findall(text) if att == "1"]
    run.crash = min(crashes) if crashes else None
    run.first = min(firsts) if firsts else None
    for name, t, rank, att in PHASE_RE.findall(text):
        if att == "1" and rank in ("0", "1"):
            (run.worker if rank == "0" else run.peer).setdefault(name, float(t))


# -- elasticd ----------------------------------------------------------------------
def run_elasticd(d: BenchDaemon, run: Run, a, work: str) -> None:
    ckpt = os.path.join(work, f"ckpt-{run.launcher}-{run.rep}-{int(run.instrumented)}")
    entry = [TIMED_TRAIN] if run.instrumented else ["-m", "elasticd.examples.train"]
    cmd = [sys.executable, *entry, *train_args(a, ckpt)]
    job_id = d.submit(cmd, cwd=work, nproc=2, max_restarts=1, env=job_env(a))
    try:
        job = d.wait_job(job_id, timeout=a.timeout)
    except TimeoutError as exc:
        d.client().call("CancelJob", pb.CancelJobRequest(id=job_id), wait=30)
        run.error = str(exc)
        return
    logs = {r: d.rank_log(job_id, r) for r in (0, 1)}
    parse_worker_output(run, logs[0] + "\n" + logs[1])
    state = pb.JobState.Name(job.state)
    if state != "SUCCEEDED":
        run.error = f"job ended {state}: {job.reason}"
        return
    # Each rank's log gets '==== elasticd: job J rank R starting [from a warm spare]
    # (restart N, round M) at ISO-TIME ====' just before its process is started.
    starts = []
    for r in (0, 1):
        for rank, what, restart, _, stamp in MARK_RE.findall(logs[r]):
            if restart != "0" and "starting" in what:
                starts.append((datetime.datetime.fromisoformat(stamp).timestamp(), what))
    warm = sum("warm spare" in what for _, what in starts)
    forked = sum("worker template" in what for _, what in starts)
    run.note = (f"{forked}/2 ranks forked from the template, {warm}/2 from warm spares"
                if run.launcher == "elasticd-warm" else "")
    events = d.events(job_id)
    m = run.marks
    for ev in events:
        if ev.kind == "worker_exit" and "seen" not in m:
            m["seen"] = ev.time
        elif ev.kind == "state" and "seen" in m:
            if ev.to_state == pb.RESTARTING and "stopped" not in m:
                m["stopped"] = ev.time
            elif ev.to_state == pb.RUNNING and "stopped" in m and "spawned" not in m:
                m["spawned"] = ev.time
    if starts:
        m["rdzv"] = min(t for t, _ in starts)  # ms resolution
    m["launch"] = m.get("rdzv")
    run.ok = run.total is not None and all(k in m for k in ("seen", "stopped", "rdzv", "spawned"))
    if not run.ok:
        run.error = f"missing marks: crash={run.crash} first={run.first} events={sorted(m)}"


# -- torchrun ------------------------------------------------------------------------
def _torch_log_time(line: str) -> tuple[float, str] | None:
    """(unix time, message) of a torch elastic log line like 'I1123 11:03:12.171000 PID ...'."""
    m = TORCH_LOG_RE.match(line)
    if not m:
        return None
    mon, day, hh, mi, ss, us, msg = m.groups()
    year = time.localtime().tm_year
    t = time.mktime((year, int(mon), int(day), int(hh), int(mi), int(ss), 0, 0, -1))
    return t + int(us) / 1e6, msg


def run_torchrun(run: Run, a, work: str) -> None:
    ckpt = os.path.join(work, f"ckpt-{run.launcher}-{run.rep}-{int(run.instrumented)}")
    entry = [TIMED_TRAIN] if run.instrumented else ["-m", "elasticd.examples.train"]
    base = os.path.join(work, f"torchrun-{run.rep}-{int(run.instrumented)}")
    proc = start_torchrun(["--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                           "--max-restarts", "1", "--monitor-interval", "0.1", *entry,
                           *train_args(a, ckpt)], work, base, env=job_env(a))
    try:
        rc = proc.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        rc = None
    stop_torchrun(proc)  # its workers, if it hung
    parse_worker_output(run, read_text(base + ".out"))
    err_text = read_text(base + ".err")
    if rc != 0:
        why = "timed out (hung)" if rc is None else f"exit {rc}"
        last = last_error(err_text)
        run.error = f"torchrun {why}" + (f": {last}" if last else "")
        return
    m = run.marks
    rdzv_done = []
    for line in err_text.splitlines():
        parsed = _torch_log_time(line)
        if parsed is None:
            continue
        t, msg = parsed
        if run.crash is None or t < run.crash - 0.002:  # ms stamps; before the crash
            continue
        if ("closing signal SIGTERM" in msg or "failed (exitcode" in msg) and "seen" not in m:
            m["seen"] = t
        elif "Rendezvous'ing worker group" in msg and "seen" in m and "stopped" not in m:
            m["stopped"] = t
        elif "Rendezvous complete for workers" in msg and "stopped" in m:
            rdzv_done.append(t)
        elif "Starting worker group" in msg and rdzv_done and "spawned" not in m:
            m["spawned"] = t
    if rdzv_done:
        m["rdzv"] = rdzv_done[0]
    m["launch"] = m.get("spawned")  # torchrun forks the workers right after this line
    run.ok = run.total is not None and all(k in m for k in ("seen", "stopped", "rdzv", "spawned"))
    if not run.ok:
        run.error = f"missing marks: crash={run.crash} first={run.first} log={sorted(m)}"


# -- report ------------------------------------------------------------------------
def fmt_run(run: Run) -> str:
    if not run.ok:
        return f"  {run.launcher:14s} rep {run.rep}: FAILED ({run.error})"
    ph = run.phases()
    parts = ", ".join(f"{k} {secs(v)}" for k, v in ph.items())
    note = f"; {run.note}" if run.note else ""
    busy = f"; machine {run.busy:.0f} % busy before" if run.busy is not None else ""
    return f"  {run.launcher:14s} rep {run.rep}: {secs(run.total)}  ({parts}{note}{busy})"


def report(runs: list[Run], launchers: list[str], a) -> None:
    main = [r for r in runs if not r.instrumented]
    by = {L: [r for r in main if r.launcher == L] for L in launchers}
    ok = {L: [r for r in by[L] if r.ok] for L in launchers}
    med = {L: median([r.total for r in ok[L]]) for L in launchers}

    print("\n== crash -> first step after restart (median over successful reps) ==")
    rows = []
    for L in launchers:
        totals = [r.total for r in ok[L]]
        rows.append([L, secs(med[L]),
                     f"{secs(min(totals))} .. {secs(max(totals))}" if totals else "-",
                     f"{len(ok[L])}/{len(by[L])}"])
    print(table(rows, ["launcher", "median", "min .. max", "ok"]))

    t = med.get("torchrun")
    ratios = []
    for L in launchers:
        if L.startswith("elasticd") and t and med.get(L):
            ratio = t / med[L]
            ratios.append([f"torchrun / {L}", f"{ratio:.1f}x",
                           "PASS" if ratio >= 2.0 else "MISS"])
    if ratios:
        print()
        print(table(ratios, ["ratio", "value", "goal >= 2x"]))
    if "elasticd-warm" in launchers:  # the README's row: torchrun has no setting to match
        ours = med["elasticd-warm"]
        emit_row("restart-warm",
                 elasticd=f"{secs(ours)} ({len(ok['elasticd-warm'])} runs, median; crash "
                          f"mode {a.crash_mode})",
                 torch=f"{secs(t)} (torchrun)" if t else "not run",
                 ratio=f"{t / ours:.1f}x" if t and ours else "-")

    print("\n== where the time goes (medians; each launcher's own marks) ==")
    rows = []
    for ph in PHASES:
        rows.append([ph] + [secs(median([r.phases()[ph] for r in ok[L]])) for L in launchers])
    rows.append(["total"] + [secs(med[L]) for L in launchers])
    print(table(rows, ["phase", *launchers]))
    print("  detect: CRASH line -> launcher sees the failure; stop: -> group stopped;\n"
          "  rendezvous: -> next round agreed (incl. any backoff); spawn: -> workers "
          "started\n  (torchrun does not log when its Popen calls return: its spawn is "
          "inside the next row);\n  worker start -> first step: python, torch import, "
          "init_process_group, checkpoint, step 1.")

    inst = [r for r in runs if r.instrumented and r.ok]
    if inst:
        print("\n== new rank 0 start-up, instrumented runs (bench/timed_train.py; medians) ==")
        rows = []
        for name in [n for n, _, _ in WORKER_PHASES] + [PEER_LAG]:
            rows.append([name] + [secs(median([r.worker_phases()[name] for r in inst
                                                if r.launcher == L])) for L in launchers])
        rows.append(["total (crash -> first step)"] + [
            secs(median([r.total for r in inst if r.launcher == L])) for L in launchers])
        print(table(rows, ["phase", *launchers]))
        print("  launch: elasticd's '==== ... starting' log line / torchrun's 'Starting "
              "worker group' line;\n  init_process_group includes waiting for rank 1.")
    failed = [r for r in runs if not r.ok]
    if failed:
        print("\n== failed runs ==")
        for r in failed:
            print(fmt_run(r))

    print("\n== biggest phase per launcher ==")
    for L in launchers:
        phs = {ph: median([r.phases()[ph] for r in ok[L]]) for ph in PHASES}
        phs = {k: v for k, v in phs.items() if v is not None}
        if not phs or not med[L]:
            continue
        top = max(phs, key=phs.get)
        print(f"  {L}: {top} {secs(phs[top])} of {secs(med[L])} "
              f"({100 * phs[top] / med[L]:.0f} %)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per launcher")
    ap.add_argument("--phase-reps", type=int, default=1,
                    help="extra instrumented runs per launcher (0: none)")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS),
                    help=f"comma list from {', '.join(LAUNCHERS)}")
    ap.add_argument("--crash-mode", choices=("raise", "exit", "kill"), default="raise")
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--crash-at-step", type=int, default=160)
    ap.add_argument("--checkpoint-every", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each run wait up to this many seconds for the machine to "
                         "be under --quiet-threshold %% busy (0: don't)")
    ap.add_argument("--quiet-threshold", type=float, default=30.0)
    ap.add_argument("--torchrun-shared-store", action="store_true",
                    help="leave torch's default TCPStore sharing on (restarts may fail/hang)")
    a = ap.parse_args(argv)
    launchers = [x.strip() for x in a.launchers.split(",") if x.strip()]
    for L in launchers:
        if L not in LAUNCHERS:
            ap.error(f"unknown launcher {L!r}")

    print(f"machine: {machine()}")
    print(f"elasticd: {revision()}")
    print(f"job: 2 ranks, gloo, train {' '.join(train_args(a, 'DIR'))}; crash mode {a.crash_mode}")
    work = tempdir("edb-rst-")
    daemons: dict[str, BenchDaemon] = {}
    runs: list[Run] = []
    try:
        if "elasticd-warm" in launchers:
            daemons["elasticd-warm"] = BenchDaemon(slots=4)
        if "elasticd-cold" in launchers:
            daemons["elasticd-cold"] = BenchDaemon(
                slots=4, extra_args=("--set", "agent.warm_spares=false",
                                     "--set", "agent.worker_template=false"))
        for d in daemons.values():
            d.start()
        plan = [(rep, False) for rep in range(1, a.reps + 1)]
        plan += [(rep, True) for rep in range(1, a.phase_reps + 1)]
        for i, (rep, inst) in enumerate(plan):
            k = i % len(launchers)
            for L in launchers[k:] + launchers[:k]:  # rotate who goes first
                run = Run(L, rep, inst)
                if a.quiet_wait > 0:
                    run.busy = wait_quiet(a.quiet_threshold, a.quiet_wait)
                if L == "torchrun":
                    run_torchrun(run, a, work)
                else:
                    run_elasticd(daemons[L], run, a, work)
                runs.append(run)
                print(("[instrumented] " if inst else "") + fmt_run(run).strip(), flush=True)
    finally:
        for d in daemons.values():
            d.stop()
    report(runs, launchers, a)
    print(f"\nmachine after: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
