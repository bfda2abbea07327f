"""The sample training job, restarted in-process after a fault (elasticd.inprocess).

    elasticctl submit --inprocess --nproc-per-node 2 -- \\
        python -m elasticd.examples.train_inprocess --steps 300 --crash-at-step 100

Same model, data and checks as ``elasticd.examples.train``, but the training
function is wrapped in ``elasticd.inprocess.Wrapper``: when a rank fails,
every rank re-enters ``train`` in the same process with the next
``iteration``, and resumes from the snapshot ``elasticd.snapshot`` keeps in
shared memory every ``--checkpoint-every`` steps (the ranks agree on the
newest one they all hold); a rank replaced by a new process, and every rank
of a new process attempt, resumes from it too. ``--crash-at-step K`` makes ``--crash-rank`` raise once, in
iteration 0 of the first process attempt (``--crash-always``: every time it
gets there), by raising or, with ``--crash-mode exit``, by ``os._exit(3)``
(the daemon then replaces the dead rank with a new process); ``--crash-mode
hang`` makes it sleep in C until elasticd's hang detection kills it. It
prints ``CRASH <unix time>``
before failing and ``FIRST_STEP <unix time> attempt=A iteration=I`` after
the first step of each iteration, for bench/inprocess_vs_process.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elasticd import snapshot as snapshots
from elasticd.inprocess import Wrapper


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-mode", choices=("raise", "exit", "hang"), default="raise")
    p.add_argument("--crash-always", action="store_true",
                   help="crash every time the step is reached, not only the first time")
    p.add_argument("--step-time", type=float, default=0.0, help="sleep per step (seconds)")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


REPLACED = bool(os.environ.get("ELASTICD_INPROCESS_REPLACES"))  # a new process for a dead rank


def snapshot(model, opt, step: int) -> None:
    """``step`` steps trained: copied now, kept in shared memory in the background."""
    snapshots.save(step, {"model": model.state_dict(), "opt": opt.state_dict()}, wait=False)


def agreed_start(model, opt) -> int:
    """The newest snapshot every rank holds (collective); load it (0: start afresh)."""
    got = snapshots.restore()
    if got is None:
        return 0
    step, state = got
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return step


def train(args, iteration: int = 0) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = agreed_start(model, opt)
    if rank == 0:
        print(f"attempt {attempt} iteration {iteration}: world size {world}, starting at step "
              f"{start}, pid {os.getpid()}", flush=True)
    first = True
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(1000 + rank + 7919 * step)  # same data on replay
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if first and rank == 0:
            print(f"FIRST_STEP {time.time():.6f} attempt={attempt} iteration={iteration} "
                  f"step={step}", flush=True)
        first = False
        if args.step_time:
            time.sleep(args.step_time)
        if (step == args.crash_at_step and rank == args.crash_rank
                and (args.crash_always or (attempt == 0 and iteration == 0 and not REPLACED))):
            print(f"CRASH {time.time():.6f} rank={rank} step={step}", flush=True)
            if args.crash_mode == "exit":
                os._exit(3)
            if args.crash_mode == "hang":
                time.sleep(3600)  # in C: only the daemon's hang detection ends it
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
        if (step + 1) % args.checkpoint_every == 0:
            snapshot(model, opt, step + 1)
    check = torch.tensor([float(rank)])
    dist.all_reduce(check)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = weights.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    if check.item() != world * (world - 1) / 2 or not torch.equal(spread, weights):
        print(f"rank {rank}: CHECK FAILED (sum {check.item()}, weights equal "
              f"{torch.equal(spread, weights)})", flush=True)
        return 1
    print(f"rank {rank}: done: {args.steps} steps, iteration {iteration}, pid {os.getpid()}, "
          f"all_reduce sum {check.item():g} ok", flush=True)
    return 0


@record  # a fault the wrapper gives up on reaches the daemon as an error file, at once
def main(argv=None) -> int:
    args = parse_args(argv)
    return Wrapper(backend="gloo")(train)(args)


if __name__ == "__main__":
    sys.exit(main())
