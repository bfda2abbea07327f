"""Checks 3 and 4: in-process restarts without memory growth; a CUDA kernel that never ends.

3. ``inprocess``: ``elasticctl submit --inprocess``, one rank on NCCL and
   two ranks with gloo on CUDA; the faulting rank raises in each of the
   first 20 iterations (6 in the ``--cpu`` dry run, which checks that the
   step runs; the growth that matters is the GPU's), so the function runs
   21 times in the same processes. Rank 0 reports, after the first step of each iteration,
   ``torch.cuda.memory_allocated``, the device's used memory (NVML) and
   its RSS: from iteration 1 to the last, allocated must not grow (a
   model left behind per iteration would add ~100 MiB each time) and the
   device's use must stay within ``DEVICE_GROWTH_MAX``. Fault -> first step
   of the next iteration: the median over the 20 faults.
4. ``hang``: rank 1 of a 2-rank gloo-on-CUDA job starts a kernel that spins
   for days (``torch.cuda._sleep``) and blocks in a synchronize; the
   daemon's hang detection (default settings, learned timeouts) dumps its
   stacks into its log and kills it; the job restarts and finishes on the
   same GPU; the GPU health check before the new round passes (node
   ``gpu_health`` ok, no health failure among the job's events).
"""
from __future__ import annotations

import json
import re

import gpucheck as g
from gpunvml import wait_gpu_idle
from results import Step

FAULTS = 20
CPU_FAULTS = 6   # --cpu: RSS only, and two cores' time is the suite's
ALLOCATED_GROWTH_MAX = 16 << 20
DEVICE_GROWTH_MAX = 256 << 20
RSS_GROWTH_MAX = 256 << 20


def _fault_to_first(logs: str) -> list[float]:
    """Per fault: CRASH in iteration i -> FIRST_STEP of iteration i + 1 (rank 0's)."""
    crashes = {int(it): float(t) for t, it in
               re.findall(r"^CRASH (\d+\.\d+) rank=\d+ step=\d+ iteration=(\d+)", logs, re.M)}
    firsts = {int(it): float(t) for t, a, it in g.FIRST.findall(logs) if a == "0"}
    return [firsts[i + 1] - t for i, t in sorted(crashes.items()) if i + 1 in firsts]


def _growth(logs: str) -> dict:
    """Rank 0's memory at iteration 1 and at the last one: growth per measure."""
    per = {int(it): (int(a), int(dev), int(rss)) for r, it, a, _, dev, rss in
           g.ITER_MEM.findall(logs) if r == "0"}
    if len(per) < 2 or 1 not in per:
        return {}
    last = max(per)
    return {"iterations": last, "allocated": per[last][0] - per[1][0],
            "device": per[last][1] - per[1][1], "rss": per[last][2] - per[1][2],
            "allocated_at_1": per[1][0]}


def inprocess_job(ctx: g.Ctx, step: Step, d, nproc: int, backend: str) -> None:
    width = "256" if ctx.cpu else "2048"
    faults = CPU_FAULTS if ctx.cpu else FAULTS
    cmd = ctx.train_cmd("--inprocess", "--faults", str(faults), "--crash-at-step", "2",
                        "--crash-rank", str(nproc - 1), "--crash-mode", "raise",
                        "--steps", "4", "--step-time", "0.01", "--width", width,
                        backend=backend)
    env = ctx.job_env(ELASTICD_INPROCESS_MAX_RESTARTS=faults + 5,
                      ELASTICD_INPROCESS_REPEAT_LIMIT=faults + 5)
    job_id = g.submit(d, ctx, cmd, nproc=nproc, max_restarts=0, inprocess=True, env=env)
    job, logs, _ = g.finish(d, job_id, 65)
    label = f"3 in-process x{faults}: {ctx.backend(backend)} on {ctx.device}, {nproc} rank" \
            + ("s" if nproc > 1 else "")
    problems = []
    layers = dict(job.restarts_by_layer)
    if g.state(job) != "SUCCEEDED" or job.restarts != 0 or layers.get("inprocess", 0) < faults:
        problems.append(f"restarts {job.restarts}, by layer {layers}; {g.outcome(job, logs)}")
    grow = _growth(logs)
    if not grow:
        problems.append("no ITER_MEM lines from rank 0 for iteration 1 and later")
    elif grow["iterations"] < faults:
        problems.append(f"memory seen up to iteration {grow['iterations']}, not {faults}")
    else:
        if grow["allocated"] > ALLOCATED_GROWTH_MAX:
            problems.append(f"torch.cuda.memory_allocated grew {g.mib(grow['allocated'])}")
        if grow["device"] > DEVICE_GROWTH_MAX:
            problems.append(f"the device's used memory (NVML) grew {g.mib(grow['device'])}")
        if grow["rss"] > RSS_GROWTH_MAX:
            problems.append(f"RSS grew {g.mib(grow['rss'])}")
    times = _fault_to_first(logs)
    numbers = (f"fault->first step median {g.secs(g.median(times))} (max "
               f"{g.secs(max(times) if times else None)}, {len(times)} faults); growth it1->"
               f"it{grow.get('iterations', '?')}: allocated {g.mib(grow.get('allocated'))}, "
               f"device {g.mib(grow.get('device'))}, rss {g.mib(grow.get('rss'))}")
    step.add(label, not problems, numbers, "; ".join(problems) or (
        "--cpu: allocated/device are 0 on CPU; RSS judged" if ctx.cpu else
        f"allocated at it1 {g.mib(grow.get('allocated_at_1'))}"))


