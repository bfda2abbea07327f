"""Checks 5 and 6: warm starts never touch CUDA before they fork; snapshots of CUDA tensors.

5. ``template``: three daemons, one job each (2 ranks, gloo on CUDA, rank 1
   dies at a step): the worker template (defaults), warm spares
   (``agent.worker_template=false``, spares started at once), and cold
   starts (both off). A template or a spare must not have started CUDA
   before it hands its process to a rank: each rank prints, before it
   touches CUDA, whether torch already counts CUDA as initialised, whether
   it is in a "bad fork", and whether the driver library is mapped (all
   inherited from the template over fork, or the spare's own state); the
   template and the waiting spares must be absent from NVML's compute
   processes; and the forked ranks must run CUDA steps (a driver started
   before fork fails them). Numbers: crash -> first CUDA step after the
   restart for each path, and the CUDA context cost (CUDA_INIT).
6. ``snapshot``: 1 GiB of CUDA tensors saved through ``elasticd.snapshot``
   (sync, and async stall), the rank crashes, the restarted rank restores
   them: time and equality (SKIP where the package is missing, e.g. an
   older tree's wheels).
"""
from __future__ import annotations

import importlib.util
import os
import re
import time

import psutil

import gpucheck as g
from gpunvml import gpu_pids, libcuda_mapped
from results import Step

SPARE_WAIT = 40  # seconds for a job's spares to finish their imports before the crash


def _helpers(d, workers: set) -> dict:
    """The daemon's template and waiting spares right now: pid -> 'template' | 'spare'."""
    out = {}
    try:
        kids = psutil.Process(d.pid).children()
    except psutil.Error:
        return out
    for p in kids:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "warmstart.py" in cmd and p.pid not in workers:
            out[p.pid] = "template" if "--template" in cmd else "spare"
    return out


def _waiting(pid: int) -> bool:
    """Whether a spare is blocked reading its stdin (imports done, waiting for a rank's
    identity): /proc/PID/syscall says read (0 on x86-64) from fd 0."""
    try:
        with open(f"/proc/{pid}/syscall") as fh:
            fields = fh.read(256).split()
    except OSError:
        return False
    return fields[:2] == ["0", "0x0"]


