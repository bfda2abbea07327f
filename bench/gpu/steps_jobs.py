"""Checks 1 and 2: CUDA jobs through the daemon end to end; a crash that frees a full card.

1. ``e2e``: ``elasticctl nodes`` shows the GPU as NVML reads it, with the
   NUMA node sysfs gives its PCI device; a 1-rank NCCL job and a 2-rank
   gloo-on-CUDA job (both ranks on the one GPU, ``--gpus-per-node 1``) go
   through ``elasticctl submit / wait / status / logs``; each rank's
   CUDA_VISIBLE_DEVICES is the GPU's UUID; the metrics endpoint counts the
   GPU and the jobs.
2. ``crash``: 2 ranks, gloo on CUDA, each holding 40 % of the card
   (``--fill-fraction``); rank 1 dies (os._exit) at step 15; the restarted
   ranks must find their memory free (no out-of-memory); the same job under
   ``torchrun --max-restarts 1`` in the same run: crash -> first CUDA step.
"""
from __future__ import annotations

import json
import os
import re
import time

import gpucheck as g
from gpunvml import nvml_gpu
from results import Step

FILL_GPU = 0.40   # per rank, two ranks: 80 % of the card
FILL_CPU = 0.005  # of the machine's memory, per rank (the same code path, small)


def _sysfs_numa(bus_id: str) -> int:
    """The NUMA node the kernel gives the PCI device (NVML's bus id), -1 if none."""
    dom, bus, rest = bus_id.lower().split(":", 2)
    path = f"/sys/bus/pci/devices/{int(dom, 16):04x}:{bus}:{rest}/numa_node"
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return -1


