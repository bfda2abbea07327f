"""Plain torchrun with --rdzv-backend=elasticd against a real etcd, no daemon."""
import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest

from etcd_server import EtcdServer, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None or shutil.which("torchrun") is None,
                                reason="needs etcd (apt etcd-server) and torchrun (torch)")


def test_backend_is_registered_under_the_torchrun_entry_point():
    eps = importlib.metadata.entry_points(group="torchrun.handlers")
    ep = next(e for e in eps if e.name == "elasticd")
    creator = ep.load()()
    assert callable(creator)


def test_daemon_side_never_imports_torch():
    code = ("import sys, elasticd.daemon, elasticd.rendezvous.round, elasticd.control.service;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture
def etcd():
    with EtcdServer() as server:
        yield server


def _torchrun(etcd, run_id, workdir, extra, nnodes="2"):
    endpoint = etcd.url.replace("http://", "")  # host:port, as torch users write it
    cmd = ["torchrun", "--nnodes", nnodes, "--nproc-per-node", "1",
           "--rdzv-backend", "elasticd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
           "--monitor-interval", "0.1", *extra]
    return cmd


def test_two_torchrun_agents_train_and_recover_from_a_crash(etcd, tmp_path):
    ck = str(tmp_path / "ck")
    cmd = _torchrun(etcd, "adapter-crash", str(tmp_path),
                    ["--max-restarts", "2", "-m", "elasticd.examples.train", "--steps", "40",
                     "--checkpoint-every", "10", "--checkpoint-dir", ck,
                     "--crash-at-step", "15"])
    logs = [open(tmp_path / f"agent{i}.log", "w+") for i in range(2)]
    procs = [subprocess.Popen(cmd, stdout=logs[i], stderr=subprocess.STDOUT, cwd=tmp_path,
                              start_new_session=True) for i in range(2)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    text = "".join(open(tmp_path / f"agent{i}.log").read() for i in range(2))
    assert codes == [0, 0], text[-4000:]
    assert "injected failure on rank 1" in text       # the crash happened...
    assert "all_reduce check ok" in text              # ...and training finished right
    assert "world size 2" in text
