"""The GPU check's training job: torchrun-style, gloo or NCCL, on CUDA or CPU tensors.

    python bench/gpu/train_gpu.py --backend nccl|gloo --device cuda|cpu [--steps N]
        [--step-time S] [--width W] [--fill-fraction F]
        [--crash-at-step K [--crash-rank R] [--crash-mode exit|raise] [--crash-file F]]
        [--hang-at-step K [--crash-rank R]] [--inprocess --faults N] [--snapshot]

It reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT and
TORCHELASTIC_RESTART_COUNT as torchrun sets them, so it runs unchanged
under ``torchrun`` and ``elasticctl submit``. Rank R uses CUDA device
``LOCAL_RANK % device_count()``: with one GPU every rank shares it (gloo
over CUDA tensors; an NCCL group must then have one rank).

Faults come only in the first process attempt (TORCHELASTIC_RESTART_COUNT
0): ``--crash-at-step`` (``exit``: os._exit(3) with the memory still held;
``raise``; with ``--crash-file`` at the first step from K on at which
the file exists), ``--hang-at-step`` (a CUDA kernel that never ends,
``torch.cuda._sleep``, then a synchronize that blocks in C; on CPU a sleep
in C). ``--inprocess`` wraps the training function in
``elasticd.inprocess.Wrapper`` and faults (raises) in each of the first
``--faults`` iterations. ``--fill-fraction F`` holds F of the device's
memory (of the machine's on CPU) for the whole attempt: a restart whose
predecessor's memory is not yet free fails with out-of-memory.

Lines printed for bench/gpu/check.py, each flushed, workers' clock:

    CUDA_STATE rank=R initialized=0|1 bad_fork=0|1 libcuda=0|1   before touching CUDA
    CUDA_INIT <seconds> rank=R device=NAME        creating the CUDA context
    MEM rank=R attempt=A free=B total=B           before the fill
    ENV rank=R cuda_visible=... gpus=...
    FIRST_STEP <time> attempt=A iteration=I       rank 0, after each first step
    CRASH <time> rank=R step=S                    just before a fault
    ITER_MEM rank=R iteration=I allocated=B reserved=B device_used=B
    SNAPSHOT key=value ...                        --snapshot (elasticd.snapshot)
    DONE rank=R steps=N check=ok
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="gloo")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-time", type=float, default=0.05, help="sleep per step (seconds)")
    p.add_argument("--width", type=int, default=256, help="hidden width of the model")
    p.add_argument("--fill-fraction", type=float, default=0.0)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--crash-mode", choices=("exit", "raise"), default="exit")
    p.add_argument("--crash-file", default="",
                   help="crash at the first step from --crash-at-step on at which this file "
                        "exists (attempt 0 runs at most --steps; later ones --restart-steps)")
    p.add_argument("--restart-steps", type=int, default=10)
    p.add_argument("--hang-at-step", type=int, default=-1)
    p.add_argument("--inprocess", action="store_true")
    p.add_argument("--faults", type=int, default=0, help="in-process: iterations that fault")
    p.add_argument("--snapshot", action="store_true",
                   help="save / restore the state with elasticd.snapshot (1 GiB)")
    p.add_argument("--snapshot-bytes", type=int, default=1 << 30)
    return p.parse_args(argv)


HELD: list = []  # the memory --fill-fraction holds
RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def say(line: str) -> None:
    print(line, flush=True)


def libcuda_mapped(pid: str = "self") -> bool:
    """Whether the CUDA driver library is loaded in this process (cuInit needs it)."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return any("libcuda.so" in line for line in fh)
    except OSError:
        return False


def cuda_state(torch) -> None:
    """What this process inherited: a rank forked from a template that had started
    CUDA would read initialized or bad_fork here, before it touches CUDA itself."""
    bad = getattr(torch._C, "_cuda_isInBadFork", lambda: False)()
    say(f"CUDA_STATE rank={RANK} initialized={int(torch.cuda.is_initialized())} "
        f"bad_fork={int(bad)} libcuda={int(libcuda_mapped())}")


def init_device(torch, args):
    if args.device == "cpu":
        return torch.device("cpu")
    cuda_state(torch)
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda: torch {torch.__version__} sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    t0 = time.perf_counter()
    dev = torch.device("cuda", LOCAL_RANK % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    say(f"CUDA_INIT {time.perf_counter() - t0:.6f} rank={RANK} "
        f"device={torch.cuda.get_device_name(dev).replace(' ', '_')}")
    return dev


def memory(torch, dev) -> tuple[int, int]:
    """(free, total) bytes of the device, or of the machine on CPU."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)
    import psutil
    vm = psutil.virtual_memory()
    return vm.available, vm.total


def fill(torch, dev, fraction: float):
    """Hold ``fraction`` of the memory; out-of-memory ends the process with a clear line."""
    free, total = memory(torch, dev)
    say(f"MEM rank={RANK} attempt={ATTEMPT} free={free} total={total}")
    if fraction <= 0:
        return None
    want = int(total * fraction)
    try:
        held = torch.zeros(want, dtype=torch.uint8, device=dev)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        say(f"FILL_OOM rank={RANK} attempt={ATTEMPT} wanted={want} free={free}: "
            f"{str(exc).splitlines()[0][:200]}")
        raise
    say(f"FILL rank={RANK} attempt={ATTEMPT} bytes={want}")
    return held


def device_used(torch, dev) -> int:
    """Bytes in use on the whole device: NVML where nvidia-ml-py is there, else CUDA's."""
    if dev.type != "cuda":
        return 0
    try:
        import pynvml
        pynvml.nvmlInit()
        uuid = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[dev.index or 0]
        h = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid.startswith("GPU-")
             else pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0))
        return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
    except Exception:
        free, total = torch.cuda.mem_get_info(dev)
        return total - free


