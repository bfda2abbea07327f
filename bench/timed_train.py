"""The sample job, elasticd.examples.train, with timestamps at each start-up phase.

Used only by ``restart_vs_torchrun.py --phase-reps`` to split "worker start
-> first step" into its parts. It runs the unchanged ``train.main`` with the
same arguments and prints, on every rank, lines

    PHASE <name> <unix time> rank=R attempt=A

for: proc_start (when this process was exec'd, from /proc, 10 ms
resolution; for a warm spare that is when the spare started), py_up (first
line of this file runs), torch_imported, init_pg_start / init_pg_done
(dist.init_process_group, which waits for every rank), opt_start / opt_done
(constructing the optimizer, where torch first imports torch._dynamo),
ckpt_start / ckpt_done (torch.load of the checkpoint, after a restart only).
train.py itself prints FIRST_STEP and CRASH.
"""
import os
import sys
import time

PY_UP = time.time()
RANK = os.environ.get("RANK", "?")
ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def mark(name: str, t: float | None = None) -> None:
    print(f"PHASE {name} {time.time() if t is None else t:.6f} rank={RANK} attempt={ATTEMPT}",
          flush=True)


def _proc_start() -> float | None:
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, clock ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError):
        return None


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        mark(f"{name}_start")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(f"{name}_done")
    return wrapper


def main() -> None:
    start = _proc_start()
    if start is not None:
        mark("proc_start", start)
    mark("py_up", PY_UP)
    import torch
    import torch.distributed as dist
    mark("torch_imported")
    dist.init_process_group = _timed("init_pg", dist.init_process_group)
    torch.optim.SGD = _timed("opt", torch.optim.SGD)
    torch.load = _timed("ckpt", torch.load)
    from elasticd.examples import train
    sys.exit(train.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
