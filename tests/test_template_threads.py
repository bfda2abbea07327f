"""A job with one rank per node still gets its ranks from the worker template when
numpy is installed, and its ranks get the BLAS threads a cold start would have.

OpenBLAS (loaded by numpy, which torch imports when it is there) starts one
thread per CPU as it loads; a template with threads is unsafe to fork, so
before the template pinned OpenBLAS to one thread during its imports, every
1-rank job on a machine with numpy started cold (seen first on a 16-core GPU
machine: "the template runs 16 native threads"). Real standalone daemon, real
torch workers, numpy as users have it.
"""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from daemons import DaemonProc, short_tmpdir
from elasticd.v1 import control_pb2 as pb
from elasticd.workers.warmstart import blas_threads_wanted

np = pytest.importorskip("numpy", reason="needs numpy (the test extras install it)")

SCRIPT = textwrap.dedent("""\
    import json, os, sys
    PRE = "numpy" in sys.modules
    import numpy as np
    import torch
    a = np.ones((512, 512))
    for _ in range(3):
        a.dot(a)
    seen = {"pre": PRE, "tasks": len(os.listdir("/proc/self/task")),
            "torch_threads": torch.get_num_threads(),
            "blas_env": {k: v for k, v in os.environ.items() if k.endswith("_NUM_THREADS")}}
    with open(sys.argv[1], "w") as fh:
        json.dump(seen, fh)
    """)


def _cold_tasks(tmp: str) -> int:
    """Threads numpy's OpenBLAS starts in a plain process on this machine."""
    import subprocess
    out = subprocess.run([sys.executable, "-c", "import os, numpy; "
                          "print(len(os.listdir('/proc/self/task')))"],
                         capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")})
    return int(out.stdout)


def test_a_one_rank_job_is_forked_from_the_template_with_numpy_loaded():
    root = short_tmpdir("ed-thr-")
    d = DaemonProc(root).start()
    try:
        script = os.path.join(root, "job.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT)
        out = os.path.join(root, "seen.json")
        assert not any(k.endswith("_NUM_THREADS") for k in os.environ), \
            "the test's own environment sizes the pools: run it without *_NUM_THREADS"
        job_id = d.submit(sys.executable, script, out, nproc=1, max_restarts=0)
        job = d.wait_job(job_id, timeout=120)
        assert pb.JobState.Name(job.state) == "SUCCEEDED", d.log()
        log = d.log()
        assert "forked from the worker template" in log, log
        assert "native threads" not in log, log
        with open(out) as fh:
            seen = json.load(fh)
        assert seen["pre"], "numpy was not imported by the template"
        assert "OPENBLAS_NUM_THREADS" not in seen["blas_env"], seen
        cpus = len(os.sched_getaffinity(0))
        if cpus > 1 and _cold_tasks(root) > 1:
            assert seen["tasks"] > 1, f"the rank's BLAS pool was not restored: {seen}"
    finally:
        d.cleanup()


@pytest.mark.parametrize("env, cpus, wanted", [
    ({}, 16, 16),
    ({"OMP_NUM_THREADS": "4"}, 16, 4),
    ({"GOTO_NUM_THREADS": "3", "OMP_NUM_THREADS": "4"}, 16, 3),
    ({"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "4"}, 16, 2),
    ({"OPENBLAS_NUM_THREADS": "x", "OMP_NUM_THREADS": "0"}, 8, 8),
])
def test_blas_threads_follow_openblas_order_of_variables(env, cpus, wanted):
    assert blas_threads_wanted(env, cpus) == wanted
