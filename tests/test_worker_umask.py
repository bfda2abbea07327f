"""Workers start with a login's umask, not the daemon's (systemd gives it UMask=0077)."""
from __future__ import annotations

import os
import sys

from elasticd.v1 import control_pb2 as pb
from elasticd.workers.group import WORKER_UMASK


def test_workers_start_with_a_login_umask_whatever_the_daemons(daemon_factory):
    old = os.umask(0o077)  # the daemon inherits it, as from the unit's UMask=
    try:
        daemon = daemon_factory().start()
    finally:
        os.umask(old)
    job = daemon.submit(sys.executable, "-c", "import os; print('umask %o' % os.umask(0))")
    assert pb.JobState.Name(daemon.wait_job(job).state) == "SUCCEEDED", daemon.log()[-2000:]
    assert WORKER_UMASK == 0o022
    assert "umask 22\n" in daemon.rank_log(job, 0)
