"""A small torchrun-style training script, bundled as elasticd's sample job.

It runs unchanged under ``torchrun`` and under ``elasticctl submit``: it reads
RANK/WORLD_SIZE/MASTER_ADDR/... from the environment, trains a tiny model
with gloo (CPU) for ``--steps`` steps, checkpoints every
``--checkpoint-every`` steps, resumes from the last checkpoint after a
restart, and checks at the end that every rank holds the same weights and
that an all_reduce of the ranks sums right.

``--snapshot-every N`` also keeps the state (model, optimizer, each rank's
data generator) in memory with ``elasticd.snapshot`` every N steps: a restart
goes on from the newest snapshot every rank holds, bit for bit as if nothing
had happened, and from the disk checkpoint only when that is newer. Each rank that
restores one says so: ``RESTORED rank=R step=S source=local|peer in T s``.

``--crash-at-step K`` makes ``--crash-rank`` fail once, on the first attempt
only (TORCHELASTIC_RESTART_COUNT == 0), to show recovery. Rank 0 ends with a
``WEIGHTS sha256=...`` line: runs that trained the same steps print the same.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--checkpoint-dir", default="",
                   help="default: ./checkpoints/<TORCHELASTIC_RUN_ID>")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="keep the state in memory (elasticd.snapshot) every N steps; 0: off")
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-mode", choices=("raise", "exit", "kill"), default="raise")
    p.add_argument("--crash-every-attempt", action="store_true",
                   help="fail on every attempt, not just the first")
    p.add_argument("--step-time", type=float, default=0.0, help="sleep per step (seconds)")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def checkpoint_path(args) -> str:
    base = args.checkpoint_dir or os.path.join(
        os.getcwd(), "checkpoints", os.environ.get("TORCHELASTIC_RUN_ID", "local"))
    return os.path.join(base, "last.pt")


def save(path: str, model, opt, step: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint


def crash(mode: str, rank: int, step: int) -> None:
    print(f"CRASH {time.time():.6f} rank={rank} step={step}", flush=True)
    print(f"rank {rank}: crashing on purpose at step {step} ({mode})", flush=True)
    if mode == "exit":
        os._exit(3)
    if mode == "kill":
        os.kill(os.getpid(), 9)
    raise RuntimeError(f"injected failure on rank {rank} at step {step}")


def resume(args, model, opt, gen) -> tuple[int, str]:
    """The step to go on from and where it came from: the newest of the ranks'
    common snapshot (collective: every rank calls it) and the disk checkpoint."""
    start, source = 0, "the beginning"
    if args.snapshot_every:
        from elasticd import snapshot
        got = snapshot.restore()
        if got is not None:
            start, state = got
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            gen.set_state(state["gen"])
            source = "a snapshot in memory"
            took = snapshot.timings()
            print(f"RESTORED rank={os.environ.get('RANK')} step={start} "
                  f"source={took.restore_source} in {took.restore_s:.3f} s", flush=True)
    path = checkpoint_path(args)
    if os.path.exists(path):
        state = torch.load(path)
        if state["step"] > start:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start, source = state["step"], "the disk checkpoint"
    return start, source


def take_snapshot(model, opt, gen, done: int) -> None:
    """``done`` steps trained: the state to go on from, copied now, kept in the background."""
    from elasticd import snapshot
    snapshot.save(done, {"model": model.state_dict(), "opt": opt.state_dict(),
                         "gen": gen.get_state()}, wait=False)


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@record
def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = checkpoint_path(args)
    gen = torch.Generator().manual_seed(1000 + rank)
    start, source = resume(args, model, opt, gen)
    if rank == 0:
        print(f"attempt {attempt}: world size {world}, starting at step {start} (from "
              f"{source})", flush=True)
    first = True
    for step in range(start, args.steps):
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # plain data parallel: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if args.snapshot_every and (step + 1) % args.snapshot_every == 0:
            take_snapshot(model, opt, gen, step + 1)
        if first and rank == 0:
            print(f"FIRST_STEP {time.time():.6f} attempt={attempt} step={step}", flush=True)
        first = False
        if args.step_time:
            time.sleep(args.step_time)
        if (step == args.crash_at_step and rank == args.crash_rank
                and (attempt == 0 or args.crash_every_attempt)):
            crash(args.crash_mode, rank, step)
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
        if (step + 1) % args.checkpoint_every == 0:
            dist.barrier()
            if rank == 0:
                save(path, model, opt, step + 1)
    check = torch.tensor([float(rank)])
    dist.all_reduce(check)
    expected = world * (world - 1) / 2
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = weights.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    same = torch.equal(spread, weights)
    # Everyone is done with collectives before rank 0 (which hosts the
    # rendezvous store) may leave.
    dist.barrier()
    dist.destroy_process_group()
    if check.item() != expected or not same:
        print(f"rank {rank}: CHECK FAILED (sum {check.item()} != {expected} or weights differ)",
              flush=True)
        return 1
    if rank == 0:
        print(f"WEIGHTS sha256={digest(model)}", flush=True)
        print(f"done: {args.steps} steps, world size {world}, all_reduce check ok", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running C++ destructors: in torch 2.13 gloo's threads can
    # abort the process at exit ("terminate called without an active
    # exception") when a peer has already gone, turning a finished run into a
    # failure. Everything worth keeping is flushed and checkpointed by now.
    os._exit(code)
