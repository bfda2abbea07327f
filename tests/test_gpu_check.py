"""bench/gpu/check.sh, the GPU check, in its dry mode (``--cpu``) as a GPU run would go.

The GPU machine is lent rarely and for minutes, so every step of the check
runs here first, with gloo on CPU tensors on a daemon that reads a fake
one-GPU inventory: a GPU run then fails only for GPU reasons. Real daemons,
real elasticctl, real torch workers and torchrun, the real script.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(REPO, "bench", "gpu", "check.sh")
STEP_CHECKS = ("1 nodes", "1 job: nccl", "1 job: gloo", "1 metrics", "2 crash -> process",
               "2 crash -> first step vs torchrun", "3 in-process x6: gloo on cpu, 1 rank",
               "3 in-process x6: gloo on cpu, 2 ranks", "4 hung rank", "5 worker template",
               "5 warm spares", "5 cold starts", "5 first step after a restart", "6 snapshot")


def run_check(out, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, str]:
    res = subprocess.run(["bash", CHECK, "--cpu", "--python", sys.executable, "--out",
                          str(out), *args], capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    work = re.search(r"^check\.sh: output .*, work (\S+),", res.stdout, re.M)
    assert work, res.stdout[-3000:] + res.stderr[-3000:]
    return res, work.group(1)


def leftovers(work: str) -> list[int]:
    """Live processes of the run (every process a step starts carries its mark)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("ELASTICD_GPU_CHECK") == work:
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_dry_run_passes_every_step_and_leaves_one_summary_and_one_tarball(tmp_path):
    out = tmp_path / "out"
    res, work = run_check(out, timeout=1450)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-6000:]
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "results.json", "summary.txt"]
    rows = json.loads((out / "results.json").read_text())["rows"]
    for want in STEP_CHECKS:
        assert any(r["check"].startswith(want) for r in rows), (want, rows)
    assert all(r["status"] in ("PASS", "SKIP") for r in rows), rows
    # Nothing is skipped: step 6 runs (elasticd.snapshot exists) with CPU tensors.
    assert [r for r in rows if r["status"] == "SKIP"] == [], rows
    assert [r["status"] for r in rows if r["check"].startswith("6 snapshot")] == ["PASS"], rows
    summary = (out / "summary.txt").read_text()
    assert "| 3 in-process x6: gloo on cpu, 2 ranks | PASS |" in summary
    assert "OK: " in summary and "mode: --cpu" in summary
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("/hang/d/daemon.log") for n in names), names
    assert any(re.search(r"/state/logs/\w+/rank-1\.log$", n) for n in names), names
    assert not os.path.exists(work)        # removed once packed
    assert leftovers(work) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_past_its_timeout_fails_alone_and_leaves_nothing_running(tmp_path):
    out = tmp_path / "out"
    res, work = run_check(out, "--only", "e2e,snapshot", "--timeout", "e2e=2", timeout=280)
    text = res.stdout + res.stderr
    assert res.returncode == 1, text[-4000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    timed_out = [r for r in rows if r["step"] == "e2e" and r["status"] == "FAIL"]
    assert timed_out and "timed out at 2s" in timed_out[-1]["note"], rows
    assert [r["status"] for r in rows if r["step"] == "snapshot"] == ["PASS"]  # runs on
    assert "FAILED: " in (out / "summary.txt").read_text()
    assert leftovers(work) == []


def test_bad_arguments_are_refused(tmp_path):
    for args in (["--only", "nope"], ["--timeout", "e2e=soon"], ["--timeout", "x=3"],
                 ["--frobnicate"]):
        res = subprocess.run(["bash", CHECK, "--cpu", *args], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
