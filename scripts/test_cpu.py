#!/usr/bin/env python3
"""Where a test run's time went: the cases ELASTICD_TEST_CPU_LOG=DIR recorded
(tests/conftest.py), by file and by case, heaviest CPU first.

    ELASTICD_TEST_CPU_LOG=/tmp/cpu bash scripts/test.sh
    python3 scripts/test_cpu.py /tmp/cpu [--top 30]

CPU counts each case's own process and every process it reaped (its daemons,
their workers): on a machine of few cores that, not wall time, is what a case
takes from the others running beside it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the directory ELASTICD_TEST_CPU_LOG named")
    p.add_argument("--top", type=int, default=30, help="rows of each table (default 30)")
    a = p.parse_args()
    rows = []
    for path in glob.glob(os.path.join(a.dir, "cpu-*.jsonl")):
        with open(path) as fh:
            rows += [json.loads(line) for line in fh if line.strip()]
    if not rows:
        print(f"no cases recorded under {a.dir}")
        return 1
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0, 0.0])
    for r in rows:
        f = files[r["id"].split("::")[0]]
        f[0] += r["cpu"]
        f[1] += r["wall"]
        f[2] += 1
        f[3] += r.get("ctl_calls", 0)
        f[4] += r.get("ctl_cpu", 0.0)
    cpu, wall = sum(r["cpu"] for r in rows), sum(r["wall"] for r in rows)
    ctl = sum(r.get("ctl_cpu", 0.0) for r in rows)
    span = max(r["start"] + r["wall"] for r in rows) - min(r["start"] for r in rows)
    print(f"{len(rows)} cases: {cpu:.0f} s CPU ({ctl:.0f} s of it elasticctl runs), "
          f"{wall:.0f} s of case wall time, {span:.0f} s from the first start to the last end")
    print(f"\n{'CPU s':>8} {'wall s':>8} {'cases':>5} {'ctl':>5} {'ctl s':>6}  file")
    for name, (c, w, n, k, kc) in sorted(files.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"{c:8.1f} {w:8.1f} {n:5d} {k:5d} {kc:6.1f}  {name}")
    print(f"\n{'CPU s':>8} {'wall s':>8}  case")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:a.top]:
        print(f"{r['cpu']:8.1f} {r['wall']:8.1f}  {r['id']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
