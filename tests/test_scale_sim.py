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
                   "loss recorded, median", "loss recorded, last"):
        assert column in text, (column, text)
    assert "rendezvous" in text and "(ok, " in text, text     # every node got its rank
    assert "BENCH-ROW " in text and '"row": "scale-sim"' in text, text
    assert "recorded by the loss witnesses (n" in text, text   # a witness among the 5
    for window in ("idle", "running", "after loss"):
        assert any(line.startswith("5 ") and window in line for line in text.splitlines()), \
            (window, text)


def test_replay_nodes_load_etcd_beside_the_daemons_code_and_see_the_loss():
    # 10 of 20 nodes run the daemon's code (two jobs of 5 formed by its rendezvous), 10
    # replay its traffic (two jobs of 5; the 2 killed among them): the 20-node job's
    # round forms, decided by a daemon-code node with the replay nodes' joins, each
    # node with its rank; the loss witnesses, daemon-code nodes all, record both
    # victims lost ("last" is printed only then).
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "scale_sim.py"),
                          "--nodes", "20", "--job-nodes", "5", "--daemon-nodes", "10",
                          "--seconds", "1", "--procs", "1", "--replay-procs", "1", *SHORT],
                         capture_output=True, text=True, timeout=180, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "10 nodes run the daemon's code, 10 replay its etcd traffic" in text, text
    assert "; rendezvous " in text and "N-node rendezvous skipped" not in text, text
    assert "4 jobs of 5 formed at once" in text and "WRONG RANKS" not in text, text
    assert "deliveries/node/s, daemon-code nodes" in text, text
    summary = [line for line in text.splitlines() if line.startswith("20 ")][-1].split()
    assert summary[-1] != "-", text       # the loss's last: both victims' rows written
    witnesses = [line for line in text.splitlines() if "recorded by the loss witnesses" in line]
    assert witnesses and "(slot 2)" in witnesses[-1], text
    assert '"row": "scale-sim-replay"' in text, text


def test_replay_nodes_need_whole_jobs_and_the_victims():
    base = [sys.executable, os.path.join(REPO, "bench", "scale_sim.py"), "--nodes", "20"]
    for extra, says in ((["--daemon-nodes", "10"], "needs --job-nodes"),
                        (["--job-nodes", "5", "--daemon-nodes", "12"], "a multiple of S"),
                        (["--job-nodes", "5", "--daemon-nodes", "20", "--nodes", "21"],
                         "must be replay nodes")):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=60,
                             cwd=REPO)
        assert out.returncode == 2 and says in out.stderr, (extra, out.stderr[-2000:])