def _watch(ctx: g.Ctx, d, job_id: str, timeout: float, trigger: str = "") -> tuple:
    """Until the job ends: each template / spare seen, with whether it ever had the CUDA
    driver mapped or showed up in NVML (pid -> [kind, libcuda seen, in NVML]). With
    ``trigger``: the file that makes rank 1 crash, made once both ranks' spares wait
    (or after SPARE_WAIT s); returns (seen, seconds the spares took, or None)."""
    seen: dict[int, list] = {}
    start = time.monotonic()
    deadline, ready_in = start + g.scaled(timeout), None
    while time.monotonic() < deadline:
        job = d.get_job(job_id)
        workers = {w.pid for w in job.workers}
        nv_pids = set(gpu_pids(ctx.nvml)) if ctx.nvml else set()
        helpers = _helpers(d, workers)
        for pid, kind in helpers.items():
            entry = seen.setdefault(pid, [kind, False, False])
            entry[1] = entry[1] or bool(libcuda_mapped(pid))
            entry[2] = entry[2] or pid in nv_pids
        if trigger and not os.path.exists(trigger):
            waiting = sum(kind == "spare" and _waiting(pid) for pid, kind in helpers.items())
            if waiting >= 2 or time.monotonic() - start > g.scaled(SPARE_WAIT):
                ready_in = time.monotonic() - start if waiting >= 2 else None
                with open(trigger, "w"):
                    pass
        if g.state(job) in ("SUCCEEDED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.2)
    return seen, ready_in


def warm_job(ctx: g.Ctx, step: Step, name: str, sets: tuple,
             want_path: str) -> float | None:
    d = g.daemon(ctx, name, *sets)
    trigger = os.path.join(ctx.work, name, "crash-now") if want_path == "spare" else ""
    try:
        cmd = ctx.train_cmd("--steps", "2000" if trigger else "15", "--step-time", "0.05",
                            "--crash-at-step", "5", "--crash-rank", "1", "--crash-mode", "exit",
                            *(("--crash-file", trigger) if trigger else ()))
        job_id = g.submit(d, ctx, cmd, nproc=2, max_restarts=1)
        seen, ready_in = _watch(ctx, d, job_id, 75 if trigger else 45, trigger)
        job, logs, events = g.finish(d, job_id, 30)
        for pid, entry in _watch(ctx, d, job_id, 1)[0].items():  # the template idles after
            seen.setdefault(pid, entry)
    finally:
        d.stop()
    paths = [e.start_path for e in events if e.kind == "start"]
    problems = []
    if g.state(job) != "SUCCEEDED" or job.restarts != 1 or not g.done_ok(logs, 2):
        problems.append(f"restarts {job.restarts}; {g.outcome(job, logs)}")
    if want_path != "cold" and (len(paths) < 2 or paths[1] != want_path):
        problems.append(f"the restart's ranks came {'/'.join(paths[1:2]) or 'never'}, not "
                        f"from the {want_path} (template: {job.template_state} "
                        f"{job.template_reason[:150]})")
    states = g.CUDA_STATE.findall(logs)
    dirty = [f"rank {r}: initialized={i} bad_fork={b}" for r, i, b, _ in states
             if i != "0" or b != "0"]
    if not ctx.cpu and len(states) < 4:
        problems.append(f"{len(states)} CUDA_STATE lines, want 4 (2 ranks x 2 attempts)")
    problems += dirty
    in_nvml = [f"{kind} {pid} in NVML" for pid, (kind, _, nv) in seen.items() if nv]
    problems += in_nvml
    helpers = [kind for kind, _, _ in seen.values()]
    if want_path in ("template", "spare") and want_path not in helpers:
        problems.append(f"never saw a {want_path} process")
    libcuda = sorted({kind for kind, lib, _ in seen.values() if lib} |
                     {f"rank {r} at start" for r, _, _, lib in states if lib == "1"})
    first = g.crash_to_first(logs)
    label = {"template": "5 worker template: no CUDA before it forks ranks",
             "spare": "5 warm spares: no CUDA before they become ranks",
             "cold": "5 cold starts (no template, no spares)"}[want_path]
    spares = f", spares ready {g.secs(ready_in)} after submit" if trigger else ""
    step.add(label, not problems,
             f"crash->first step {g.secs(first)}, CUDA init {g.secs(g.cuda_init(logs))}, "
             f"paths {'/'.join(paths) or '-'}{spares}",
             "; ".join(problems) or (
                 "--cpu: CUDA state and NVML not checked" if ctx.cpu else
                 "driver library mapped in: " + ", ".join(libcuda) if libcuda else
                 "no driver library in any template/spare or rank before CUDA"))
    return first


def template(ctx: g.Ctx, step: Step) -> None:
    got = {}
    runs = (("template", (), "template"),
            ("spare", ("agent.worker_template=false",), "spare"),
            ("cold", ("agent.worker_template=false", "agent.warm_spares=false"), "cold"))
    for name, sets, path in runs:
        try:
            got[path] = warm_job(ctx, step, name, sets, path)
        except Exception as exc:  # the other paths still run
            step.crashed(f"5 {path}", exc)
    t, s, c = got.get("template"), got.get("spare"), got.get("cold")
    ratio = f", cold/template {c / t:.1f}x" if t and c else ""
    step.add("5 first CUDA step after a restart" if not ctx.cpu else
             "5 first step after a restart", t is not None and c is not None,
             f"template {g.secs(t)}, spare {g.secs(s)}, cold {g.secs(c)}{ratio}")


# -- 6. snapshots ------------------------------------------------------------------------
SNAP_SAVED = re.compile(r"^SNAPSHOT saved bytes=(\d+) sync_s=(\S+) async_stall_s=(\S+)", re.M)
SNAP_RESTORED = re.compile(r"^SNAPSHOT restored step=(\d+) restore_s=(\S+) device=(\w+) "
                           r"equal=(\d)", re.M)


def snapshot(ctx: g.Ctx, step: Step) -> None:
    if importlib.util.find_spec("elasticd.snapshot") is None:
        step.add("6 snapshots of CUDA tensors", None,
                 note="elasticd.snapshot does not exist yet (issue 32); runs once it does")
        return
    d = g.daemon(ctx, "d")
    try:
        size = (64 << 20) if ctx.cpu else (1 << 30)
        job_id = g.submit(d, ctx, ctx.train_cmd("--snapshot", "--snapshot-bytes", str(size),
                                                "--steps", "5"), nproc=1, max_restarts=1)
        job, logs, _ = g.finish(d, job_id, 60)
    finally:
        d.stop()
    saved, restored = SNAP_SAVED.search(logs), SNAP_RESTORED.search(logs)
    problems = []
    if g.state(job) != "SUCCEEDED":
        problems.append(g.outcome(job, logs))
    if not saved or not restored:
        problems.append("no SNAPSHOT saved/restored line")
    elif restored.group(3) != ctx.device or restored.group(4) != "1":
        problems.append(f"restored on {restored.group(3)}, equal={restored.group(4)}")
    step.add(f"6 snapshot {g.mib(size)} of {ctx.device} tensors", not problems,
             (f"save {float(saved.group(2)):.3f}s, async stall {float(saved.group(3)):.3f}s, "
              f"restore {float(restored.group(2)):.3f}s") if saved and restored else "",
             "; ".join(problems))

