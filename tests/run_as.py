"""Run elasticctl as another user: ``run_as.py UID GID [GROUPS,] -- ARGS...``, or many
commands in one process: ``run_as.py UID GID GROUPS -- --session`` (see the end).

The interpreter lives under /root (mode 0700) on the test machines, so a
non-root user cannot start it. This script starts as root, imports
everything elasticctl needs, then drops to the given uid/gid for real
(setgroups/setgid/setuid) before it speaks to the daemon: the daemon sees
that uid through SO_PEERCRED exactly as for a user's own shell.
"""
import contextlib
import io
import json
import os
import shutil  # noqa: F401  (argparse's help formatter imports it late: load it now)
import sys

import grpc  # noqa: F401  (loaded before the privileges go)

import elasticctl.cli
import elasticctl.client  # noqa: F401
import elasticctl.output  # noqa: F401
from google.protobuf import descriptor_pb2, json_format  # noqa: F401

from elasticd.v1 import control_pb2, control_pb2_grpc


def _warm_up() -> None:
    """Exercise the code paths that import lazily, while files are readable."""
    channel = grpc.insecure_channel("unix:/nonexistent/elasticd-warm-up.sock")
    try:
        control_pb2_grpc.ControlStub(channel).ListJobs(control_pb2.ListJobsRequest(), timeout=0.05)
    except grpc.RpcError:
        pass
    channel.close()
    job = control_pb2.Job(seconds_in_state={"RUNNING": 1.0},
                          last_failure=control_pb2.Failure(cause="x"))
    job.workers.add(rank=0)
    json_format.MessageToDict(job)
    elasticctl.output.job_detail(job)
    elasticctl.output.jobs_table([job])


_warm_up()
uid, gid, groups = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
argv = sys.argv[5:] if sys.argv[4] == "--" else sys.argv[4:]
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(gid)
os.setuid(uid)
assert os.getuid() == uid and os.geteuid() == uid
if argv != ["--session"]:
    sys.exit(elasticctl.cli.main(argv))
# A session: one elasticctl command per line on stdin (a JSON list of its arguments),
# one JSON line back for each: {"rc", "stdout", "stderr"} (many calls, one start).
out = sys.stdout
for line in sys.stdin:
    got_out, got_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(got_out), contextlib.redirect_stderr(got_err):
        rc = elasticctl.cli.main(json.loads(line))
    out.write(json.dumps({"rc": rc, "stdout": got_out.getvalue(),
                          "stderr": got_err.getvalue()}) + "\n")
    out.flush()
