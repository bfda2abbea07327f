"""The cluster key file and sealed job specs, without a daemon (trust/clusterkey.py,
trust/specs.py): what a key file must be, what a changed spec turns into, whom
the uid policy lets through. The daemons and etcd: test_cluster_trust.py."""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from elasticd.trust import clusterkey
from elasticd.trust.specs import ClusterPolicy, SpecCodec
from elasticd.config import ControlSettings
from elasticd.jobs.registry import JobRecord
from elasticd.jobs.spec import JobSpec
from elasticd.trust.rejections import RejectReason, SpecRejected

LIMITS = ControlSettings()


def spec(job_id: str = "abcd1234", **over) -> JobSpec:
    rec = JobRecord(id=job_id, command=["python", "train.py", "--token", "t0p"], cwd="/w",
                    uid=1001, gid=1001, user="alice", env={"HF_TOKEN": "hf_secret", "A": "1"},
                    min_nodes=1, max_nodes=2, nproc_per_node=2, max_restarts=3,
                    created_at=1_700_000_000.25, node_id="n1")
    return dataclasses.replace(JobSpec.of_record(rec, ("n1", "n2")), **over)


@pytest.fixture
def codec():
    return SpecCodec(clusterkey.ephemeral(), LIMITS)


def reason(codec: SpecCodec, job_id: str, stored) -> RejectReason:
    with pytest.raises(SpecRejected) as err:
        codec.open(job_id, stored if isinstance(stored, str) else json.dumps(stored))
    return err.value.rejection.reason


# ---------------------------------------------------------------- sealing

def test_a_sealed_spec_opens_to_the_same_spec_and_hides_command_and_env(codec):
    sealed = json.dumps(codec.seal(spec()))
    assert codec.open("abcd1234", sealed) == spec()
    assert "hf_secret" not in sealed and "t0p" not in sealed and "HF_TOKEN" not in sealed


@pytest.mark.parametrize("field, value", [
    ("uid", 0), ("gid", 0), ("user", "root"), ("cwd", "/root"), ("nodes", ["n3"]),
    ("min_nodes", 2), ("max_nodes", 1), ("nproc_per_node", 1), ("max_restarts", 9),
    ("inprocess", True), ("created_at", 1.0), ("submitted_on", "n2"), ("name", "x"),
    ("format", "elasticd-spec/2")])
def test_any_changed_field_breaks_the_signature(codec, field, value):
    stored = dict(codec.seal(spec()), **{field: value})
    expected = RejectReason.UNSIGNED if field == "format" else RejectReason.BAD_SIGNATURE
    assert reason(codec, "abcd1234", stored) is expected


def test_a_pasted_or_flipped_ciphertext_breaks_the_signature(codec):
    good, other = codec.seal(spec()), codec.seal(spec(command=["sh", "-c", "evil"]))
    assert reason(codec, "abcd1234", dict(good, sealed=other["sealed"])) \
        is RejectReason.BAD_SIGNATURE
    raw = bytearray(base64.b64decode(good["sealed"]))
    raw[-1] ^= 1
    assert reason(codec, "abcd1234", dict(good, sealed=base64.b64encode(raw).decode())) \
        is RejectReason.BAD_SIGNATURE


def test_replay_under_another_id_and_a_changed_id_are_refused(codec):
    good = codec.seal(spec())
    rej = pytest.raises(SpecRejected, codec.open, "other123", json.dumps(good)).value.rejection
    assert rej.reason is RejectReason.ID_MISMATCH and rej.uid == 1001  # the MAC held
    assert reason(codec, "other123", dict(good, id="other123")) is RejectReason.BAD_SIGNATURE


def test_a_spec_of_another_cluster_key_is_refused(codec):
    foreign = SpecCodec(clusterkey.ephemeral(), LIMITS).seal(spec())
    assert reason(codec, "abcd1234", foreign) is RejectReason.BAD_SIGNATURE


@pytest.mark.parametrize("stored, why", [
    ("not json", RejectReason.MALFORMED), ("[1, 2]", RejectReason.MALFORMED),
    (json.dumps(spec().to_wire()), RejectReason.UNSIGNED),  # the old plain format
])
def test_garbage_and_unsigned_specs(codec, stored, why):
    assert reason(codec, "abcd1234", stored) is why


def test_extra_or_missing_fields_are_malformed_even_if_signed(codec):
    good = codec.seal(spec())
    assert reason(codec, "abcd1234", dict(good, extra=1)) is RejectReason.MALFORMED
    assert reason(codec, "abcd1234", {k: v for k, v in good.items() if k != "cwd"}) \
        is RejectReason.MALFORMED