def check_nodes(ctx: g.Ctx, step: Step, d) -> str:
    """The row for ``elasticctl nodes``; returns the UUID a job's ranks must see."""
    res = g.ctl(d, "-o", "json", "nodes")
    if res.returncode != 0:
        step.add("1 nodes: GPU inventory", False, note=f"elasticctl nodes exit "
                 f"{res.returncode}: {res.stderr.strip()[:200]}")
        return g.FAKE_UUID
    node = json.loads(res.stdout)["nodes"][0]
    devs = node.get("devices") or []
    table = g.ctl(d, "nodes").stdout
    if ctx.cpu:
        ok = (node.get("gpu_source") == "fake" and len(devs) == 1
              and devs[0]["uuid"] == g.FAKE_UUID and devs[0]["numa_node"] == 0
              and f"GPUs of {node['node_id']}" in table)
        step.add("1 nodes: GPU inventory", ok, f"source {node.get('gpu_source')}, "
                 f"{len(devs)} GPU", "--cpu: the fake inventory; NVML needs the GPU")
        return g.FAKE_UUID
    info = nvml_gpu(ctx.nvml)
    sysfs = _sysfs_numa(info["bus_id"])
    try:
        nvml_numa = str(ctx.nvml.nvmlDeviceGetNumaNodeId(ctx.nvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception as exc:  # older NVML or not supported on this board
        nvml_numa = f"n/a ({type(exc).__name__})"
    problems = []
    if node.get("gpu_source") != "nvml":
        problems.append(f"source {node.get('gpu_source')!r}, not nvml")
    if len(devs) != 1:
        problems.append(f"{len(devs)} devices listed")
    else:
        dev = devs[0]
        if dev["uuid"] != info["uuid"]:
            problems.append(f"uuid {dev['uuid']} != NVML's {info['uuid']}")
        if int(dev["memory_mib"]) != info["total"] >> 20:
            problems.append(f"memory {dev['memory_mib']} MiB != NVML's {info['total'] >> 20}")
        if int(dev["numa_node"]) != sysfs:
            problems.append(f"numa {dev['numa_node']} != sysfs {sysfs}")
        if info["uuid"] not in table:
            problems.append("the table form does not list the GPU")
    numa = devs[0]["numa_node"] if devs else "-"
    step.add("1 nodes: GPU from NVML + NUMA", not problems,
             f"{info['name']}, numa {numa} (sysfs {sysfs}, NVML {nvml_numa}), bus "
             f"{info['bus_id']}", "; ".join(problems) or (
                 "numa -1: the kernel gives this PCI device no node (one-node machine)"
                 if sysfs == -1 else ""))
    return info["uuid"]


def ctl_job(ctx: g.Ctx, step: Step, d, check: str, nproc: int, backend: str,
            uuid: str) -> None:
    """submit -> wait -> status -> logs through elasticctl, as a user would."""
    cmd = ctx.train_cmd("--steps", "20", "--step-time", "0.02", backend=backend)
    t0 = time.time()
    res = g.ctl(d, "submit", "--nproc-per-node", str(nproc), "--gpus-per-node", "1",
                "--max-restarts", "0", "--env", f"PYTHONPATH={ctx.job_env()['PYTHONPATH']}",
                "--env", "PYTHONUNBUFFERED=1", "--", *cmd)
    if res.returncode != 0:
        step.add(check, False, note=f"submit exit {res.returncode}: {res.stderr.strip()[:200]}")
        return
    job_id = res.stdout.strip()
    waited = g.ctl(d, "wait", job_id, timeout=40)
    status = json.loads(g.ctl(d, "-o", "json", "status", job_id).stdout or "{}")
    logs = "\n".join(g.ctl(d, "logs", job_id, "--rank", str(r)).stdout for r in range(nproc))
    problems = []
    if waited.returncode != 0 or status.get("state") != "SUCCEEDED":
        problems.append(f"wait exit {waited.returncode}, state {status.get('state')}: "
                        f"{str(status.get('reason', ''))[:150]}")
    uuids = {tuple(w.get("gpu_uuids", [])) for w in status.get("workers", [])}
    if uuids != {(uuid,)}:
        problems.append(f"status says the ranks hold {sorted(uuids)}, not ({uuid},)")
    seen = {r: v for r, v, _ in g.ENV.findall(logs)}
    if sorted(seen) != [str(r) for r in range(nproc)] or set(seen.values()) != {uuid}:
        problems.append(f"CUDA_VISIBLE_DEVICES per rank {seen}, want {uuid}")
    if not g.done_ok(logs, nproc):
        errs = [ln.strip() for ln in logs.splitlines() if re.search(r"\w+Error: ", ln)]
        problems.append("no 'DONE ... check=ok' from every rank" + (f": {errs[-1][:200]}"
                                                                     if errs else ""))
    # Defaults keep a worker template: a rank that starts cold here means the template
    # was refused (the first GPU run found OpenBLAS's threads doing that to 1-rank jobs).
    if status.get("start_path") != "template":
        problems.append(f"ranks started {status.get('start_path') or 'cold'}, not from the "
                        "worker template: see the daemon's log for why")
    first = [float(t) for t, a, _ in g.FIRST.findall(logs) if a == "0"]
    step.add(check, not problems,
             f"submit->first step {g.secs(min(first) - t0 if first else None)}, "
             f"CUDA init {g.secs(g.cuda_init(logs))}",
             "; ".join(problems) or f"CUDA_VISIBLE_DEVICES={uuid}")
    with open(os.path.join(ctx.work, f"{re.sub(r'[^a-z0-9]+', '_', check)}.log"), "w") as fh:
        fh.write(logs)


def check_metrics(step: Step, port: int) -> None:
    text = g.metrics_text(port)
    want = {"elasticd_gpus": r"^elasticd_gpus 1\.0$",
            "elasticd_gpus_free": r"^elasticd_gpus_free 1\.0$",
            "elasticd_gpu_health_checks_total": r"^elasticd_gpu_health_checks_total\{.*\} [1-9]",
            "elasticd_workers_started_total": r"^elasticd_workers_started_total\{?.*\}? [1-9]",
            "elasticd_job_transitions_total": r"^elasticd_job_transitions_total\{.*\} [1-9]"}
    missing = [name for name, pat in want.items() if not re.search(pat, text, re.M)]
    step.add("1 metrics", not missing, f"{len(text.splitlines())} lines",
             ("missing or zero: " + ", ".join(missing)) if missing else "")


def e2e(ctx: g.Ctx, step: Step) -> None:
    port = g.free_port()
    d = g.daemon(ctx, "d", metrics_port=port)
    try:
        uuid = check_nodes(ctx, step, d)
        ctl_job(ctx, step, d, "1 job: nccl, 1 rank" + (" (gloo on --cpu)" if ctx.cpu else ""),
                1, "nccl", uuid)
        ctl_job(ctx, step, d, f"1 job: gloo on {ctx.device}, 2 ranks on one GPU", 2, "gloo",
                uuid)
        check_metrics(step, port)
    finally:
        d.stop()


# -- 2. crash with a full card ------------------------------------------------------------
def _restart_memory(logs: str, fraction: float) -> tuple[list, int | None]:
    """Problems with the restarted ranks' memory, and the least free any of them saw."""
    problems = []
    mems = [(int(r), int(f), int(t)) for r, a, f, t in g.MEM.findall(logs) if a == "1"]
    if len(mems) < 2:
        problems.append(f"{len(mems)} restarted ranks reported their memory")
    for rank, free, total in mems:
        if free < int(total * fraction):
            problems.append(f"rank {rank} found {g.mib(free)} free of {g.mib(total)}, needs "
                            f"{g.mib(int(total * fraction))}")
    if re.search(r"^FILL_OOM ", logs, re.M) or "out of memory" in logs.lower():
        problems.append("out of memory in a rank's log")
    return problems, min((f for _, f, _ in mems), default=None)


def crash(ctx: g.Ctx, step: Step) -> None:
    fraction = FILL_CPU if ctx.cpu else FILL_GPU
    args = ["--steps", "30", "--step-time", "0.05", "--fill-fraction", str(fraction),
            "--crash-at-step", "15", "--crash-rank", "1", "--crash-mode", "exit"]
    d = g.daemon(ctx, "d")
    try:
        job_id = g.submit(d, ctx, ctx.train_cmd(*args), nproc=2, max_restarts=1)
        job, logs, _ = g.finish(d, job_id, 60)
    finally:
        d.stop()
    problems, least_free = _restart_memory(logs, fraction)
    if g.state(job) != "SUCCEEDED" or job.restarts != 1:
        problems.insert(0, f"restarts {job.restarts}; {g.outcome(job, logs)}")
    ours = g.crash_to_first(logs)
    step.add(f"2 crash -> process restart, each rank holding {fraction:.1%}", not problems,
             f"crash->first step {g.secs(ours)}, least free at restart {g.mib(least_free)}",
             "; ".join(problems))

    rc, out, err = g.torchrun(ctx, "torchrun", 2, [g.TRAIN, "--backend", "gloo", "--device",
                                                     ctx.device, *args], 60)
    theirs = g.crash_to_first(out)
    note = "" if rc == 0 and theirs is not None else (
        f"torchrun {'did not end' if rc is None else f'exit {rc}'}: "
        + (re.findall(r"^FILL_OOM .*$", out, re.M) + [
            ln.strip() for ln in err.splitlines() if "Error" in ln] + ["?"])[0][:200])
    ratio = f", torchrun/elasticd {theirs / ours:.1f}x" if ours and theirs else ""
    step.add("2 crash -> first CUDA step vs torchrun" if not ctx.cpu else
             "2 crash -> first step vs torchrun", ours is not None,
             f"elasticd {g.secs(ours)}, torchrun {g.secs(theirs)}{ratio}", note)
