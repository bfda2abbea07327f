"""elasticd.snapshot against torch.save / torch.load: what a save stalls training, what a
restore costs, for 1 GiB of state per rank.

    python bench/snapshot_bench.py [--gib 1] [--tensors 8] [--reps 5] [--disk-dir DIR]

One process, one rank (no daemon: the snapshot dir is a private temp dir in
/dev/shm, as the daemon would make one). The state is --tensors float32
tensors of --gib GiB in all, plus a step and an RNG state. Each number is the
median of --reps runs after two warm-up saves (both slots allocated and the
staging buffer made, as in a training loop after its first steps):

* memcpy: one ``copy_`` of every tensor into a preallocated, touched buffer,
  right before the async save (the stall's ratio is taken per rep);
* sync save: ``snapshot.save(step, state)`` (stall = the whole save);
* async stall: ``snapshot.save(step, state, wait=False)`` until it returns
  (the copy into the staging buffer); then its ``wait()``;
* restore: ``snapshot.restore()`` (the tensors map the slot, copy-on-write);
  and restore + ``copy_`` into the model's tensors, as a resume does;
* torch.save to a file in --disk-dir (a disk, not tmpfs: the bench refuses
  tmpfs) + flush + fsync, as a checkpoint is written; torch.load of that file
  (its pages are in the page cache: the kindest case for torch.load), and
  torch.load + the same ``copy_``.

Prints the machine's load, a table, the ratios against the goals (restore
>= 10x faster than torch.load; async stall <= 2x one memcpy) with PASS/MISS,
and BENCH-ROW lines for bench/run_all.py. Never fails on a number.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, ms, table  # noqa: E402
from rows import emit_row  # noqa: E402

GOAL_RESTORE = 10.0   # restore at least this many times faster than torch.load
GOAL_STALL = 2.0      # async stall at most this many memcpys of the state


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (/proc/mounts, longest match)."""
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, parts[2]
    return kind


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state per rank, GiB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--disk-dir", default="/var/tmp", help="where torch.save writes (a disk)")
    a = ap.parse_args(argv)
    kind = fs_type(a.disk_dir)
    if kind in ("tmpfs", "ramfs"):
        ap.error(f"--disk-dir {a.disk_dir} is on {kind}: torch.save must write to a disk")

    import torch
    snapdir = tempfile.mkdtemp(prefix="snapbench-", dir="/dev/shm")
    os.chmod(snapdir, 0o700)
    os.environ["ELASTICD_SNAPSHOT_DIR"] = snapdir
    os.environ.pop("ELASTICD_SNAPSHOT_BUDGET_BYTES", None)
    from elasticd import snapshot

    disk = tempfile.mkdtemp(prefix="snapbench-", dir=a.disk_dir)
    ckpt = os.path.join(disk, "ckpt.pt")
    try:
        n = int(a.gib * (1 << 30)) // 4 // a.tensors
        torch.manual_seed(0)
        state = {"model": {f"layer{i}.weight": torch.randn(n) for i in range(a.tensors)},
                 "step": 0, "rng": torch.get_rng_state()}
        nbytes = sum(t.numel() * 4 for t in state["model"].values())
        dst = {k: torch.empty_like(t) for k, t in state["model"].items()}
        for t in dst.values():
            t.fill_(0)   # touched: the pages exist, as a model's do

        def copy_into(src) -> None:
            for k, t in dst.items():
                t.copy_(src[k])

        print(f"snapshot bench: {nbytes / (1 << 30):.2f} GiB in {a.tensors} tensors, "
              f"{a.reps} reps; {machine()}")
        print(f"snapshot dir {snapdir} (tmpfs), torch.save to {disk} ({kind})", flush=True)
        got: dict[str, list] = {k: [] for k in (
            "memcpy", "sync", "async_stall", "async_total", "restore", "restore_copy",
            "torch_save", "torch_load", "torch_load_copy")}
        step = 0
        for _ in range(2):   # warm-up: both slots allocated, the staging buffer made
            step += 1
            snapshot.save(step, state)
            snapshot.save(step + 1, state, wait=False).wait()
            step += 1
        for rep in range(a.reps):
            step += 1
            state["step"] = step
            got["sync"].append(timed(lambda: snapshot.save(step, state)))
            step += 1
            state["step"] = step
            got["memcpy"].append(timed(lambda: copy_into(state["model"])))  # right before
            t0 = time.perf_counter()
            handle = snapshot.save(step, state, wait=False)
            got["async_stall"].append(time.perf_counter() - t0)
            handle.wait()
            got["async_total"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = snapshot.restore()
            got["restore"].append(time.perf_counter() - t0)
            assert back is not None and back[0] == step
            copy_into(back[1]["model"])
            got["restore_copy"].append(time.perf_counter() - t0)
            assert torch.equal(dst["layer0.weight"], state["model"]["layer0.weight"])
            del back

            def save_disk() -> None:
                with open(ckpt, "wb") as fh:
                    torch.save(state, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            got["torch_save"].append(timed(save_disk))
            t0 = time.perf_counter()
            loaded = torch.load(ckpt)
            got["torch_load"].append(time.perf_counter() - t0)
            copy_into(loaded["model"])
            got["torch_load_copy"].append(time.perf_counter() - t0)
            del loaded
            print(f"  rep {rep + 1}: " + ", ".join(f"{k} {ms(v[-1])}" for k, v in got.items()),
                  flush=True)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(snapdir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in got.items()}
    gbs = lambda s: f"{nbytes / s / 1e9:.1f} GB/s"  # noqa: E731
    print()
    print(table([
        ["memcpy of the state (copy_)", ms(med["memcpy"]), gbs(med["memcpy"])],
        ["snapshot.save (sync)", ms(med["sync"]), gbs(med["sync"])],
        ["snapshot.save(wait=False): stall", ms(med["async_stall"]), gbs(med["async_stall"])],
        ["  ... until complete", ms(med["async_total"]), ""],
        ["torch.save to disk + fsync", ms(med["torch_save"]), gbs(med["torch_save"])],
        ["snapshot.restore", ms(med["restore"]), ""],
        ["snapshot.restore + copy_ into the model", ms(med["restore_copy"]),
         gbs(med["restore_copy"])],
        ["torch.load (file in page cache)", ms(med["torch_load"]), gbs(med["torch_load"])],
        ["torch.load + copy_ into the model", ms(med["torch_load_copy"]), ""],
    ], ["what (median)", "time", "rate"]))
    r_restore = med["torch_load"] / med["restore"]
    r_restore_copy = med["torch_load_copy"] / med["restore_copy"]
    # each async stall against the memcpy just before it (the machine's load drifts)
    r_stall = statistics.median(x / y for x, y in zip(got["async_stall"], got["memcpy"]))
    r_sync = med["torch_save"] / med["sync"]
    r_async = med["torch_save"] / med["async_stall"]
    print()
    print(f"restore vs torch.load: {r_restore:.1f}x faster "
          f"({'PASS' if r_restore >= GOAL_RESTORE else 'MISS'}, goal >= {GOAL_RESTORE:g}x); "
          f"with the copy into the model on both sides: {r_restore_copy:.1f}x")
    print(f"async save stall: {r_stall:.2f}x one memcpy (median of each rep's ratio) "
          f"({'PASS' if r_stall <= GOAL_STALL else 'MISS'}, goal <= {GOAL_STALL:g}x)")
    print(f"save stall vs torch.save + fsync: sync {r_sync:.1f}x, async {r_async:.1f}x less")
    size = f"{nbytes / (1 << 30):.2f} GiB"
    emit_row("snapshot-save", elasticd=f"sync {ms(med['sync'])}, async stall "
                                       f"{ms(med['async_stall'])} ({r_stall:.2f}x one memcpy "
                                       f"{ms(med['memcpy'])}; {size})",
             torch=f"torch.save + fsync {ms(med['torch_save'])}",
             ratio=f"{r_sync:.1f}x sync, {r_async:.1f}x async")
    emit_row("snapshot-restore", elasticd=f"{ms(med['restore'], 2)}; + copy into the model "
                                          f"{ms(med['restore_copy'])} ({size})",
             torch=f"torch.load {ms(med['torch_load'])}; + copy {ms(med['torch_load_copy'])}",
             ratio=f"{r_restore:.0f}x; {r_restore_copy:.1f}x with the copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
