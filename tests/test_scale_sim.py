"""bench/scale_sim.py runs: a few simulated nodes on a real etcd, each with its own lease,
watches, rendezvous and phase publisher; the tables and the BENCH-ROW come out. No timing
is asserted (the numbers are the benchmark's business)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from etcd_server import etcd_binary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary")

SHORT = ("--set", "membership.lease_ttl=1", "--set", "membership.refresh_interval=0.25",
         "--set", "etcd.request_timeout=0.5", "--set", "agent.phase_publish_interval=0.25",
         "--set", "agent.phase_refresh_interval=0.5", "--set", "agent.phase_stale_after=1.5")


def test_the_simulator_runs_its_nodes_and_prints_every_column():
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "scale_sim.py"),
                          "--quick", "--nodes", "5", "--seconds", "0.5", "--procs", "1", *SHORT],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for column in ("etcd writes/s", "etcd req/node/s", "deliveries/s", "deliveries/node/s",
                   "kept up", "etcd CPU", "simulator CPU", "rendezvous (all N)",
                   "loss seen, median", "loss seen, last"):
        assert column in text, (column, text)
    assert "rendezvous" in text and "(ok, " in text, text     # every node got its rank
    assert "BENCH-ROW " in text and '"row": "scale-sim"' in text, text
    for window in ("idle", "running", "after loss"):
        assert any(line.startswith("5 ") and window in line for line in text.splitlines()), \
            (window, text)
