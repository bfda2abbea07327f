"""Jobs run as the user who submitted them, and users only touch their own.

The daemon runs as root (as under systemd); elasticctl runs as `nobody`
for real (tests/run_as.py drops privileges before it connects), so the
daemon learns that uid from SO_PEERCRED, not from anything the client says.
"""
import json
import os

import pytest

from elasticd.v1 import control_pb2 as pb

NOBODY = (65534, 65534, [65534])

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: the daemon switches to the submitting user "
                                       "(CI runs as root)")


@pytest.fixture
def shared_daemon(daemon_factory):
    # The control socket's group is nogroup, so `nobody` may connect.
    return daemon_factory(extra_args=("--set", "daemon.socket_group=65534")).start()


@pytest.fixture
def nobody_dir(shared_daemon):
    path = os.path.join(shared_daemon.root, "nobody-work")
    os.mkdir(path)
    os.chown(path, 65534, 65534)
    return path


def test_socket_is_0660_with_the_configured_group(shared_daemon):
    st = os.stat(shared_daemon.socket)
    assert oct(st.st_mode & 0o777) == "0o660"
    assert st.st_gid == 65534


def test_workers_run_as_the_submitting_user(shared_daemon, nobody_dir):
    out = os.path.join(nobody_dir, "ids")
    r = shared_daemon.ctl("-o", "json", "submit", "--nproc-per-node", "2", "--",
                          "/bin/sh", "-c", f'echo "$RANK $(id -u) $(id -g)" >> {out}',
                          cwd=nobody_dir, user=NOBODY)
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["id"]
    job = shared_daemon.wait_job(job_id)
    assert job.state == pb.SUCCEEDED, job
    assert job.uid == 65534 and job.user == "nobody"
    lines = sorted(open(out).read().split("\n")[:-1])
    assert lines == ["0 65534 65534", "1 65534 65534"]


def test_other_users_job_is_permission_denied(shared_daemon, nobody_dir):
    root_job = shared_daemon.submit("/bin/sleep", "60")
    shared_daemon.wait_state(root_job, "RUNNING")

    status = shared_daemon.ctl("status", root_job, user=NOBODY)
    assert status.returncode == 1
    assert "PERMISSION_DENIED" in status.stderr and "root" in status.stderr

    cancel = shared_daemon.ctl("cancel", root_job, user=NOBODY)
    assert cancel.returncode == 1 and "PERMISSION_DENIED" in cancel.stderr
    logs = shared_daemon.ctl("logs", root_job, user=NOBODY)
    assert logs.returncode == 1 and "PERMISSION_DENIED" in logs.stderr
    # The root job is untouched.
    assert shared_daemon.job(root_job).state == pb.RUNNING

    # nobody lists only its own jobs; root sees everyone's.
    mine = shared_daemon.ctl("-o", "json", "submit", "--", "/bin/true", cwd=nobody_dir,
                             user=NOBODY)
    nobody_job = json.loads(mine.stdout)["id"]
    seen = json.loads(shared_daemon.ctl("-o", "json", "list", user=NOBODY).stdout)
    assert [j["id"] for j in seen["jobs"]] == [nobody_job]
    seen_by_root = json.loads(shared_daemon.ctl("-o", "json", "list").stdout)
    assert {root_job, nobody_job} <= {j["id"] for j in seen_by_root["jobs"]}

    # root may act on anyone's job.
    assert shared_daemon.ctl("cancel", root_job).returncode == 0
    shared_daemon.wait_state(root_job, "CANCELLED", timeout=15)


def test_a_user_cannot_reach_a_socket_outside_its_group(daemon_factory, nobody_dir=None):
    # Default group "elasticd" does not exist here: only root may connect.
    d = daemon_factory().start()
    r = d.ctl("list", user=NOBODY)
    assert r.returncode == 3
    assert "permission denied" in r.stderr.lower()


def test_token_is_bound_to_the_kernel_identity(shared_daemon, nobody_dir):
    """A uid claimed in the environment changes nothing: the kernel says who calls."""
    r = shared_daemon.ctl("-o", "json", "submit", "--", "/bin/sh", "-c", "id -u",
                          cwd=nobody_dir, user=NOBODY, env={"USER": "root", "UID": "0"})
    job = shared_daemon.wait_job(json.loads(r.stdout)["id"])
    assert job.uid == 65534
    assert "65534" in shared_daemon.rank_log(job.id, 0)
