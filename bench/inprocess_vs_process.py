"""Worker crash -> first training step after recovery: in-process vs process restart vs torchrun.

    python bench/inprocess_vs_process.py [--reps 3]

The same model, data and crash (rank 1 raises at step 160 of 180, 2 ranks,
gloo, 0.05 s per step) under three recoveries, in one invocation:

  inprocess      elasticd.examples.train_inprocess: the training function is
                 re-entered in the same processes (elasticd.inprocess.Wrapper),
                 coordinated through a job store hosted outside the ranks
                 (daemon/elasticd/jobstore.py). The ranks are started by this
                 script with the environment elasticd gives workers: the
                 daemon side of `submit --inprocess` is not wired up yet.
  elasticd-warm  process restart by a standalone elasticd (warm spares), as in
                 bench/restart_vs_torchrun.py
  torchrun       torchrun --max-restarts 1, as in bench/restart_vs_torchrun.py

Measured from the ``CRASH <unix time>`` line the failing rank prints to rank
0's ``FIRST_STEP <unix time>`` line of the recovered run, both from the
workers' own clock. Prints medians and ratios; never asserts a timing.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BenchDaemon, machine, median, own, revision, secs, table, tempdir  # noqa: E402
import restart_vs_torchrun as rvt  # noqa: E402

JOBSTORE = os.path.join(rvt.REPO, "daemon", "elasticd", "jobstore.py")
FIRST_INPROC = re.compile(r"^FIRST_STEP (\S+) attempt=0 iteration=1 ", re.M)


def run_inprocess(run: rvt.Run, a, work: str) -> None:
    store = subprocess.Popen([sys.executable, JOBSTORE, "--host", "127.0.0.1"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    own(store)
    try:
        _, addr, port = store.stdout.readline().split()
        procs, logs = [], []
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       ELASTICD_STORE_ADDR=addr, ELASTICD_STORE_PORT=port,
                       TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS="1")
            path = os.path.join(work, f"inproc-{run.rep}-rank{rank}.log")
            logs.append(path)
            with open(path, "w") as fh:
                p = subprocess.Popen(
                    [sys.executable, "-m", "elasticd.examples.train_inprocess",
                     "--steps", str(a.steps), "--crash-at-step", str(a.crash_at_step),
                     "--crash-rank", "1", "--checkpoint-every", str(a.checkpoint_every),
                     "--step-time", str(a.step_time), "--log-every", "1000"],
                    env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=work)
            own(p)
            procs.append(p)
        codes = [p.wait(a.timeout) for p in procs]
        text = "".join(open(p).read() for p in logs)
        crash = [float(t) for t, _ in rvt.CRASH_RE.findall(text)]
        first = [float(t) for t in FIRST_INPROC.findall(text)]
        run.crash, run.first = (min(crash) if crash else None), (min(first) if first else None)
        run.ok = codes == [0, 0] and run.total is not None
        if not run.ok:
            run.error = f"exit codes {codes}, crash {run.crash}, first {run.first}"
    finally:
        store.stdin.close()
        store.wait(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--launchers", default="inprocess,elasticd-warm,torchrun")
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--crash-at-step", type=int, default=160)
    ap.add_argument("--checkpoint-every", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    a.crash_mode, a.torchrun_shared_store = "raise", False
    launchers = [x.strip() for x in a.launchers.split(",") if x.strip()]
    print(f"machine: {machine()}\nelasticd: {revision()}")
    work = tempdir("edb-inp-")
    daemon = BenchDaemon(slots=4) if "elasticd-warm" in launchers else None
    runs: list[rvt.Run] = []
    try:
        if daemon:
            daemon.start()
        for rep in range(1, a.reps + 1):
            k = (rep - 1) % len(launchers)
            for name in launchers[k:] + launchers[:k]:
                run = rvt.Run(name, rep, False)
                if name == "inprocess":
                    run_inprocess(run, a, work)
                elif name == "torchrun":
                    rvt.run_torchrun(run, a, work)
                else:
                    rvt.run_elasticd(daemon, run, a, work)
                runs.append(run)
                print(f"{name:14s} rep {rep}: " + (secs(run.total) if run.ok else
                                                    f"FAILED {run.error}"), flush=True)
    finally:
        if daemon:
            daemon.stop()
    med = {L: median([r.total for r in runs if r.launcher == L and r.ok]) for L in launchers}
    base = med.get("torchrun")
    rows = [[L, secs(med[L]) if med[L] is not None else "-",
             f"{base / med[L]:.1f}x" if base and med[L] else "-"] for L in launchers]
    print("\ncrash -> first step after recovery (median)")
    print(table(rows, ["recovery", "median", "torchrun / this"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
