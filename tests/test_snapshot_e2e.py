"""A job that snapshots every step goes on from its snapshot after a rank is SIGKILLed,
and ends with the weights of a run nothing happened to, bit for bit (issue 32).

A real standalone daemon, the bundled sample job (``elasticd.examples.train
--snapshot-every 1``: model, optimizer and each rank's data generator kept with
``elasticd.snapshot``), two gloo ranks on CPU, no disk checkpoint within reach:
what the restarted ranks go on from can only be the snapshot in memory.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from daemons import DaemonProc, short_tmpdir
from elasticd.v1 import control_pb2 as pb

STEPS = 40
CRASH_AT = 20
TRAIN = [sys.executable, "-m", "elasticd.examples.train", "--steps", str(STEPS),
         "--snapshot-every", "1", "--checkpoint-every", "100000", "--log-every", "100000"]
ATTEMPT = re.compile(r"^attempt (\d+): world size 2, starting at step (\d+) \(from ([^)]*)\)$",
                     re.M)


@pytest.fixture(scope="module")
def node():
    root = short_tmpdir("ed-snap-")
    d = DaemonProc(root, extra_args=("--set", f"snapshot.node_budget={256 << 20}",
                                     "--set", f"snapshot.job_budget={64 << 20}"))
    try:
        yield d.start()
    finally:
        d.cleanup()


def weights(node, job_id: str) -> str:
    found = re.search(r"^WEIGHTS sha256=(\w+)$", node.rank_log(job_id, 0), re.M)
    assert found, node.rank_log(job_id, 0)[-3000:]
    return found.group(1)


def test_a_rank_killed_mid_training_goes_on_from_its_snapshot_bit_for_bit(node):
    ckpt = os.path.join(node.root, "checkpoints")
    calm = node.submit(*TRAIN, "--checkpoint-dir", os.path.join(ckpt, "calm"), nproc=2,
                       max_restarts=0)
    hit = node.submit(*TRAIN, "--checkpoint-dir", os.path.join(ckpt, "hit"),
                      "--crash-at-step", str(CRASH_AT), "--crash-mode", "kill", nproc=2,
                      max_restarts=2)
    for job_id in (calm, hit):
        job = node.wait_job(job_id, timeout=240)
        assert pb.JobState.Name(job.state) == "SUCCEEDED", (job, node.rank_log(job_id, 0)[-3000:])
    assert node.job(hit).restarts == 1
    starts = ATTEMPT.findall(node.rank_log(hit, 0))
    assert starts[0] == ("0", "0", "the beginning"), starts
    # Rank 1 died by SIGKILL right after step CRASH_AT; its last save may not have
    # completed, so the ranks agree on that step or the one before: never the start.
    attempt, step, source = starts[1]
    assert attempt == "1" and source == "a snapshot in memory", starts
    assert CRASH_AT <= int(step) <= CRASH_AT + 1, starts
    assert not os.path.exists(os.path.join(ckpt, "hit"))  # no disk checkpoint was written
    assert weights(node, hit) == weights(node, calm)
