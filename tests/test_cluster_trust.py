"""What a daemon takes from etcd: only specs the cluster key vouches for, checked.

Real root daemons on a real etcd, a real unprivileged user made here
(``h14a_alice``, uid >= 1000) and an attacker who can write etcd (``etcdctl
put``, as anyone could while etcd had no RBAC). Each case was reproduced on
the code before this change: a forged spec ran as root on every node, a
tampered or replayed one ran, a path-like job id had a directory chowned,
and ``etcdctl get --prefix`` printed every job's environment.

The cluster runs with ``cluster.allow_root_jobs=false`` (the default; the
other cluster tests turn it on, see tests/daemons.py).
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from daemons import DaemonProc, cluster_key_path, short_tmpdir
from elasticd.trust import clusterkey
from elasticd.trust.specs import SpecCodec
from elasticd.config import ControlSettings
from elasticd.jobs.spec import JobSpec
from elasticd.jobs.registry import JobRecord
from elasticd.rendezvous.protocol import OPEN, RoundState
from etcd_cluster import NO_SPARES_NOBODY_MAY_CALL as NO_SPARES, fresh_prefix, scrape, wait_for
from etcd_server import EtcdServer, etcd_binary, free_port
from elasticd.v1 import control_pb2 as pb

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real root daemons and a real "
                                                 "user made by the test (CI runs as root)"),
    pytest.mark.skipif(etcd_binary() is None or shutil.which("etcdctl") is None,
                       reason="needs etcd and etcdctl (apt etcd-server etcd-client)"),
]

USER = "h14a_alice"
SECRET = "s3cr3t-" + uuid.uuid4().hex


def _make_user(name: str) -> pwd.struct_passwd:
    subprocess.run(["userdel", name], capture_output=True)
    subprocess.run(["useradd", "-M", "-N", "-g", "nogroup", "-s", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    return pwd.getpwnam(name)


class Cluster:
    """n1 and n2 on one etcd under a fresh prefix; n2 serves metrics."""

    def __init__(self, etcd: EtcdServer):
        self.etcd = etcd
        self.prefix = fresh_prefix()
        self.nodes: list[DaemonProc] = []
        for node in ("n1", "n2"):
            port = free_port() if node == "n2" else 0
            d = DaemonProc(short_tmpdir(), node_id=node, slots=2, etcd=etcd.url, extra_args=(
                "--etcd-prefix", self.prefix, *NO_SPARES,
                "--set", "cluster.allow_root_jobs=false",  # the default, back on (daemons.py)
                "--metrics-port", str(port)))
            d.metrics_port = port
            self.nodes.append(d)

    def etcdctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["etcdctl", "--endpoints", self.etcd.url, *args],
                              capture_output=True, text=True, timeout=30,
                              env=dict(os.environ, ETCDCTL_API="3"))

    def put(self, job_id: str, spec, expected=()) -> None:
        """What an attacker with etcd access does: a spec and an open first round."""
        key = f"{self.prefix}/v1/jobs/{job_id}"
        text = spec if isinstance(spec, str) else json.dumps(spec)
        state = RoundState(round=1, status=OPEN, opened_at=time.time(), expected=tuple(expected),
                           reason="submitted").to_json()
        for suffix, value in (("spec", text), ("state", state)):
            r = self.etcdctl("put", f"{key}/{suffix}", value)
            assert r.returncode == 0, r.stderr

    def stored_spec(self, job_id: str) -> dict:
        r = self.etcdctl("get", "--print-value-only", f"{self.prefix}/v1/jobs/{job_id}/spec")
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        return json.loads(r.stdout)


@pytest.fixture(scope="module")
def cluster():
    with EtcdServer() as etcd:
        c = Cluster(etcd)
        try:
            for d in c.nodes:
                d.start()
            yield c
        finally:
            for d in c.nodes:
                d.cleanup()


@pytest.fixture(scope="module")
def alice():
    user = _make_user(USER)
    work = short_tmpdir("ed-alice-")
    os.chown(work, user.pw_uid, user.pw_gid)
    try:
        yield user, work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run(["userdel", USER], capture_output=True)


def as_user(user) -> tuple:
    return (user.pw_uid, user.pw_gid, [user.pw_gid])


def marker_cmd(marks: str) -> list[str]:
    """Leaves a file named after the job id in ``marks`` wherever it runs."""
    return ["/bin/sh", "-c", f'touch "{marks}/$ELASTICD_JOB_ID.$ELASTICD_NODE_ID"']


def status(d: DaemonProc, job_id: str) -> dict:
    r = d.ctl("-o", "json", "status", job_id)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def rejected_on(d: DaemonProc, job_id: str, reason: str, by_status: bool = True) -> dict:
    """Waits for the spec's ``rejected`` event on ``d`` (exactly one, with ``reason``)
    and, for an id ``status`` accepts, for ``status`` to say REJECTED for ``reason``."""
    def event():
        r = d.ctl("-o", "json", "events", *([job_id] if by_status else []))
        assert r.returncode == 0, r.stderr
        evs = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        return [e for e in evs if e["kind"] == "rejected" and e["job_id"] == job_id]
    evs = wait_for(event, 20, what=f"the rejected event of {job_id} on {d.node_id}")
    assert len(evs) == 1, evs
    assert evs[0]["rejected_reason"] == reason and evs[0]["node_id"] == d.node_id, evs
    assert reason in evs[0]["reason"], evs
    if not by_status:
        return evs[0]
    st = wait_for(lambda: (s := status(d, job_id))["state"] == "REJECTED" and s, 20,
                  what=f"{job_id} REJECTED on {d.node_id}")
    assert st["rejected_reason"] == reason, st
    return st


def never_ran(cluster: Cluster, marks: str, *job_ids: str) -> None:
    """No node took or ran any of ``job_ids``. The witness that each node got past the
    point where it would have adopted one: its ``rejected`` event for it, which dispatch
    records where it decides not to adopt (the callers waited for it: rejected_on)."""
    for d in cluster.nodes:
        r = d.ctl("-o", "json", "events")
        assert r.returncode == 0, r.stderr
        rejected = {e["job_id"] for e in map(json.loads, filter(str.strip, r.stdout.splitlines()))
                    if e["kind"] == "rejected" and e["node_id"] == d.node_id}
        assert set(job_ids) <= rejected, (d.node_id, job_ids, rejected)
        listed = d.ctl("-o", "json", "list", "--all").stdout + d.ctl("-o", "json", "list").stdout
        for job_id in job_ids:
            assert job_id not in listed, f"{d.node_id} took {job_id}: {listed}"
    ran = [f for f in os.listdir(marks) if f.split(".")[0] in job_ids]
    assert not ran, f"rejected specs ran: {ran}"


def forged(job_id: str, uid: int, command: list, cwd: str, **over) -> dict:
    """A spec as the old, unsigned format had it."""
    return dict({"id": job_id, "name": "", "command": command, "cwd": cwd, "env": {},
                 "uid": uid, "gid": uid, "user": "", "min_nodes": 1, "max_nodes": 2,
                 "nproc_per_node": 1, "max_restarts": 0, "nodes": [], "created_at": time.time(),
                 "submitted_on": "n1", "inprocess": False}, **over)


# ---------------------------------------------------------------- forged

def test_a_forged_root_spec_is_never_run_and_shows_as_rejected(cluster, alice):
    _, work = alice
    n1, n2 = cluster.nodes
    cluster.put("forged0", forged("forged0", 0, marker_cmd(work), work))
    for d in cluster.nodes:
        st = rejected_on(d, "forged0", "unsigned")
        assert "signature" in st["reason"], st
    never_ran(cluster, work, "forged0")
    text = n2.ctl("status", "forged0").stdout
    assert "REJECTED" in text and "unsigned" in text, text
    assert n2.ctl("wait", "forged0").returncode == 1  # it will never run
    metrics = scrape(n2.metrics_port)
    assert metrics['elasticd_cluster_specs_rejected_total{reason="unsigned"}'] >= 1, metrics
    assert metrics['elasticd_cluster_specs_rejected_total{reason="uid_not_allowed"}'] == 0
    assert "refused a job spec from etcd" in n2.log() and "forged0" in n2.log()


def test_an_unsigned_spec_rejection_is_hidden_from_other_users(cluster, alice):
    user, work = alice
    cluster.put("forged1", forged("forged1", user.pw_uid, marker_cmd(work), work))
    n1 = cluster.nodes[0]
    rejected_on(n1, "forged1", "unsigned")
    # Its uid is the forger's word: not enough to show it to that user.
    r = n1.ctl("status", "forged1", user=as_user(user))
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr, r.stderr


def test_a_path_like_job_id_touches_no_path(cluster, alice):
    user, work = alice
    target = short_tmpdir("ed-victim-")
    try:
        # `python SCRIPT` and in-process: the daemon would host a job store for it,
        # preparing its run dir (state/run/<id>: the target itself) first.
        spec = forged(target, user.pw_uid, ["python3", "train.py"], work, inprocess=True,
                      nodes=["n1", "n2"])
        cluster.put("pathid", spec)
        for d in cluster.nodes:
            rejected_on(d, "pathid", "unsigned")
        # A signed spec (the test holds the cluster key) whose id is no job id:
        # the same checks as a submission refuse it.
        codec = SpecCodec(clusterkey.load(cluster_key_path()), ControlSettings())
        rec = JobRecord(id="..", command=marker_cmd(work), cwd=work, uid=user.pw_uid,
                        gid=user.pw_gid, user=USER, inprocess=True, created_at=time.time(),
                        node_id="n1", max_nodes=2)
        cluster.put("..", codec.seal(JobSpec.of_record(rec)))
        for d in cluster.nodes:
            assert "id: '..' is not a job id" in rejected_on(d, "..", "invalid",
                                                             by_status=False)["reason"]
        never_ran(cluster, work, "pathid", "..")
        st = os.stat(target)
        assert (st.st_uid, st.st_gid) == (0, 0), "the target directory was chowned"
        for d in cluster.nodes:
            assert os.stat(d.state_dir).st_uid == 0
            assert not os.path.exists(os.path.join(d.state_dir, "logs", target.lstrip("/")))
    finally:
        shutil.rmtree(target, ignore_errors=True)


# ---------------------------------------------------------------- tampered, replayed

def test_tampered_and_replayed_signed_specs_are_refused(cluster, alice):
    user, work = alice
    n1, n2 = cluster.nodes
    # Two real jobs of alice's, pinned to n1: their signed specs are the material.
    ids = []
    for cmd in (marker_cmd(work), ["/bin/sh", "-c", f'touch "{work}/other.$ELASTICD_JOB_ID"']):
        r = n1.ctl("submit", "--nodes", "n1", "--", *cmd, cwd=work, user=as_user(user))
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.strip())
    for job_id in ids:
        assert n1.wait_job(job_id).state == pb.SUCCEEDED
    good, other = (cluster.stored_spec(j) for j in ids)

    def variant(new_id: str, **changes) -> dict:
        spec = dict(good, id=new_id)
        spec.update(changes)
        return spec

    # tampercmd: alice's signed spec with the other job's (encrypted) command pasted
    # in (before sealing: a command of the attacker's choosing).
    pasted = {"sealed": other["sealed"]} if "sealed" in good else \
        {"command": ["/bin/sh", "-c", f'touch "{work}/tampercmd.x"']}
    cases = {
        "tamperuid": (variant("tamperuid", uid=0, gid=0), "bad_signature"),
        "tampercmd": (variant("tampercmd", **pasted), "bad_signature"),
        "tamperid": (variant("tamperid"), "bad_signature"),
        "replayed": (dict(good), "id_mismatch"),
        "tampernode": (variant("tampernode", nodes=["n2"]), "bad_signature"),
    }
    for job_id, (spec, _) in cases.items():
        cluster.put(job_id, spec, expected=spec.get("nodes") or ())
    for job_id, (_, reason) in cases.items():
        for d in cluster.nodes:
            rejected_on(d, job_id, reason)
    never_ran(cluster, work, *cases)
    assert not os.path.exists(os.path.join(work, "tampercmd.x"))
    # The uid of a spec the signature vouched for (a replay of alice's) is hers:
    # she may see that rejection; a tampered one, nobody but root.
    r = n2.ctl("-o", "json", "status", "replayed", user=as_user(user))
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "REJECTED", r.stderr
    r = n2.ctl("status", "tamperuid", user=as_user(user))
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr, r.stderr
    metrics = scrape(n2.metrics_port)
    assert metrics['elasticd_cluster_specs_rejected_total{reason="bad_signature"}'] >= 3
    assert metrics['elasticd_cluster_specs_rejected_total{reason="id_mismatch"}'] >= 1


# ---------------------------------------------------------------- root and users

def test_root_jobs_stay_on_their_node_and_users_jobs_span_nodes(cluster, alice):
    user, work = alice
    n1, n2 = cluster.nodes
    # A root job that needs n2 is refused at once, saying why and what to do.
    r = n1.ctl("submit", "--nnodes", "2", "--", "/bin/true", cwd=work)
    assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stderr, r.stderr
    assert "cluster.allow_root_jobs" in r.stderr, r.stderr
    # One that may run on n1 alone runs there; n2 does not join it.
    r = n1.ctl("submit", "--nnodes", "1:2", "--", "/bin/sh", "-c", "sleep 3", cwd=work)
    assert r.returncode == 0, r.stderr
    root_job = r.stdout.strip()
    rejected_ev = wait_for(lambda: [e for e in (json.loads(x) for x in n2.ctl(
        "-o", "json", "events", root_job).stdout.splitlines() if x.strip())
        if e["kind"] == "rejected"], 20, what="n2's refusal of the root job")
    assert "uid_not_allowed" in rejected_ev[0]["reason"], rejected_ev
    assert "allow_root_jobs" in rejected_ev[0]["reason"], rejected_ev
    done = n1.wait_job(root_job)
    assert done.state == pb.SUCCEEDED and {w.node_id for w in done.workers} == {"n1"}, done
    assert scrape(n2.metrics_port)[
        'elasticd_cluster_specs_rejected_total{reason="uid_not_allowed"}'] >= 1


def test_a_users_secrets_are_not_in_etcd_in_clear_yet_reach_every_node(cluster, alice):
    """Issue 15: `etcdctl get --prefix` printed every job's environment."""
    user, work = alice
    n1 = cluster.nodes[0]
    # alice's 2-node job runs on both; n2 decrypted her environment to run it.
    out = os.path.join(work, "secret-seen")
    r = n1.ctl("submit", "--nnodes", "2", "--", "/bin/sh", "-c",
               f'echo "$RANK $MY_SECRET" >> {out}', cwd=work, user=as_user(user),
               env={"MY_SECRET": SECRET})
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    assert n1.wait_job(job).state == pb.SUCCEEDED
    with open(out) as fh:
        assert sorted(fh.read().split("\n")[:-1]) == [f"0 {SECRET}", f"1 {SECRET}"]

    # ... and nothing under the prefix holds her secret, or her command, in clear.
    dump = cluster.etcdctl("get", "--prefix", cluster.prefix)
    assert dump.returncode == 0 and job in dump.stdout, dump.stderr
    assert SECRET not in dump.stdout, "the job's environment is in etcd in clear"
    assert "secret-seen" not in dump.stdout, "the job's command is in etcd in clear"


def test_a_daemon_on_etcd_needs_a_safe_cluster_key(cluster, tmp_short):
    def start_with(key: str) -> str:
        d = DaemonProc(short_tmpdir(), node_id="nk",
                       etcd=cluster.etcd.url,
                       extra_args=("--etcd-prefix", cluster.prefix, "--set",
                                   f"cluster.key_file={key}"))
        with pytest.raises(RuntimeError) as err:
            d.start(timeout=20)
        d.cleanup()
        return str(err.value)

    missing = os.path.join(tmp_short, "none.key")
    assert "elasticd keygen" in start_with(missing)
    loose = os.path.join(tmp_short, "loose.key")
    subprocess.run([sys.executable, "-m", "elasticd", "keygen", "--out", loose], check=True)
    assert oct(os.stat(loose).st_mode & 0o777) == "0o600"
    os.chmod(loose, 0o640)
    assert "chmod 0600" in start_with(loose)
