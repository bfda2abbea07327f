"""What authenticated, encrypted cluster job specs cost.

    python bench/cluster_trust_bench.py                       # both parts, ~1-2 minutes
    python bench/cluster_trust_bench.py --part codec --reps 5000
    python bench/cluster_trust_bench.py --part adoption --jobs 10

(a) codec: per spec, on a realistic spec (8-argument command, a 60-variable,
    ~4 KB environment, 2 nodes): the incumbent (json.dumps / json.loads of the
    plain spec, what the daemon did before) against ``SpecCodec.seal`` and
    ``SpecCodec.open`` (HMAC-SHA256 + AES-256-GCM + the submit validators), and
    their parts: HMAC sign+verify alone, AES-GCM encrypt+decrypt alone. Median
    of --reps calls each, in microseconds.
(b) adoption: two real daemons on one real etcd (tests/etcd_server.py); a 1-node
    job pinned to node B is submitted on node A (``/bin/sh -c 'date +%s.%N > F'``);
    the time in F minus ``time.time()`` just before the Submit call: submit on A ->
    spec in etcd -> B's watch -> verify/decrypt/validate -> B's worker started.
    Median and p90 of --jobs, one after another. The code measured is whatever
    ``elasticd`` this interpreter imports: run it with PYTHONPATH pointing at another
    checkout's daemon/ and ctl/ for the "before" figure (the daemons inherit it).
    Jobs run as root, so the daemons get cluster.allow_root_jobs=true (where the
    setting exists); the uid check is a few comparisons either way.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
from common import BenchDaemon, machine, median, percentile, tempdir  # noqa: E402
from etcd_server import EtcdServer  # noqa: E402

from elasticd.v1 import control_pb2 as pb  # noqa: E402

HAS_KEYS = importlib.util.find_spec("elasticd.trust.clusterkey") is not None


def _spec():
    from elasticd.jobs.spec import JobSpec
    env = {f"VAR_{i:02d}": "x" * 60 for i in range(60)}
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME="/home/alice", HF_TOKEN="hf_" + "a" * 34)
    return JobSpec(id="abcd1234", name="bert-large", command=(
        "python", "train.py", "--lr", "3e-4", "--batch-size", "64", "--epochs", "10"),
        cwd="/home/alice/project", env=env, uid=1001, gid=1001, user="alice",
        min_nodes=2, max_nodes=4, nproc_per_node=8, max_restarts=3,
        nodes=("n1", "n2"), created_at=time.time(), submitted_on="n1")


def _time_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def codec_part(reps: int) -> None:
    import hmac
    from hashlib import sha256

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from elasticd.trust.clusterkey import ephemeral
    from elasticd.trust.specs import SpecCodec, _canonical
    from elasticd.config import ControlSettings

    spec = _spec()
    codec = SpecCodec(ephemeral(), ControlSettings())
    wire = spec.to_wire()
    plain = json.dumps(wire, sort_keys=True)
    sealed = json.dumps(codec.seal(spec))
    assert codec.open("abcd1234", sealed) == spec
    key = os.urandom(32)
    secret = _canonical({"command": wire["command"], "env": wire["env"]})
    aead, nonce = AESGCM(key), os.urandom(12)
    ct = aead.encrypt(nonce, secret, b"aad")
    mac_input = _canonical(list(wire.values()))
    tag = hmac.new(key, mac_input, sha256).hexdigest()

    rows = [
        ("incumbent: json.dumps(plain spec)", _time_us(lambda: json.dumps(spec, sort_keys=True),
                                                       reps)),
        ("incumbent: json.loads(plain spec)", _time_us(lambda: json.loads(plain), reps)),
        ("seal (encrypt + sign + json.dumps)", _time_us(lambda: json.dumps(codec.seal(spec)),
                                                         reps)),
        ("open (json.loads + verify + decrypt + validate)",
         _time_us(lambda: codec.open("abcd1234", sealed), reps)),
        ("  HMAC-SHA256 sign (canonical encoding incl.)",
         _time_us(lambda: hmac.new(key, _canonical(list(spec.values())), sha256).hexdigest(),
                  reps)),
        ("  HMAC-SHA256 verify (compare_digest)",
         _time_us(lambda: hmac.compare_digest(hmac.new(key, mac_input, sha256).hexdigest(), tag),
                  reps)),
        ("  AES-256-GCM encrypt (command + env)", _time_us(
            lambda: aead.encrypt(nonce, secret, b"aad"), reps)),
        ("  AES-256-GCM decrypt", _time_us(lambda: aead.decrypt(nonce, ct, b"aad"), reps)),
    ]
    print(f"(a) per spec, median of {reps} calls; spec: {len(plain)} bytes plain, "
          f"{len(sealed)} sealed")
    for what, us in rows:
        print(f"  {what:<52} {us:8.1f} us")
    inc = rows[0][1] + rows[1][1]
    ours = rows[2][1] + rows[3][1]
    print(f"  write+read: incumbent {inc:.1f} us, sealed {ours:.1f} us "
          f"(+{ours - inc:.1f} us per spec, once per submit and once per node that reads it)")


class ClusterDaemon(BenchDaemon):
    def __init__(self, url: str, prefix: str, node_id: str, key: str | None):
        extra = ["--etcd-prefix", prefix, "--set", "agent.warm_spares=false"]
        if key:
            extra += ["--set", f"cluster.key_file={key}", "--set", "cluster.allow_root_jobs=true"]
        super().__init__(node_id=node_id, slots=2, extra_args=tuple(extra))
        self.args[self.args.index("--standalone")] = "--etcd"
        self.args.insert(1, url)


def adoption_part(jobs: int) -> None:
    import subprocess
    root = tempdir("edb-trust-")
    key = None
    if HAS_KEYS:
        key = os.path.join(root, "cluster.key")
        subprocess.run([sys.executable, "-m", "elasticd", "keygen", "--out", key], check=True,
                       capture_output=True)
    out = []
    with EtcdServer() as etcd:
        prefix = f"/bench{os.getpid()}"
        a, b = (ClusterDaemon(etcd.url, prefix, n, key) for n in ("bench-a", "bench-b"))
        try:
            a.start()
            b.start()
            for i in range(jobs + 1):
                mark = os.path.join(root, f"t{i}")
                req = pb.SubmitRequest(command=["/bin/sh", "-c", f"date +%s.%N > {mark}"],
                                       cwd=root, env={"PATH": os.environ["PATH"]},
                                       nproc_per_node=1, min_nodes=1, max_nodes=1,
                                       max_restarts=0, nodes=["bench-b"])
                t0 = time.time()
                job = a.client().call("Submit", req).job.id
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    st = a.client().call("GetJob", pb.GetJobRequest(id=job)).state
                    if pb.JobState.Name(st) in ("SUCCEEDED", "FAILED", "CANCELLED"):
                        break
                    time.sleep(0.02)
                with open(mark) as fh:
                    took = float(fh.read()) - t0
                if i:  # the first one warms both daemons up
                    out.append(took)
        finally:
            a.stop()
            b.stop()
    ms = [x * 1000 for x in out]
    print(f"(b) submit on A -> worker started on B, {len(ms)} jobs ("
          f"{'signed + encrypted specs' if HAS_KEYS else 'plain specs: the code before'}): "
          f"median {median(ms):.1f} ms, p90 {percentile(ms, 90):.1f} ms, "
          f"min {min(ms):.1f} ms, max {max(ms):.1f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("codec", "adoption", "both"), default="both")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--jobs", type=int, default=10)
    args = p.parse_args()
    print(f"cluster job spec trust; {machine()}; elasticd from "
          f"{os.path.dirname(importlib.util.find_spec('elasticd').origin)}")
    if args.part in ("codec", "both"):
        if HAS_KEYS:
            codec_part(args.reps)
        else:
            print("(a) skipped: this elasticd has no clusterspec")
    if args.part in ("adoption", "both"):
        adoption_part(args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
