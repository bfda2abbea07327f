"""The training script of the network-namespace cluster tests (netcluster.py).

    python netcluster_train.py REPORT CKPT_DIR STEPS STEP_SECONDS COLLECTIVE_TIMEOUT

Gloo on CPU, one tiny all_reduce per step. Every rank appends one JSON line
per event to REPORT (a file outside the namespaces: they share the
filesystem), so the test's safety checker can see who ran when:

    {"ev": "start"|"step"|"done"|"error", "job", "round", "rank", "world",
     "host", "pid", "t", "step", "ok"}

"start" is written before torch is imported, so the checker learns a worker's
pid as early as possible. Each step all_reduces rank+1; "ok" says whether the
sum was world*(world+1)/2. Rank 0 keeps the step count in CKPT_DIR, so a new
round resumes where the last one stopped. A collective that cannot finish
(a peer gone or cut off) fails after COLLECTIVE_TIMEOUT seconds and the
worker exits 1, as a real job's would.
"""
import json
import os
import sys
import time

REPORT, CKPT, STEPS, STEP_SECONDS, TIMEOUT = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                              float(sys.argv[4]), float(sys.argv[5]))
ENV = os.environ
ME = {"job": ENV.get("ELASTICD_JOB_ID", ""), "round": int(ENV.get("ELASTICD_ROUND", "0")),
      "rank": int(ENV["RANK"]), "world": int(ENV["WORLD_SIZE"]),
      "host": ENV.get("ELASTICD_NODE_ID", ""), "pid": os.getpid()}


def report(ev: str, **fields) -> None:
    line = json.dumps({"ev": ev, **ME, "t": time.time(), **fields}) + "\n"
    fd = os.open(REPORT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write: lines of different ranks never mix
    finally:
        os.close(fd)


def load_step() -> int:
    try:
        with open(os.path.join(CKPT, "step")) as fh:
            return int(fh.read().strip() or 0)
    except FileNotFoundError:
        return 0


def save_step(step: int) -> None:
    os.makedirs(CKPT, exist_ok=True)
    tmp = os.path.join(CKPT, f".step-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(str(step))
    os.replace(tmp, os.path.join(CKPT, "step"))


def main() -> int:
    report("start")
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    rank, world = dist.get_rank(), dist.get_world_size()
    start = torch.tensor([load_step() if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(start, 0)
    step = int(start.item())
    want = world * (world + 1) / 2
    while step < STEPS:
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        step += 1
        report("step", step=step, ok=bool(x.item() == want))
        if rank == 0:
            save_step(step)
        time.sleep(STEP_SECONDS)
    dist.barrier()
    report("done", step=step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a failed collective: say so, exit 1 as a real job would
        report("error", error=f"{type(exc).__name__}: {exc}"[:300])
        raise