def hang(torch, dev, step: int) -> None:
    say(f"CRASH {time.time():.6f} rank={RANK} step={step} hang")
    if dev.type == "cuda":
        torch.cuda._sleep(1 << 50)    # a kernel that spins for days
        torch.cuda.synchronize(dev)   # blocks in C: only the daemon's kill ends it
    time.sleep(3600)                  # CPU: asleep in C


def train(args, torch, dist, dev, iteration: int = 0) -> int:
    gc.collect()  # what the last iteration left is garbage now; count only what is kept
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w),
                                torch.nn.ReLU(), torch.nn.Linear(w, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    fault_here = (ATTEMPT == 0 and rank == args.crash_rank
                  and (not args.inprocess or iteration < args.faults))
    steps = args.restart_steps if args.crash_file and ATTEMPT else args.steps
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + rank + 7919 * step)
        x = torch.randn(64, w, generator=gen).to(dev)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) / w)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if step == 0:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if rank == 0:
                say(f"FIRST_STEP {time.time():.6f} attempt={ATTEMPT} iteration={iteration}")
            if args.inprocess:
                alloc = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
                reserved = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
                import psutil
                say(f"ITER_MEM rank={rank} iteration={iteration} allocated={alloc} "
                    f"reserved={reserved} device_used={device_used(torch, dev)} "
                    f"rss={psutil.Process().memory_info().rss}")
        if args.step_time:
            time.sleep(args.step_time)
        if fault_here and step == args.hang_at_step:
            hang(torch, dev, step)
        if fault_here and (step >= args.crash_at_step and os.path.exists(args.crash_file)
                           if args.crash_file else step == args.crash_at_step):
            say(f"CRASH {time.time():.6f} rank={rank} step={step} iteration={iteration}")
            if args.crash_mode == "exit" and not args.inprocess:
                os._exit(3)
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    check = torch.tensor([float(rank)], device=dev)
    dist.all_reduce(check)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = weights.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    ok = check.item() == world * (world - 1) / 2 and torch.equal(spread, weights)
    # Every rank is done with its collectives before any leaves: a peer that exits while
    # this one still tears down its group has aborted it in gloo's C++ teardown
    # ("terminate called without an active exception") after DONE was printed.
    dist.barrier()
    say(f"DONE rank={rank} steps={steps} iteration={iteration} "
        f"check={'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def snapshot_round(args, torch, dev) -> None:
    """Save ``--snapshot-bytes`` of device tensors through elasticd.snapshot (sync and
    async), then, after the crash, restore them and check they came back whole."""
    from elasticd import snapshot
    n = args.snapshot_bytes // 4
    if ATTEMPT == 0:
        state = {"w": torch.arange(n, dtype=torch.float32, device=dev)}
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        snapshot.save(1, state)
        sync = time.perf_counter() - t0
        t0 = time.perf_counter()
        handle = snapshot.save(2, state, wait=False)
        stall = time.perf_counter() - t0
        handle.wait()
        say(f"SNAPSHOT saved bytes={n * 4} sync_s={sync:.6f} async_stall_s={stall:.6f}")
        return
    t0 = time.perf_counter()
    got = snapshot.restore()
    took = time.perf_counter() - t0
    if got is None:
        say("SNAPSHOT restored none")
        return
    step, state = got
    w = state["w"]
    ok = w.device.type == dev.type and torch.equal(
        w, torch.arange(n, dtype=torch.float32, device=w.device))
    say(f"SNAPSHOT restored step={step} restore_s={took:.6f} device={w.device.type} "
        f"equal={int(ok)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record
    dev = init_device(torch, args)
    say(f"ENV rank={RANK} cuda_visible={os.environ.get('CUDA_VISIBLE_DEVICES', '-')} "
        f"gpus={os.environ.get('ELASTICD_GPUS', '-')} pid={os.getpid()}")
    HELD.append(fill(torch, dev, args.fill_fraction))  # kept for the whole attempt
    if args.inprocess:
        from elasticd.inprocess import Wrapper
        limit = args.faults + 5
        wrapped = Wrapper(backend=args.backend, max_restarts=limit, repeat_limit=limit)(
            lambda iteration: train(args, torch, dist, dev, iteration))
        return record(wrapped)()
    kwargs = {"device_id": dev} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, **kwargs)
    try:
        if args.snapshot:
            snapshot_round(args, torch, dev)
            if ATTEMPT == 0:
                say(f"CRASH {time.time():.6f} rank={RANK} step=0 snapshot")
                os._exit(3)
        return record(train)(args, torch, dist, dev)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