@pytest.mark.parametrize("over", [
    {"id": ".."}, {"id": "a/b"}, {"cwd": "relative"}, {"env": {"BAD-NAME": "x"}},
    {"command": []}, {"nproc_per_node": 0}, {"min_nodes": 3, "max_nodes": 2},
    {"uid": -1}, {"max_restarts": -1}, {"nodes": ["../etc"]}, {"uid": "1001"},
    {"command": ["x" * (LIMITS.max_field_bytes + 1)]}, {"inprocess": 1},
])
def test_a_signed_spec_still_gets_a_submits_checks(codec, over):
    """What the key vouches for is still checked: a key holder's bug or a spec
    made by hand must not become a path or a bad count."""
    job_id = over.get("id", "abcd1234")
    assert reason(codec, job_id, codec.seal(spec(**over))) is RejectReason.INVALID


# ---------------------------------------------------------------- uid policy

@pytest.mark.parametrize("policy, uid, gid, refused", [
    (ClusterPolicy(), 0, 0, True), (ClusterPolicy(), 1001, 0, True),
    (ClusterPolicy(), 999, 999, True), (ClusterPolicy(), 1000, 1000, False),
    (ClusterPolicy(allow_root_jobs=True), 0, 0, False),
    (ClusterPolicy(min_uid=0), 5, 5, False),
    (ClusterPolicy(allowed_uids=frozenset({1001})), 1002, 1002, True),
    (ClusterPolicy(allowed_uids=frozenset({1001})), 1001, 1001, False),
])
def test_whose_jobs_come_from_the_cluster(policy, uid, gid, refused):
    assert bool(policy.refusal(uid, gid)) is refused


# ---------------------------------------------------------------- the key file

def test_keygen_writes_0600_whatever_the_umask_and_never_overwrites(tmp_path):
    path = str(tmp_path / "cluster.key")
    old = os.umask(0)
    try:
        clusterkey.generate(path)
    finally:
        os.umask(old)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    first = open(path).read()
    assert len(bytes.fromhex(first.strip())) == clusterkey.KEY_BYTES
    with pytest.raises(clusterkey.ClusterKeyError, match="--force"):
        clusterkey.generate(path)
    clusterkey.generate(path, force=True)
    assert open(path).read() != first and oct(os.stat(path).st_mode & 0o777) == "0o600"
    clusterkey.load(path)  # the replaced key loads


def test_keygen_does_not_follow_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    link = tmp_path / "cluster.key"
    os.symlink(victim, link)
    r = subprocess.run([sys.executable, "-m", "elasticd", "keygen", "--out", str(link)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "already exists" in r.stderr, r.stderr
    assert victim.read_text() == "keep me\n"


def test_the_same_key_file_gives_the_same_keys_and_specs_open_across_nodes(tmp_path):
    path = str(tmp_path / "k")
    clusterkey.generate(path)
    a, b = (SpecCodec(clusterkey.load(path), LIMITS) for _ in range(2))
    assert b.open("abcd1234", json.dumps(a.seal(spec()))) == spec()


@pytest.mark.parametrize("mode, why", [(0o640, "chmod 0600"), (0o604, "chmod 0600")])
def test_a_readable_key_is_refused(tmp_path, mode, why):
    path = str(tmp_path / "k")
    clusterkey.generate(path)
    os.chmod(path, mode)
    with pytest.raises(clusterkey.ClusterKeyError, match=why):
        clusterkey.load(path)


def test_a_missing_linked_foreign_or_bad_key_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(clusterkey.ClusterKeyError, match="elasticd keygen"):
        clusterkey.load(str(tmp_path / "none"))
    real = str(tmp_path / "real")
    clusterkey.generate(real)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(clusterkey.ClusterKeyError, match="symlink"):
        clusterkey.load(str(tmp_path / "link"))
    short = tmp_path / "short"
    fd = os.open(short, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"abcd\n")
    os.close(fd)
    with pytest.raises(clusterkey.ClusterKeyError, match="at least 32"):
        clusterkey.load(str(short))
    if os.geteuid() == 0:
        os.chown(real, 65534, 65534)
        with pytest.raises(clusterkey.ClusterKeyError, match="owned by uid 65534"):
            clusterkey.load(real)


def test_derived_keys_never_show_in_a_repr():
    assert "secret" in repr(clusterkey.ephemeral())
