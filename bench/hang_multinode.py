"""A hung rank of a job across 2 nodes -> first training step after recovery, at defaults.

    python bench/hang_multinode.py                 # this tree: about 1.5 minutes
    PYTHONPATH=/path/to/old/daemon:/path/to/old/ctl python bench/hang_multinode.py \\
        --window 400                               # an older tree, for "before"

Two real daemons (n1, n2) on one real etcd (tests/etcd_server.py, tests'
Cluster), default settings; one job of 2 ranks (one per node, gloo); the
script is tests/test_hang_multinode.py's HANG_ON_N2: 0.05 s steps, and at
step 60 of its first attempt the rank on n2 prints ``HANG <unix time>`` and
sleeps for an hour, so the rank on n1 blocks in its next all_reduce. Printed:
HANG -> the first "killed" hang event (which rule killed it) -> the first
step after recovery (``FIRST_STEP`` of a later attempt in n1's rank log).

Before phases crossed nodes (tree d994964 .. the merge of h17's second part) a
job across nodes kept the fixed agent.hang_hard_timeout (180 s); now it gets the
learned ones (10 s at these steps). Never asserts a timing.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from etcd_server import EtcdServer  # noqa: E402
from test_hang_multinode import HANG_ON_N2, SPARES_WARM  # noqa: E402
from test_multinode import PY, Cluster, events, rank_log, status, submit  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=300.0,
                    help="seconds to wait for the job to finish")
    a = ap.parse_args(argv)
    with EtcdServer() as etcd:
        c = Cluster(etcd, 2)
        try:
            path = os.path.join(c.shared, "hang.py")
            with open(path, "w") as fh:
                fh.write(HANG_ON_N2)
            os.chmod(path, 0o644)
            job = submit(c["n1"], "--nnodes", "2", "--nproc-per-node", "1",
                         "--max-restarts", "2", "--env", f"WARM={SPARES_WARM}",
                         cmd=[PY, path])
            c["n1"].wait_job(job, timeout=a.window)
            st = status(c["n1"], job)
            ranks = {w["node_id"]: w.get("rank", 0) for w in st.get("workers", [])}
            hang = re.search(r"^HANG ([\d.]+)$", rank_log(c["n2"], job, ranks["n2"]), re.M)
            firsts = [float(t) for n, t in re.findall(r"^FIRST_STEP (\d+) ([\d.]+)$",
                                                      rank_log(c["n1"], job, ranks["n1"]),
                                                      re.M) if int(n) >= 1]
            kills = sorted((e["time"], d.node_id, e["reason"]) for d in c.nodes.values()
                           for e in events(d, job) if e["kind"] == "hang"
                           and "killed" in e["reason"])
            print(f"job {job}: {st['state']}, restarts {st.get('restarts', 0)}")
            if hang is None:
                print("no HANG in the log: the run did not reach the fault")
                return 1
            at = float(hang.group(1))
            for t, _, why in kills[:1]:
                print(f"HANG -> killed: {float(t) - at:.1f}s ({why})")
            print("HANG -> first step after recovery: "
                  + (f"{firsts[0] - at:.1f}s" if firsts else f"none within {a.window:g}s"))
        finally:
            c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
