"""The worker template: submit -> first step, and a fault in the first second -> first
step after the restart, against torchrun --standalone and a cold elasticd; every
submit's environment differs from the one before in a run-name variable (RUN_NAME).

    python bench/template_start.py [--reps 3] [--idle 5]

The same job under each launcher, 2 ranks on this node, gloo, one restart:

    python -m elasticd.examples.train --steps 40 --step-time 0.05 [--crash-at-step 5
        --crash-rank 1 --crash-mode exit --checkpoint-every 1000]

Launchers (same invocation, order rotated each repetition):
  pooled     python -m elasticd --standalone, defaults: the worker template forks
             every rank, and the template of the user's previous job is kept idle
             (agent.template_idle_timeout) and taken at the submit when the job's
             key and the variables its imports read are the same (RUN_NAME is
             neither); a short warming job runs once before the first repetition,
             so every measured submit finds one (its first-start path: "reused")
  restarted  the pooled daemon restarted just before (SIGKILL and SIGTERM in
             turn, each repetition): the template it had is started again at
             its start, and the submit comes once `nodes` shows it ready
  template   the same with agent.template_idle_timeout=0: the job's template
             starts when the job is submitted (a first submit, the pool empty)
  cold       the same daemon settings with agent.worker_template=false and
             agent.warm_spares=false (every start cold)
  torchrun   torchrun --standalone --nnodes 1 --nproc-per-node 2 --max-restarts 1
             --monitor-interval 0.1 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see
             restart_vs_torchrun.py)

Measures (wall clock of this machine; workers stamp their own lines):
  start    from just before Submit (or torchrun's exec) to rank 0's
           ``FIRST_STEP <time> attempt=0`` line;
  restart  from the crashing rank's ``CRASH <time>`` (step 5, ~0.3 s into
           training) to ``FIRST_STEP <time> attempt=1``.
Then the template's RSS (status) and the daemon's CPU while a job's template
idles (its ranks sleep) for --idle seconds, and the pooled daemon's idle
templates (no job at all) with their RSS and the daemon's CPU meanwhile.

Prints medians and ratios; never asserts a timing.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BenchDaemon, machine, median, read_text, revision,  # noqa: E402
                    start_torchrun, stop_torchrun, table, tempdir, torchrun_env)
from rows import emit_row  # noqa: E402

from elasticd.v1 import control_pb2 as pb  # noqa: E402

CRASH_RE = re.compile(r"^CRASH (\d+\.\d+) rank=", re.M)
FIRST_RE = re.compile(r"^FIRST_STEP (\d+\.\d+) attempt=(\d+)", re.M)
LAUNCHERS = ("pooled", "restarted", "template", "cold", "torchrun")
DAEMON_OF = {"restarted": "pooled"}
SLEEPER = "import time\ntime.sleep(float(__import__('sys').argv[1]))\n"


def train_args(crash: bool) -> list[str]:
    args = ["--steps", "40", "--step-time", "0.05", "--log-every", "1000",
            "--checkpoint-every", "1000"]
    if crash:
        args += ["--crash-at-step", "5", "--crash-rank", "1", "--crash-mode", "exit"]
    return args


def marks(text: str) -> tuple:
    crash = [float(t) for t in CRASH_RE.findall(text)]
    first = {}
    for t, att in FIRST_RE.findall(text):
        first.setdefault(int(att), float(t))
    return (min(crash) if crash else None), first


def run_env(n: int) -> dict:
    """The environment of submit number ``n``: a run name of its own."""
    return dict(torchrun_env(), RUN_NAME=f"exp{n}")


def run_daemon(d: BenchDaemon, work: str, crash: bool, n: int) -> tuple:
    """(seconds submit -> first step, seconds fault -> first step after, start paths)."""
    cmd = [sys.executable, "-m", "elasticd.examples.train", *train_args(crash)]
    t0 = time.time()
    job_id = d.submit(cmd, cwd=work, nproc=2, max_restarts=1, env=run_env(n))
    job = d.wait_job(job_id, timeout=300)
    text = d.rank_log(job_id, 0) + "\n" + d.rank_log(job_id, 1)
    if pb.JobState.Name(job.state) != "SUCCEEDED":
        raise RuntimeError(f"job {job_id} {pb.JobState.Name(job.state)}: {job.reason}")
    fault, first = marks(text)
    events = d.events(job_id)
    paths = [e.start_path for e in events if e.kind == "start"]
    if any(e.kind == "template" and "reused from the pool" in e.reason for e in events):
        paths[0] = "reused+" + paths[0]
    return (first.get(0, 0) - t0, (first[1] - fault) if crash and 1 in first else None,
            paths, job.template_rss_bytes)


def run_torchrun(work: str, crash: bool, rep: int) -> tuple:
    base = os.path.join(work, f"torchrun-{rep}-{int(crash)}")
    t0 = time.time()
    proc = start_torchrun(["--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                           "--max-restarts", "1", "--monitor-interval", "0.1", "-m",
                           "elasticd.examples.train", *train_args(crash)], work, base)
    try:
        proc.wait(300)
    finally:
        stop_torchrun(proc)
    fault, first = marks(read_text(base + ".out"))
    if 0 not in first or (crash and 1 not in first):
        raise RuntimeError(f"torchrun run failed: {read_text(base + '.err')[-2000:]}")
    return first[0] - t0, (first[1] - fault) if crash else None, ["torchrun"], 0


def restart(d: BenchDaemon, how: str, timeout: float = 180.0) -> float:
    """Stop ``d`` (SIGKILL or SIGTERM) and start it again; seconds until the template it
    had is ready again (before any submit)."""
    if how == "SIGKILL":
        d.proc.kill()
        d.proc.wait()
    d.stop()
    t0 = time.monotonic()
    d.start()
    while time.monotonic() - t0 < timeout:
        nodes = d.client().call("ListNodes", pb.ListNodesRequest()).nodes
        if any(t.state == "ready" for n in nodes for t in n.idle_templates):
            return time.monotonic() - t0
        time.sleep(0.1)
    raise RuntimeError(f"no template ready {timeout:g}s after a {how} restart:\n{d.log()}")


def idle_cost(d: BenchDaemon, work: str, seconds: float) -> tuple:
    """(template RSS bytes, daemon CPU % of one core) while a job's ranks sleep."""
    script = os.path.join(work, "sleeper.py")
    with open(script, "w") as fh:
        fh.write(SLEEPER)
    job_id = d.submit([sys.executable, script, str(seconds + 60)], cwd=work, nproc=1,
                      env=torchrun_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = d.get_job(job_id)
        if job.start_path and job.template_rss_bytes:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    proc = psutil.Process(d.pid)
    c0 = sum(proc.cpu_times()[:2])
    time.sleep(seconds)
    cpu = (sum(proc.cpu_times()[:2]) - c0) / seconds * 100
    rss = d.get_job(job_id).template_rss_bytes
    d.cancel(job_id)
    d.wait_job(job_id, timeout=60)
    return rss, cpu


def pool_cost(d: BenchDaemon, seconds: float) -> tuple:
    """(idle templates, their RSS bytes, daemon CPU % of one core) with no job running."""
    found = [p for p in psutil.Process(d.pid).children()
             if "--template" in " ".join(p.cmdline())]
    rss = sum(p.memory_info().rss for p in found)
    proc = psutil.Process(d.pid)
    c0 = sum(proc.cpu_times()[:2])
    time.sleep(seconds)
    return len(found), rss, (sum(proc.cpu_times()[:2]) - c0) / seconds * 100


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--idle", type=float, default=5.0)
    a = p.parse_args()
    work = tempdir("edb-tmpl-")
    daemons = {
        "pooled": BenchDaemon(extra_args=("--set", "agent.warm_spares=false")),
        "template": BenchDaemon(extra_args=("--set", "agent.warm_spares=false",
                                            "--set", "agent.template_idle_timeout=0")),
        "cold": BenchDaemon(extra_args=("--set", "agent.worker_template=false",
                                        "--set", "agent.warm_spares=false")),
    }
    for d in daemons.values():
        d.start()
    results = {name: {"start": [], "restart": [], "paths": [], "rss": [], "ready": []}
               for name in LAUNCHERS}
    submits = iter(range(1, 1 << 30))  # every submit's RUN_NAME differs from the last
    try:
        warm = run_daemon(daemons["pooled"], work, False, 0)  # leaves its template idle
        print(f"warming job on the pooled daemon: start {warm[0]:.3f}s "
              f"paths {'/'.join(warm[2])}", flush=True)
        for rep in range(a.reps):
            n = len(LAUNCHERS)
            order = LAUNCHERS[rep % n:] + LAUNCHERS[:rep % n]
            for name in order:
                if name == "restarted":
                    how = ("SIGKILL", "SIGTERM")[rep % 2]
                    results[name]["ready"].append(restart(daemons["pooled"], how))
                for crash in (False, True) if name != "restarted" else (False,):
                    if name == "torchrun":
                        start, fault, paths, rss = run_torchrun(work, crash, rep)
                    else:
                        start, fault, paths, rss = run_daemon(
                            daemons[DAEMON_OF.get(name, name)], work, crash, next(submits))
                    r = results[name]
                    r["start"].append(start)
                    if crash:
                        r["restart"].append(fault)
                    r["paths"].append("/".join(paths))
                    if rss:
                        r["rss"].append(rss)
                    print(f"rep {rep} {name:9s} crash={crash!s:5s} start {start:.3f}s"
                          + (f" restart {fault:.3f}s" if fault is not None else "")
                          + (f" (template ready {r['ready'][-1]:.1f}s after the {how} "
                             "restart)" if name == "restarted" else "")
                          + f" paths {'/'.join(paths)}", flush=True)
        rss, cpu = idle_cost(daemons["template"], work, a.idle)
        pooled = pool_cost(daemons["pooled"], a.idle)
    finally:
        for d in daemons.values():
            d.stop()
    print()
    print(f"machine: {machine()}; revision {revision()}; {a.reps} reps")
    rows = []
    tr = results["torchrun"]
    for name in LAUNCHERS:
        r = results[name]
        s = median(r["start"])
        row = [name, f"{s:.3f}s ({min(r['start']):.3f}-{max(r['start']):.3f})",
               f"{median(tr['start']) / s:.2f}x"]
        if r["restart"]:
            f = median(r["restart"])
            row += [f"{f:.3f}s ({min(r['restart']):.3f}-{max(r['restart']):.3f})",
                    f"{median(tr['restart']) / f:.2f}x"]
        else:
            row += ["-", "-"]
        rows.append(row + [", ".join(sorted(set(r["paths"])))])
    print(table(rows, ["LAUNCHER", "SUBMIT->STEP (MIN-MAX)", "VS TORCHRUN",
                       "FAULT@5->STEP (MIN-MAX)", "VS TORCHRUN", "START PATHS"]))
    emit_table_rows(results)
    ready = results["restarted"]["ready"]
    print(f"restarted: the template ready again {median(ready):.1f}s (median; "
          f"{min(ready):.1f}-{max(ready):.1f}) after the daemon's start, before the submit")
    print(f"template RSS (status): {rss / (1 << 20):.0f} MiB; daemon CPU while a template idles: "
          f"{cpu:.2f}% of one core over {a.idle:g}s")
    print(f"pooled daemon, no job: {pooled[0]} idle template(s), "
          f"{pooled[1] / (1 << 20):.0f} MiB resident; daemon CPU {pooled[2]:.2f}% of one core "
          f"over {a.idle:g}s; load average {os.getloadavg()[0]:.1f}")


def emit_table_rows(results: dict) -> None:
    """The README's rows (bench/run_all.py): medians (min-max) against torchrun --standalone,
    which has no setting that matches a kept template."""
    tr = results["torchrun"]

    def row(key: str, name: str, what: str) -> None:
        ours, theirs = results[name][what], tr[what]
        if not ours or not theirs:
            return
        emit_row(key, elasticd=f"{median(ours):.2f} s ({min(ours):.2f}-{max(ours):.2f}; {name})",
                 torch=f"{median(theirs):.2f} s ({min(theirs):.2f}-{max(theirs):.2f})",
                 ratio=f"{median(theirs) / median(ours):.1f}x")
    row("template-submit", "pooled", "start")
    row("template-restarted", "restarted", "start")
    row("template-fault", "pooled", "restart")


if __name__ == "__main__":
    main()
