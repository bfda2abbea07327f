"""A rank of bench/replication_bench.py: fixed work per step, a snapshot of its state each step.

    python bench/replication_worker.py --steps 200 --state-mib 64 --snapshot

Each step does the same compute (``--matmuls`` products of 256x256 floats),
one gloo all-reduce across the ranks, touches every byte of its state (as an
optimizer step does), and with ``--snapshot`` saves the state with
``elasticd.snapshot.save`` (synchronous). Rank 0 prints, after the run, the
time per step of the steps after ``--warmup``:

    STEPTIME mean=<ms> p50=<ms> p90=<ms> steps=<n> cpu=<ms>

(``cpu``: this process's CPU time per step over the same steps, all its threads.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--state-mib", type=int, default=64)
    p.add_argument("--matmuls", type=int, default=40)
    p.add_argument("--snapshot", action="store_true")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(dist.get_rank())
    state = torch.randn(a.state_mib << 18)          # 4-byte floats
    w = torch.randn(256, 256) / 16
    if a.snapshot:
        from elasticd import snapshot
    took = []
    for step in range(a.steps):
        if step == a.warmup:
            cpu0 = time.process_time()
        t = time.perf_counter()
        x = w
        for _ in range(a.matmuls):
            x = torch.tanh(x @ w)
        g = x.sum().reshape(1)
        dist.all_reduce(g)
        state.add_(1e-7)
        if a.snapshot:
            snapshot.save(step, {"state": state, "w": w})
        took.append(time.perf_counter() - t)
    cpu = (time.process_time() - cpu0) / max(1, a.steps - a.warmup)
    dist.barrier()
    if dist.get_rank() == 0:
        ms = sorted(1000 * t for t in took[a.warmup:])
        print(f"STEPTIME mean={statistics.fmean(ms):.2f} p50={ms[len(ms) // 2]:.2f} "
              f"p90={ms[int(len(ms) * 0.9)]:.2f} steps={len(ms)} cpu={1000 * cpu:.2f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
