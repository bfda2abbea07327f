"""What sealing the in-process job store's records costs.

    python bench/jobstore_records_bench.py                  # both parts, ~30 s
    python bench/jobstore_records_bench.py --part codec --reps 20000
    python bench/jobstore_records_bench.py --part iteration --world 2,8 --iterations 100

(a) codec: ``RecordSealer.seal`` and ``open`` (HMAC-SHA256 over the key name and
    payload) of a barrier marker and of a 200-byte fault reason; median of
    --reps calls, in microseconds.
(b) iteration: the coordination of one clean in-process iteration (every rank:
    enter, start barrier, finish with the ``ok`` verdict; a fault scan per rank
    between them, as a monitor tick does) on a real torch TCPStore served by
    ``jobstore/server.py``, W ranks as threads with a connection each; median and p90
    per iteration over --iterations. The code measured is whatever ``elasticd``
    this interpreter imports: run it with PYTHONPATH pointing at another
    checkout's daemon/ for the "before" figure (an ``IterationStore`` without
    sealed records is driven the way that checkout's wrapper drove it).

Prints numbers, never asserts a timing.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, median, percentile, revision, table  # noqa: E402

from elasticd.jobstore import address as jobstore_env  # noqa: E402
from elasticd.inprocess import coord as coord_mod  # noqa: E402


def sealed() -> bool:
    return "sealer" in inspect.signature(coord_mod.IterationStore).parameters


def part_codec(reps: int) -> None:
    from elasticd.inprocess.records import RecordSealer
    secret = jobstore_env.new_secret()
    s = RecordSealer(jobstore_env.record_key(secret), jobstore_env.key_prefix(secret, "3", "1"))
    it = s.within("it4/")
    rows = []
    for what, key, payload in (("marker", "start/r17", b"start"),
                               ("fault (200 B)", "fault/0", b"x" * 200)):
        value = it.seal(key, payload)
        t_seal, t_open = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            it.seal(key, payload)
            t1 = time.perf_counter()
            assert it.open(key, value, "bench") == payload
            t2 = time.perf_counter()
            t_seal.append(t1 - t0)
            t_open.append(t2 - t1)
        rows.append([what, f"{median(t_seal) * 1e6:.2f}", f"{median(t_open) * 1e6:.2f}",
                     str(len(value))])
    print(table(rows, ["record", "seal µs (median)", "open µs (median)", "value bytes"]))


def _store():
    jobstore = os.path.join(os.path.dirname(os.path.abspath(jobstore_env.__file__)),
                            "jobstore/server.py")
    proc = subprocess.Popen([sys.executable, jobstore, "--host", "127.0.0.1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line[:1] == ["ELASTICD_STORE"], line
    return proc, line[1], int(line[2])


def part_iteration(worlds: list[int], iterations: int) -> None:
    import torch.distributed as dist
    proc, host, port = _store()
    rows = []
    try:
        for world in worlds:
            secret = jobstore_env.new_secret()
            prefix = jobstore_env.key_prefix(secret, "0", f"{world}")
            clients = [dist.PrefixStore(prefix, dist.TCPStore(
                host, port, is_master=False, timeout=datetime.timedelta(seconds=60)))
                for _ in range(world)]
            times = []
            for n in range(iterations):
                starts, ends = [0.0] * world, [0.0] * world
                threads = [threading.Thread(target=_one_rank,
                                            args=(clients[r], r, world, n, secret, starts, ends))
                           for r in range(world)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                times.append(max(ends) - min(starts))
            rows.append([str(world), f"{median(times) * 1e3:.2f}",
                         f"{percentile(times, 90) * 1e3:.2f}",
                         f"{statistics.mean(times) * 1e3:.2f}"])
    finally:
        proc.stdin.close()
        proc.wait(10)
    print(table(rows, ["ranks", "iteration ms (median)", "p90", "mean"]))


def _one_rank(root, rank: int, world: int, n: int, secret: str, starts, ends) -> None:
    import torch.distributed as dist
    store = dist.PrefixStore(f"it{n}/", root)
    kw = {}
    if sealed():
        from elasticd.inprocess.records import RecordSealer
        prefix = jobstore_env.key_prefix(secret, "0", f"{world}")
        kw["sealer"] = RecordSealer(jobstore_env.record_key(secret), prefix).within(f"it{n}/")
    c = coord_mod.IterationStore(store, rank, world, poll=0.002, beat=lambda: None, **kw)
    starts[rank] = time.perf_counter()
    if sealed():
        c.enter()
    else:
        root.set("latest", str(n))
    c.barrier("start", 60)
    assert c.fault() is None   # one monitor tick
    assert c.finish(60) is None
    ends[rank] = time.perf_counter()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("codec", "iteration", "both"), default="both")
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--world", default="2,8")
    ap.add_argument("--iterations", type=int, default=100)
    args = ap.parse_args()
    print(f"# {machine()}  rev {revision()}  sealed records: {sealed()}")
    if args.part in ("codec", "both") and sealed():
        part_codec(args.reps)
    if args.part in ("iteration", "both"):
        part_iteration([int(w) for w in args.world.split(",")], args.iterations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
