"""The etcd RBAC that `elasticd etcd-roles` sets up, on a real etcd with auth on.

The daemons log in as a user with the ``elasticd-daemon`` role and run a job;
torchrun users log in with the ``elasticd-torchrun`` role (credentials from
``ELASTICD_ETCD_*``, never the daemons' keys) and run a 2-node torchrun job,
but can neither read nor write the daemons' prefix.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from elasticd.store import StoreAuthError, StoreError
from elasticd.store.etcd3 import Etcd3Store
from etcd_server import EtcdServer, etcd_binary, make_certs
from elasticd.v1 import control_pb2 as pb

pytestmark = [
    pytest.mark.skipif(etcd_binary() is None or shutil.which("etcdctl") is None
                       or shutil.which("torchrun") is None,
                       reason="needs etcd, etcdctl (apt etcd-server etcd-client) and torchrun"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a real daemon runs the job"),
]

PASSWORDS = {"root": "root-pw-h14a", "h14a-daemon": "daemon-pw-h14a",
             "h14a-trainer": "trainer-pw-h14a"}


@pytest.fixture
def auth_etcd(tmp_short):
    with EtcdServer() as etcd:
        def etcdctl(*args: str) -> None:
            r = subprocess.run(["etcdctl", "--endpoints", etcd.url, *args], capture_output=True,
                               text=True, timeout=30, env=dict(os.environ, ETCDCTL_API="3"))
            assert r.returncode == 0, (args, r.stderr)

        files = {}
        for user, password in PASSWORDS.items():
            etcdctl("user", "add", f"{user}:{password}", "--interactive=false")
            files[user] = os.path.join(tmp_short, f"{user}.pw")
            with open(files[user], "w") as fh:
                fh.write(password + "\n")
            os.chmod(files[user], 0o600)
        etcdctl("auth", "enable")
        yield etcd, files


def login(etcd, user: str) -> Etcd3Store:
    return Etcd3Store(etcd.endpoints, timeout=5, username=user, password=PASSWORDS[user])


def two_node_torchrun(etcd, run_id: str, tmp_path, env: dict, conf: str = "") -> list:
    """Two torchrun agents of one 2-node job on ``etcd``; asserts both trained.
    Returns the command line."""
    cmd = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "elasticd",
           "--rdzv-endpoint", etcd.url.split("://")[1], "--rdzv-id", run_id,
           *(["--rdzv-conf", conf] if conf else []),
           "--monitor-interval", "0.1", "-m", "elasticd.examples.train", "--steps", "5"]
    logs = [open(tmp_path / f"{run_id}-{i}.log", "w+") for i in range(2)]
    procs = [subprocess.Popen(cmd, stdout=logs[i], stderr=subprocess.STDOUT, cwd=tmp_path,
                              env=env, start_new_session=True) for i in range(2)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    text = "".join(open(tmp_path / f"{run_id}-{i}.log").read() for i in range(2))
    assert codes == [0, 0], text[-4000:]
    assert "world size 2" in text, text[-2000:]
    return cmd


@pytest.mark.slow  # a TLS etcd and a torchrun job through it: most of a minute
def test_torchrun_reaches_a_tls_etcd_with_a_client_certificate(tmp_path):
    certs = make_certs(str(tmp_path / "pki"))
    with EtcdServer(certs=certs, client_cert_auth=True) as etcd:
        # From rdzv-conf keys; a bare host:port means https once TLS is configured.
        two_node_torchrun(etcd, "tls-job", tmp_path, dict(os.environ),
                          conf=f"ca_cert={certs.ca},cert={certs.client_cert},"
                               f"key={certs.client_key}")
        # The wrong CA: torchrun fails instead of talking to an unverified etcd.
        bad = subprocess.run(
            ["torchrun", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend",
             "elasticd", "--rdzv-endpoint", etcd.url.split("://")[1], "--rdzv-id", "tls-bad",
             "-m", "elasticd.examples.train", "--steps", "1"], capture_output=True, text=True,
            timeout=120, cwd=tmp_path, env=dict(os.environ, ELASTICD_ETCD_CA_CERT=certs.other_ca,
                                                ELASTICD_ETCD_CERT=certs.client_cert,
                                                ELASTICD_ETCD_KEY=certs.client_key))
        assert bad.returncode != 0, bad.stdout[-2000:]
        assert "certificate" in (bad.stdout + bad.stderr).lower()


def test_etcd_roles_prints_the_etcdctl_setup():
    out = subprocess.run([sys.executable, "-m", "elasticd", "etcd-roles", "--etcd-prefix",
                          "/prod"], capture_output=True, text=True, check=True).stdout
    assert "etcdctl role grant-permission elasticd-daemon --prefix=true readwrite /prod/" in out
    assert ("etcdctl role grant-permission elasticd-torchrun --prefix=true readwrite "
            "/elasticd-torchrun/") in out
    clash = subprocess.run([sys.executable, "-m", "elasticd", "etcd-roles", "--etcd-prefix",
                            "/elasticd-torchrun/x"], capture_output=True, text=True)
    assert clash.returncode == 2 and "overlap" in clash.stderr, clash.stderr


@pytest.mark.slow  # an etcd with auth, two daemons and torchrun users: most of a minute
def test_daemons_and_torchrun_users_each_reach_only_their_prefix(auth_etcd, daemon_factory,
                                                                 tmp_path):
    etcd, pw = auth_etcd
    r = subprocess.run([sys.executable, "-m", "elasticd", "etcd-roles", "--apply",
                        "--etcd", etcd.url, "--user", "root", "--password-file", pw["root"],
                        "--daemon-user", "h14a-daemon", "--torchrun-user", "h14a-trainer"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "role elasticd-daemon: readwrite on /elasticd/*" in r.stdout, r.stdout

    # A daemon logged in as the daemon user works under /elasticd.
    d = daemon_factory(node_id="rb1", etcd=etcd.url, extra_args=(
        "--set", "etcd.username=h14a-daemon", "--set", f"etcd.password_file={pw['h14a-daemon']}",
        "--set", "agent.warm_spares=false")).start()
    job = d.submit("/bin/true")
    assert d.wait_job(job).state == pb.SUCCEEDED, d.log()[-3000:]

    # The torchrun user: nothing of the daemons', read or write.
    trainer = login(etcd, "h14a-trainer")
    try:
        for attempt in (lambda: trainer.put("/elasticd/v1/jobs/evil/spec", "{}"),
                        lambda: trainer.list("/elasticd/v1/jobs/"),
                        lambda: trainer.get(f"/elasticd/v1/jobs/{job}/spec")):
            with pytest.raises(StoreAuthError):
                attempt()
        trainer.put("/elasticd-torchrun/probe", "ok")  # its own prefix it may use
    finally:
        trainer.close()

    # ... and a 2-node torchrun job with those credentials, from the environment.
    env = dict(os.environ, ELASTICD_ETCD_USERNAME="h14a-trainer",
               ELASTICD_ETCD_PASSWORD_FILE=pw["h14a-trainer"])
    cmd = two_node_torchrun(etcd, "rbac-job", tmp_path, env)

    # Without credentials, torchrun cannot even start a round.
    bare_cmd = ["torchrun", "--nnodes", "1", *cmd[3:10], "rbac-none", "-m",
                "elasticd.examples.train", "--steps", "1"]
    bare = subprocess.run(bare_cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ))
    assert bare.returncode != 0, bare.stdout[-2000:]

    # Root sees (in etcd's history: a finished run leaves no keys) that the torchrun job
    # wrote where it belongs, and nothing of it under the daemons' prefix.
    admin = login(etcd, "root")
    try:
        _, now = admin.list("/")
        ours = {e.key for e in admin.watch("/elasticd-torchrun/v1/jobs/rbac-job/", 0,
                                           timeout=5) if e.revision <= now}
        assert ours, "the torchrun job wrote nothing under its prefix"
        assert admin.list("/elasticd-torchrun/v1/jobs/rbac-job/")[0] == []  # and left none
        theirs = {e.key for e in admin.watch("/elasticd/v1/jobs/", 0, timeout=5)
                  if e.revision <= now}
        assert theirs and all("rbac-job" not in key for key in theirs)
    except StoreError as exc:
        pytest.fail(f"root cannot read etcd: {exc}")
    finally:
        admin.close()
    d.stop()