def inprocess(ctx: g.Ctx, step: Step) -> None:
    d = g.daemon(ctx, "d")
    try:
        for nproc, backend in ((1, "nccl"), (2, "gloo")):
            try:
                inprocess_job(ctx, step, d, nproc, backend)
            except Exception as exc:  # the other job still runs
                step.crashed(f"3 in-process: {backend}, {nproc} rank(s)", exc)
    finally:
        d.stop()


# -- 4. a kernel that never ends --------------------------------------------------------
STACK = re.compile(r"^(Thread|Current thread) 0x[0-9a-f]+ \(most recent call first\):", re.M)


HEALTH = re.compile(r'^elasticd_gpu_health_checks_total\{result="(\w+)"\} (\d+)', re.M)


def hang(ctx: g.Ctx, step: Step) -> None:
    port = g.free_port()
    d = g.daemon(ctx, "d", metrics_port=port)
    try:
        cmd = ctx.train_cmd("--steps", "60", "--step-time", "0.05", "--hang-at-step", "30",
                            "--crash-rank", "1")
        job_id = g.submit(d, ctx, cmd, nproc=2, max_restarts=1)
        job, logs, events = g.finish(d, job_id, 80)
        node = json.loads(g.ctl(d, "-o", "json", "nodes").stdout)["nodes"][0]
        checks = {k: int(float(v)) for k, v in HEALTH.findall(g.metrics_text(port))}
        rank1 = d.rank_log(job_id, 1)
    finally:
        d.stop()
    crash = min((float(t) for t, r in g.CRASH.findall(logs) if r == "1"), default=None)
    rel = lambda t: None if t is None or crash is None else t - crash  # noqa: E731
    dumped = next((e.time for e in events if e.kind == "hang" and "stacks" in e.reason), None)
    killed = next((e.time for e in events if e.kind == "hang" and "killed" in e.reason), None)
    health_fail = [e.reason for e in events if e.kind == "gpu_health"]
    problems = []
    if crash is None:
        problems.append("rank 1 never reached the hang (no CRASH line)")
    if dumped is None or not STACK.search(rank1) or "train_gpu.py" not in rank1:
        problems.append("no stack dump event, or no Python stacks of train_gpu.py in rank 1's "
                        "log")
    if killed is None:
        problems.append("no 'killed' hang event")
    if g.state(job) != "SUCCEEDED" or job.restarts < 1 or not g.done_ok(logs, 2):
        problems.append(f"not recovered: restarts {job.restarts}; {g.outcome(job, logs)}")
    if node.get("gpu_health") != "ok" or health_fail or checks.get("ok", 0) < 2:
        problems.append(f"GPU health {node.get('gpu_health')!r}, checks {checks} (want one "
                        f"ok per round); " + "; ".join(health_fail)[:200])
    first = g.crash_to_first(logs)
    step.add("4 hung CUDA kernel -> dump, kill, recover" if not ctx.cpu else
             "4 hung rank (sleep in C on --cpu) -> dump, kill, recover", not problems,
             f"hang->stacks {g.secs(rel(dumped))}, ->killed {g.secs(rel(killed))}, "
             f"->first step {g.secs(first)}; health checks {checks}", "; ".join(problems)
             or "the GPU health check passed before each round")
    if not ctx.cpu:
        ok, pids = wait_gpu_idle(ctx.nvml, g.scaled(30))
        step.add("4 GPU idle after (NVML)", ok, note="" if ok else f"still on it: {pids}")
