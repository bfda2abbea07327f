"""GPUs as schedulable resources: inventory, binding, health before a round.

The machine running the tests has no GPU, so the daemons read the test-only
fake inventory (``daemon.fake_gpus_file``): a JSON file of devices and a
health verdict the test flips. Everything else is real: real daemons (one
standalone, two on a real etcd), real worker processes that record the
CUDA_VISIBLE_DEVICES and CPU affinity they were started with, the real
``elasticctl``. The parsers of what NVML / nvidia-smi / sysfs answer are
tested on recorded outputs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid as uuidlib

import pytest

from daemons import DaemonProc, short_tmpdir
from elasticd.control import validation
from elasticd.config import ControlSettings
from elasticd.cluster.dispatch import eligible
from elasticd.errors import InvalidArgument
from elasticd.gpus.alloc import Binding, GpuLedger, binding_for, needed, pick
from elasticd.jobs.spec import JobSpec
from elasticd.gpus.health import parse_smi_health, should_drain
from elasticd.gpus.inventory import (
    Gpu, Inventory, InventoryError, cpu_list_text, numa_of, parse_nvidia_smi, parse_setting,
    read_fake, sysfs_bus_id)
from elasticd.rendezvous.protocol import OPEN, RoundState
from elasticd.v1 import control_pb2 as pb
from etcd_server import EtcdServer, etcd_binary

PY = sys.executable

# What `nvidia-smi --query-gpu=index,uuid,memory.total,pci.bus_id
# --format=csv,noheader,nounits` prints on an 8-GPU H100 node (UUIDs shortened).
SMI_H100 = """\
0, GPU-1a2b3c4d-0000-1111-2222-333344445555, 81559, 00000000:18:00.0
1, GPU-1a2b3c4d-0000-1111-2222-333344445556, 81559, 00000000:2A:00.0
2, GPU-1a2b3c4d-0000-1111-2222-333344445557, 81559, 00000000:3A:00.0
3, GPU-1a2b3c4d-0000-1111-2222-333344445558, 81559, 00000000:5D:00.0
4, GPU-1a2b3c4d-0000-1111-2222-333344445559, 81559, 00000000:9A:00.0
5, GPU-1a2b3c4d-0000-1111-2222-33334444555a, 81559, 00000000:AB:00.0
6, GPU-1a2b3c4d-0000-1111-2222-33334444555b, 81559, 00000000:BA:00.0
7, GPU-1a2b3c4d-0000-1111-2222-33334444555c, 81559, 00000000:DB:00.0
"""


# ---------------------------------------------------------------- parsing (no daemon)

def test_nvidia_smi_output_parses_with_numa_from_sysfs(tmp_path):
    for bus, node, cpus in (("0000:18:00.0", "0", "0-47,96-143"),
                            ("0000:9a:00.0", "1", "48-95,144-191")):
        d = tmp_path / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
        (d / "local_cpulist").write_text(cpus + "\n")
    gpus = parse_nvidia_smi(SMI_H100, sysfs=str(tmp_path))
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[0].uuid == "GPU-1a2b3c4d-0000-1111-2222-333344445555"
    assert gpus[0].memory_mib == 81559 and gpus[0].bus_id == "0000:18:00.0"
    assert gpus[0].numa_node == 0 and gpus[0].cpus[:2] == (0, 1) and len(gpus[0].cpus) == 96
    assert gpus[4].numa_node == 1 and cpu_list_text(gpus[4].cpus) == "48-95,144-191"
    assert gpus[1].numa_node == -1 and gpus[1].cpus == ()   # sysfs says nothing: unknown


@pytest.mark.parametrize("text", [
    "0, GPU-abc, [N/A], 00000000:18:00.0\n",                 # memory not a number
    "0, GPU-abc, 81559\n",                                   # a field missing
    "0, GPU-abc, 81559, 00000000:18:00.0, extra\n",          # a field too many
    "0, not-a-uuid, 81559, 00000000:18:00.0\n",
    "0, GPU-abc, 81559, 18:00\n",                            # not a bus id
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
    "0, GPU-a, 1, 0000:18:00.0\n0, GPU-b, 1, 0000:19:00.0\n",  # an index twice
])
def test_nvidia_smi_output_that_does_not_parse_fails_whole(text):
    with pytest.raises(InventoryError):
        parse_nvidia_smi(text)


def test_bus_ids_and_settings():
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_bus_id("0001:af:1f.7") == "0001:af:1f.7"
    assert parse_setting("auto") == "auto" and parse_setting(" NONE ") == "none"
    assert parse_setting("0,1,3") == (0, 1, 3)
    for bad in ("", "0,0", "x", "-1", "1,,2", "64", "0;rm -rf /"):
        with pytest.raises(InventoryError):
            parse_setting(bad)


def test_numa_of_missing_device_is_unknown(tmp_path):
    assert numa_of("0000:00:00.0", str(tmp_path)) == (-1, ())


def test_health_query_output():
    out = "0, No, 80000\n1, Yes, 80000\n2, [N/A], 100\n"
    assert parse_smi_health(out, [0]) == []
    assert parse_smi_health(out, [0, 2]) == []
    assert "GPU 1: pages pending retirement" in parse_smi_health(out, [1])[0]
    assert "does not list it" in parse_smi_health(out, [5])[0]
    assert "does not parse" in parse_smi_health("garbage here\n", [0])[0]
    assert not should_drain(2, 3) and should_drain(3, 3) and not should_drain(99, 0)


def write_fake(path, count=4, healthy=True, problem="", cpus=None):
    """A fake inventory: ``count`` GPUs, two per NUMA node, CPUs from ``cpus``."""
    gpus = [{"index": i, "uuid": f"GPU-fake-{i}-{uuidlib.uuid4().hex[:8]}",
             "memory_mib": 81920, "numa_node": i // 2,
             "cpus": (cpus or {}).get(i // 2, "")} for i in range(count)]
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"gpus": gpus, "healthy": healthy, "problem": problem}, fh)
    os.replace(tmp, str(path))
    return gpus


def set_health(path, healthy, problem=""):
    with open(path) as fh:
        doc = json.load(fh)
    doc.update(healthy=healthy, problem=problem)
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, str(path))


def test_fake_file_is_checked_like_any_input(tmp_path):
    good = tmp_path / "gpus.json"
    write_fake(good, 2)
    assert len(read_fake(str(good)).gpus) == 2
    link = tmp_path / "link.json"
    link.symlink_to(good)
    with pytest.raises(InventoryError, match="fake GPU file"):
        read_fake(str(link))                                  # no link followed
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InventoryError, match="not a regular file"):
        read_fake(str(fifo))                                  # never blocks on a FIFO
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"gpus": [], "pad": "x" * 100_000}))
    with pytest.raises(InventoryError, match="larger than"):
        read_fake(str(big))
    for doc in ({"gpus": [{"index": 0, "uuid": "GPU-a,GPU-b"}]},       # a comma in a UUID
                {"gpus": [{"index": -1, "uuid": "GPU-a"}]},
                {"gpus": [{"index": 0, "uuid": "GPU-a", "cpus": "3-1"}]},
                {"gpus": [{"index": 0, "uuid": "GPU-a", "memory_mib": True}]},
                {"gpus": "all"}, {"gpus": [], "healthy": "yes"}):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(InventoryError):
            read_fake(str(bad))


# ---------------------------------------------------------------- allocation (pure)

def inventory(n=4, per_node=2) -> Inventory:
    return Inventory(tuple(Gpu(i, f"GPU-t{i}", 1000, i // per_node, (i // per_node,))
                           for i in range(n)), "fake")


def test_needed_defaults_to_one_per_rank_on_gpu_nodes():
    assert needed(-1, 4, 8) == 4 and needed(-1, 4, 0) == 0
    assert needed(2, 4, 8) == 2 and needed(0, 4, 8) == 0


def test_pick_prefers_old_devices_then_one_numa_node():
    inv = inventory(8, per_node=4)
    assert pick(inv, [0, 1, 2, 3, 4, 5, 6, 7], 2) == (0, 1)
    assert pick(inv, [1, 2, 3, 4, 5, 6, 7], 4) == (4, 5, 6, 7)   # node 1 is whole
    assert pick(inv, [2, 3, 4, 5, 6, 7], 2) == (2, 3)            # the fuller node first
    assert pick(inv, [3, 4, 5, 6, 7], 2, prefer=(6, 7)) == (6, 7)
    assert pick(inv, [3, 5, 7], 3) == (3, 5, 7)                   # across nodes if it must
    ledger = GpuLedger(inv)
    a = ledger.take("a", 4)
    assert [g.index for g in a] == [0, 1, 2, 3]
    assert ledger.take("b", 5) is None
    assert ledger.take("a", 4) == a                               # the same set again
    ledger.release("a")
    assert ledger.free() == list(range(8))


def test_binding_env_names_devices_by_uuid():
    inv = inventory(4)
    b = binding_for(inv.gpus[2:4], "numa", True, allowed={0, 1})
    assert b.env()["CUDA_VISIBLE_DEVICES"] == "GPU-t2,GPU-t3"
    assert b.env()["ELASTICD_GPUS"] == "2,3" and b.cpus == (1,)
    assert Binding((), (), True).env()["CUDA_VISIBLE_DEVICES"] == ""   # none, not all
    assert Binding().env() == {}                                        # no GPUs on the node


def test_dispatcher_counts_gpus():
    state = RoundState(round=1, status=OPEN)
    spec = JobSpec(id="j1", command=("true",), cwd="/", uid=0, gid=0, nproc_per_node=2,
                   max_nodes=2, gpus_per_node=-1)
    assert eligible(spec, state, 0, "n1", 4, False, 0, 2, 4) == (True, "")
    ok, why = eligible(spec, state, 0, "n1", 4, False, 0, 1, 4)
    assert not ok and "needs 2 GPUs, 1 free of 4" in why
    assert eligible(spec, state, 0, "n1", 4, False, 0, 0, 0) == (True, "")  # a CPU node


def test_submit_and_cluster_spec_validate_gpu_fields():
    limits = ControlSettings()
    req = pb.SubmitRequest(command=["true"], cwd="/", gpus_per_node=3, cpu_bind="numa")
    got = validation.submit_request(req, limits)
    assert (got.gpus_per_node, got.cpu_bind) == (3, "numa")
    got = validation.submit_request(pb.SubmitRequest(command=["true"], cwd="/"), limits)
    assert (got.gpus_per_node, got.cpu_bind) == (-1, "none")
    for bad in (pb.SubmitRequest(command=["true"], cwd="/", gpus_per_node=-2),
                pb.SubmitRequest(command=["true"], cwd="/", gpus_per_node=65),
                pb.SubmitRequest(command=["true"], cwd="/", cpu_bind="socket")):
        with pytest.raises(InvalidArgument):
            validation.submit_request(bad, limits)


# ---------------------------------------------------------------- one real node

PROBE = r'''
import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
rec = {"job": os.environ["ELASTICD_JOB_ID"], "rank": rank, "restart": restart,
       "local_rank": os.environ["LOCAL_RANK"],
       "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpus": os.environ.get("ELASTICD_GPUS"),
       "cpus": sorted(os.sched_getaffinity(0))}
name = "%s-r%s-x%s.json" % (rec["job"], rank, restart)
with open(os.path.join(out, "." + name), "w") as fh:
    json.dump(rec, fh)
os.replace(os.path.join(out, "." + name), os.path.join(out, name))
if mode == "hold":
    time.sleep(600)
elif mode == "fail-once" and restart == "0":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(float(os.environ.get("PROBE_SLEEP", "0.2")))
'''


def records(out: str, job: str, restart: int | None = None) -> list[dict]:
    got = []
    for name in sorted(os.listdir(out)):
        if name.startswith(job + "-"):
            with open(os.path.join(out, name)) as fh:
                rec = json.load(fh)
            if restart is None or rec["restart"] == str(restart):
                got.append(rec)
    return got


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not met after {timeout}s")


@pytest.fixture(scope="module")
def gpu_node():
    """A standalone daemon on a fake 4-GPU node (two NUMA nodes of two GPUs each)."""
    root = short_tmpdir("gpu-")
    fake = os.path.join(root, "gpus.json")
    cpus = sorted(os.sched_getaffinity(0))
    write_fake(fake, 4, cpus={0: str(cpus[0]), 1: str(cpus[-1])})
    out = os.path.join(root, "out")
    os.makedirs(out)
    probe = os.path.join(root, "probe.py")
    with open(probe, "w") as fh:
        fh.write(PROBE)
    d = DaemonProc(root, node_id="gpu-a", slots=8, extra_args=(
        "--set", f"daemon.fake_gpus_file={fake}", "--set", "agent.warm_spares=false",
        "--set", "agent.restart_backoff_initial=0.1", "--set", "daemon.suspect_jobs=2"))
    d.start()
    d.fake, d.out, d.probe = fake, out, probe
    yield d
    d.cleanup()


def ctl_json(d: DaemonProc, *args: str) -> dict:
    res = d.ctl("-o", "json", *args)
    assert res.returncode == 0, res.stderr + res.stdout
    return json.loads(res.stdout)


def submit(d: DaemonProc, *args: str) -> str:
    res = d.ctl("submit", *args)
    assert res.returncode == 0, res.stderr + res.stdout
    return res.stdout.strip()


def test_two_jobs_get_disjoint_gpus_and_a_third_waits(gpu_node):
    d = gpu_node
    a = submit(d, "--nproc-per-node", "2", "--", PY, d.probe, d.out, "hold")
    b = submit(d, "--nproc-per-node", "2", "--", PY, d.probe, d.out, "hold")
    ra = wait_for(lambda: len(records(d.out, a)) == 2 and records(d.out, a), what="job a's ranks")
    rb = wait_for(lambda: len(records(d.out, b)) == 2 and records(d.out, b), what="job b's ranks")
    # Every rank of a job sees the job's whole set; LOCAL_RANK indexes into it.
    assert ra[0]["cuda"] == ra[1]["cuda"] and len(ra[0]["cuda"].split(",")) == 2
    assert rb[0]["cuda"] == rb[1]["cuda"]
    assert not set(ra[0]["cuda"].split(",")) & set(rb[0]["cuda"].split(","))
    assert all(u.startswith("GPU-fake-") for u in ra[0]["cuda"].split(","))
    assert sorted(ra[0]["gpus"].split(",") + rb[0]["gpus"].split(",")) == ["0", "1", "2", "3"]

    c = submit(d, "--nproc-per-node", "2", "--", PY, d.probe, d.out, "quick")
    job = d.wait_state(c, "PENDING", pred=lambda j: "GPU" in j.reason)
    assert "waiting for 2 free GPUs: 0 of 4 free" in job.reason, job.reason
    time.sleep(1.0)
    assert d.job(c).state == pb.PENDING and not records(d.out, c)

    nodes = ctl_json(d, "nodes")["nodes"]
    me = next(n for n in nodes if n["node_id"] == "gpu-a")
    assert (me["gpus"], me["gpus_free"], me["gpu_source"]) == (4, 0, "fake")
    assert sorted(g["job_id"] for g in me["devices"]) == sorted([a, a, b, b])
    text = d.ctl("nodes").stdout
    assert "0/4" in text and "GPUs of gpu-a (fake" in text

    status = ctl_json(d, "status", a)
    assert all(w["gpus"] == [int(i) for i in ra[0]["gpus"].split(",")] for w in status["workers"])
    assert all(w["gpu_uuids"] == ra[0]["cuda"].split(",") for w in status["workers"])
    assert "GPUS" in d.ctl("status", a).stdout

    assert d.ctl("cancel", a).returncode == 0
    done = d.wait_job(c, timeout=90)
    assert done.state == pb.SUCCEEDED
    rc = records(d.out, c)
    assert rc[0]["gpus"] == ra[0]["gpus"]      # the devices a gave back
    assert d.ctl("cancel", b).returncode == 0
    d.wait_job(b)


def test_a_restarted_job_keeps_its_devices_and_numa_cpus(gpu_node):
    d = gpu_node
    blocker = submit(d, "--nproc-per-node", "1", "--gpus-per-node", "2", "--",
                     PY, d.probe, d.out, "hold")   # takes one whole NUMA node
    wait_for(lambda: records(d.out, blocker), what="the blocker")
    job = submit(d, "--nproc-per-node", "2", "--cpu-bind", "numa", "--max-restarts", "2",
                 "--", PY, d.probe, d.out, "fail-once")
    done = d.wait_job(job, timeout=120)
    assert done.state == pb.SUCCEEDED and done.restarts == 1
    first, second = records(d.out, job, 0), records(d.out, job, 1)
    assert len(first) == 2 and len(second) == 2
    assert {r["cuda"] for r in first} == {r["cuda"] for r in second}
    assert len({r["cuda"] for r in first}) == 1
    gpus = [int(i) for i in first[0]["gpus"].split(",")]
    held = [int(i) for i in records(d.out, blocker)[0]["gpus"].split(",")]
    assert not set(gpus) & set(held) and gpus[0] // 2 == gpus[1] // 2   # one NUMA node
    with open(d.fake) as fh:
        node_cpus = {g["index"]: g["cpus"] for g in json.load(fh)["gpus"]}
    want = sorted({int(node_cpus[gpus[0]])})
    assert all(r["cpus"] == want for r in first + second), (first, second, want)
    blocker_cpus = records(d.out, blocker)[0]["cpus"]
    assert len(blocker_cpus) == len(os.sched_getaffinity(0))   # --cpu-bind none: not bound
    assert d.ctl("cancel", blocker).returncode == 0
    d.wait_job(blocker)


def test_a_job_asking_more_gpus_than_the_node_has_is_refused(gpu_node):
    res = gpu_node.ctl("submit", "--gpus-per-node", "5", "--", PY, "-c", "pass")
    assert res.returncode == 1 and "needs 5 GPUs per node but this node has 4" in res.stderr


# ---------------------------------------------------------------- two nodes, real etcd

@pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary")
def test_a_node_failing_its_gpu_health_check_stays_out_and_drains():
    with EtcdServer() as etcd:
        prefix = f"/gpu-{uuidlib.uuid4().hex[:8]}"
        nodes = []
        try:
            for name, healthy in (("g1", True), ("g2", False)):
                root = short_tmpdir("gpu-")
                fake = os.path.join(root, "gpus.json")
                write_fake(fake, 2, healthy=healthy,
                           problem="" if healthy else "GPU 0: XID 79 (fell off the bus)")
                d = DaemonProc(root, node_id=name, slots=4, etcd=etcd.url, extra_args=(
                    "--etcd-prefix", prefix, "--set", f"daemon.fake_gpus_file={fake}",
                    "--set", "agent.warm_spares=false",
                    "--set", "daemon.gpu_health_retry_interval=0.5",
                    "--set", "daemon.gpu_health_failures_to_drain=3",
                    "--set", "rendezvous.last_call=3"))
                d.fake = fake
                nodes.append(d.start())
            g1, g2 = nodes
            out = os.path.join(g1.root, "out")
            os.makedirs(out)
            os.chmod(out, 0o777)
            probe = os.path.join(g1.root, "probe.py")
            with open(probe, "w") as fh:
                fh.write(PROBE)
            job = submit(g1, "--nnodes", "1:2", "--nproc-per-node", "1", "--",
                         PY, probe, out, "hold")
            running = g1.wait_state(job, "RUNNING", timeout=60)
            assert {w.node_id for w in running.workers} == {"g1"}
            assert "on 1 node(s)" in running.reason
            # g2 adopted it, checked its GPUs, stayed out, and drained after 3 failures.
            wait_for(lambda: any(e.kind == "gpu_health" and "drained itself" in e.reason
                                 for e in g2.events(job)), 60, "g2 to drain itself")
            reasons = [e.reason for e in g2.events(job) if e.kind == "gpu_health"]
            assert "XID 79" in reasons[0] and "not joining" in reasons[0]
            listing = ctl_json(g2, "nodes")["nodes"]
            me = next(n for n in listing if n["node_id"] == "g2")
            assert me["state"] == "draining"
            assert any("GPU health check failing" in p and "XID 79" in p for p in me["problems"])
            assert me["gpu_health"].startswith("failing")
            seen_by_g1 = next(n for n in ctl_json(g1, "nodes")["nodes"] if n["node_id"] == "g2")
            assert seen_by_g1["state"] == "draining" and seen_by_g1["gpus"] == 2
            assert "GPU health check failing" in g2.job(job).reason
            assert {w.node_id for w in g1.job(job).workers} == {"g1"}
            # Healthy again and uncordoned: it joins the job (a new round with both).
            set_health(g2.fake, True)
            assert g2.ctl("uncordon", "g2").returncode == 0
            both = g1.wait_state(job, "RUNNING", timeout=60,
                                 pred=lambda j: {w.node_id for w in j.workers
                                                 if w.state == "running"} == {"g1", "g2"})
            assert both.round >= 2
            assert g1.ctl("cancel", job).returncode == 0
            g1.wait_job(job)
        finally:
            for d in nodes:
                d.cleanup()


# ---------------------------------------------------------------- the health gate (no daemon)

def test_compute_apps_output():
    from elasticd.gpus.health import parse_smi_apps
    out = "GPU-aaaa-1, 1234\nGPU-aaaa-1, 1240\nGPU-bbbb-2, 77\n"
    assert parse_smi_apps(out) == {"GPU-aaaa-1": [1234, 1240], "GPU-bbbb-2": [77]}
    assert parse_smi_apps("") == {}
    for bad in ("GPU-a, [N/A]\n", "1234\n", "No running processes found\n"):
        with pytest.raises(InventoryError):
            parse_smi_apps(bad)


class Events:
    def __init__(self):
        self.seen = []

    def event(self, job_id, kind, reason, **kw):
        self.seen.append((job_id, kind, reason))


def gate_for(tmp_path, threshold=2, release=0.0, command=""):
    from elasticd import config
    from elasticd.gpus.health import HealthGate
    fake = tmp_path / "gpus.json"
    write_fake(fake, 2)
    cfg = config.load(path="/dev/null", env={}, overrides={
        "daemon.standalone": True, "daemon.state_dir": str(tmp_path),
        "daemon.socket": str(tmp_path / "s.sock"), "daemon.fake_gpus_file": str(fake),
        "daemon.gpu_health_failures_to_drain": threshold,
        "daemon.gpu_release_timeout": release, "daemon.gpu_health_command": command})
    inv = Inventory(read_fake(str(fake)).gpus, "fake")
    drained, events = [], Events()
    return HealthGate(cfg, inv, events, drained.append), inv, fake, drained, events


def test_gate_drains_after_failures_in_a_row_and_a_pass_resets(tmp_path):
    gate, inv, fake, drained, events = gate_for(tmp_path, threshold=2)
    assert gate.before_round("j1", inv.gpus).ok and gate.status() == "ok"
    set_health(fake, False, "GPU 1: XID 48")
    r = gate.before_round("j1", inv.gpus)
    assert not r.ok and r.reason == "GPU 1: XID 48" and not drained
    assert "1 in a row; drains after 2" in gate.problem()
    gate.before_round("j2", inv.gpus)                  # a second job: still one node's count
    assert len(drained) == 1 and "2 times in a row" in drained[0]
    assert any("drained itself" in reason for _, _, reason in events.seen)
    gate.before_round("j2", inv.gpus)
    assert len(drained) == 1                           # drained once, not at every failure
    set_health(fake, True)
    assert gate.before_round("j1", inv.gpus).ok and gate.failures == 0 and not gate.problem()


def test_gate_waits_for_a_dead_ranks_processes_to_leave_its_gpus(tmp_path):
    from elasticd.gpus.health import wait_released
    gate, inv, fake, drained, events = gate_for(tmp_path)
    with open(fake) as fh:
        doc = json.load(fh)
    doc["processes"] = {"1": [4242]}
    fake.write_text(json.dumps(doc))
    r = gate.before_round("j1", inv.gpus)
    assert not r.ok and "GPU 1: still used by pid 4242" in r.reason
    assert gate.before_round("j1", inv.gpus[:1]).ok      # GPU 0 is free
    now = [0.0]

    def sleep(s):   # the process leaves while we wait
        now[0] += s
        doc["processes"] = {}
        fake.write_text(json.dumps(doc))
    doc["processes"] = {"1": [4242]}
    fake.write_text(json.dumps(doc))
    assert wait_released(inv, inv.gpus, str(fake), 5.0, clock=lambda: now[0], sleep=sleep) == []


def test_gate_runs_the_health_command_with_a_timeout(tmp_path):
    script = tmp_path / "check.sh"
    script.write_text("#!/bin/sh\necho \"bad $ELASTICD_GPUS\"\nexit 4\n")
    script.chmod(0o755)
    gate, inv, *_ = gate_for(tmp_path, command=str(script))
    r = gate.before_round("j1", inv.gpus)
    assert r.reason == "health command exited 4: bad 0,1"
    slow = tmp_path / "slow.sh"
    slow.write_text("#!/bin/sh\nsleep 30 &\nsleep 30\n")
    slow.chmod(0o755)
    from elasticd.gpus.health import run_hook
    t0 = time.monotonic()
    assert "did not answer within 0.5s" in run_hook(str(slow), inv.gpus, "n", "j", 0.5)[0]
    assert time.monotonic() - t0 < 20


# ---------------------------------------------------------------- a suspect node

def test_judge_counts_different_jobs_within_the_window():
    from elasticd.cluster.suspicion import SuspectTracker, judge
    from elasticd.jobs.jobevent import JobEvent
    fails = [(100.0, "a"), (101.0, "a"), (102.0, "a")]
    assert not judge(fails, 110.0, 60.0, 2).suspect                 # one job, many times
    fails.append((105.0, "b"))
    v = judge(fails, 110.0, 60.0, 2)
    assert v.suspect and v.jobs == ("a", "b") and "2 different jobs" in v.reason
    assert not judge(fails, 200.0, 60.0, 2).suspect                 # aged out
    assert not judge(fails, 110.0, 60.0, 0).suspect                 # turned off
    now = [1000.0]
    t = SuspectTracker("n1", 60.0, 2, clock=lambda: now[0])
    t.on_event(JobEvent(kind="worker_exit", node_id="n1", job_id="a", time=999.0))
    t.on_event(JobEvent(kind="worker_exit", node_id="n2", job_id="b", time=999.0))  # a peer's
    t.on_event(JobEvent(kind="state", node_id="n1", job_id="c", time=999.0))
    assert not t.verdict().suspect
    t.on_event(JobEvent(kind="worker_exit", node_id="n1", job_id="d", time=999.5))
    assert t.verdict().suspect


def test_a_restarted_daemon_still_remembers_why_its_node_is_suspect(tmp_path):
    """The failures are read back from the registry's stored events (a real SQLite
    file, closed and opened again as a restarted daemon does)."""
    from elasticd.cluster.suspicion import SuspectTracker
    from elasticd.jobs.registry import JobRecord, JobRegistry
    now = [1000.0]
    reg = JobRegistry(str(tmp_path / "state"), "n1", clock=lambda: now[0])
    for job in ("a", "b", "c"):
        reg.create(JobRecord(id=job, command=["python", "x.py"], cwd="/", uid=0, gid=0))
    reg.event("a", "worker_exit", "rank 0 exited 13")
    now[0] = 1040.0
    reg.event("b", "worker_exit", "rank 1 exited 13")
    reg.event("c", "state", "not a failure")
    reg.close()
    again = JobRegistry(str(tmp_path / "state"), "n1", clock=lambda: now[0])
    t = SuspectTracker("n1", 60.0, 2, clock=lambda: now[0])
    t.remember(again.recent_events("worker_exit", "n1", now[0] - 60.0))
    assert t.verdict().suspect and t.verdict().jobs == ("a", "b")
    assert [e.job_id for e in again.recent_events("worker_exit", "n1", 1030.0)] == ["b"]
    assert again.recent_events("worker_exit", "n2", 0.0) == []
    again.close()


def test_a_suspect_node_lets_others_take_a_round_first():
    state = RoundState(round=1, status=OPEN, opened_at=100.0)
    spec = JobSpec(id="j1", command=("true",), cwd="/", uid=0, gid=0, nproc_per_node=1,
                   max_nodes=2)
    ok, why = eligible(spec, state, 0, "n1", 4, False, 0, hold_back=10.0, now=105.0)
    assert not ok and "suspect" in why
    assert eligible(spec, state, 0, "n1", 4, False, 0, hold_back=10.0, now=111.0) == (True, "")


def test_workers_failing_in_different_jobs_make_the_node_suspect(gpu_node):
    d = gpu_node
    for _ in range(2):
        job = submit(d, "--max-restarts", "0", "--gpus-per-node", "0", "--",
                     PY, "-c", "import sys; sys.exit(5)")
        assert d.wait_job(job).state == pb.FAILED
    me = next(n for n in ctl_json(d, "nodes")["nodes"] if n["node_id"] == "gpu-a")
    assert any(p.startswith("suspect, preferred last") for p in me["problems"]), me["problems"]
    assert "suspect" in d.ctl("nodes").stdout


def test_metrics_export_gpus_free_and_total():
    from prometheus_client import generate_latest
    from elasticd.metrics import Metrics

    class Mgr:   # the two things the collector reads, from a real ledger
        def __init__(self):
            self.gpus = GpuLedger(inventory(4))
            self.gpus.take("j1", 3)

        def gpus_free(self):
            return len(self.gpus.free())

    m = Metrics("n1")
    mgr = Mgr()
    m.attach_gpus(mgr)
    m.gpu_health(False)
    text = generate_latest(m.registry).decode()
    assert "elasticd_gpus 4.0" in text and "elasticd_gpus_free 1.0" in text
    assert 'elasticd_gpu_health_checks_total{result="failed"} 1.0' in text


@pytest.mark.slow  # a daemon stopped and started again under a running job: most of a minute
def test_a_restarted_daemon_gives_a_job_back_its_devices(tmp_path):
    root = short_tmpdir("gpu-")
    fake = os.path.join(root, "gpus.json")
    write_fake(fake, 4)
    out = os.path.join(root, "out")
    os.makedirs(out)
    probe = os.path.join(root, "probe.py")
    with open(probe, "w") as fh:
        fh.write(PROBE)
    d = DaemonProc(root, node_id="gpu-r", slots=8, extra_args=(
        "--set", f"daemon.fake_gpus_file={fake}", "--set", "agent.warm_spares=false"))
    try:
        d.start()
        blocker = submit(d, "--gpus-per-node", "2", "--", PY, probe, out, "hold")
        wait_for(lambda: records(out, blocker), what="the blocker")
        job = submit(d, "--gpus-per-node", "2", "--", PY, probe, out, "hold")
        first = wait_for(lambda: records(out, job), what="the job")[0]
        assert first["gpus"] == "2,3"
        assert d.ctl("cancel", blocker).returncode == 0      # 0,1 free: the lowest again
        d.wait_job(blocker)
        d.stop()
        d.start()
        again = wait_for(lambda: records(out, job, 1), 90, "the job resumed")[0]
        assert again["gpus"] == "2,3" and again["cuda"] == first["cuda"]
        assert d.ctl("cancel", job).returncode == 0
        d.wait_job(job)
    finally:
        d.cleanup()
