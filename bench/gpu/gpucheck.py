"""What every step of the GPU check shares: its results, its daemons, jobs, torchrun, NVML.

A step writes its rows (check, PASS/FAIL/SKIP, numbers, note) to
``WORK/results/STEP.json`` as it goes, so a step killed at its timeout
still leaves the rows it finished. ``--cpu`` (``Ctx.cpu``) runs the same
jobs with gloo on CPU tensors on a daemon that reads a fake one-GPU
inventory (``daemon.fake_gpus_file``), so the whole daemon path
(inventory, binding, health gate) runs; what needs CUDA is a SKIP row
that says so. The check runner imports no torch and never touches CUDA:
a CUDA context of its own would keep the GPU "in use" and hold up the
daemon's health gate.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: common.py
from common import REPO, BenchDaemon, fault_marks, own, read_text, stop_torchrun  # noqa: E402

from elasticd.v1 import control_pb2 as pb  # noqa: E402

TRAIN = os.path.join(HERE, "train_gpu.py")
FAKE_UUID = "GPU-fake-gpucheck-0"


@dataclasses.dataclass
class Ctx:
    """How this run goes: CPU dry run or GPU, where its files are, its interpreter."""
    cpu: bool
    work: str                 # this step's folder (under the run's work root)
    nvml: object = None       # pynvml, initialised (GPU runs only)

    @property
    def py(self) -> str:
        return sys.executable

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    def backend(self, wanted: str) -> str:
        """nccl needs CUDA: the CPU dry run uses gloo where a GPU run uses nccl."""
        return "gloo" if self.cpu else wanted

    def job_env(self, **extra) -> dict:
        """A job's environment: the caller's, with only daemon/ on PYTHONPATH (the
        workers use the machine's own torch and none of the wheels the daemon needs)."""
        env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "daemon"),
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def train_cmd(self, *args: str, backend: str = "gloo") -> list[str]:
        return [self.py, TRAIN, "--backend", self.backend(backend), "--device", self.device,
                *args]


def scaled(seconds: float) -> float:
    """A timeout inside a step, stretched on a loaded CPU machine (--cpu)."""
    return seconds * float(os.environ.get("GPUCHECK_TIMEOUT_SCALE", "1"))


# -- daemons and jobs ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_gpus_file(root: str) -> str:
    path = os.path.join(root, "fake_gpus.json")
    with open(path, "w") as fh:
        json.dump({"gpus": [{"index": 0, "uuid": FAKE_UUID, "memory_mib": 1024,
                             "numa_node": 0, "cpus": ""}], "healthy": True}, fh)
    return path


def daemon(ctx: Ctx, name: str, *sets: str, metrics_port: int = 0) -> BenchDaemon:
    """A standalone daemon of this run, its files under the step's folder; started."""
    root = os.path.join(ctx.work, name)
    os.makedirs(root, exist_ok=True)
    args = [x for s in sets for x in ("--set", s)]
    if ctx.cpu:
        args += ["--set", f"daemon.fake_gpus_file={fake_gpus_file(root)}"]
    if metrics_port:
        args += ["--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1"]
    d = BenchDaemon(root=root, slots=4, node_id=f"gpucheck-{name}", extra_args=tuple(args))
    d.start(timeout=scaled(30))
    return d


def submit(d: BenchDaemon, ctx: Ctx, cmd: list, nproc: int, max_restarts: int = 1,
           inprocess: bool = False, env: dict | None = None) -> str:
    """Submit on the node's one GPU: every rank shares it (--gpus-per-node 1)."""
    req = pb.SubmitRequest(command=list(cmd), cwd=ctx.work, env=env or ctx.job_env(),
                           nproc_per_node=nproc, max_restarts=max_restarts,
                           inprocess=inprocess, gpus_per_node=1)
    return d.client().call("Submit", req).job.id


def finish(d: BenchDaemon, job_id: str, timeout: float) -> tuple:
    """(job, every rank's log joined, events) once the job ended or ``timeout`` passed
    (then it is cancelled and the job's reason says so)."""
    try:
        job = d.wait_job(job_id, timeout=scaled(timeout))
    except TimeoutError:
        d.cancel(job_id)
        job = d.wait_job(job_id, timeout=30)
        job.reason = f"did not end within {scaled(timeout):g}s (cancelled by the check); " \
                     + job.reason
    logs = "\n".join(d.rank_log(job_id, r) for r in range(job.nproc_per_node or 1))
    return job, logs, d.events(job_id)


def state(job) -> str:
    return pb.JobState.Name(job.state)


def outcome(job, logs: str) -> str:
    """One line of why a job did not do what it should: its state, reason, last error."""
    oom = re.search(r"^FILL_OOM .*$", logs, re.M)
    errs = [ln for ln in logs.splitlines() if re.search(r"\w+Error: ", ln)][-1:]
    return "; ".join(x for x in (f"{state(job)}: {job.reason}"[:200],
                                 oom.group(0)[:200] if oom else "",
                                 errs[0].strip()[:200] if errs else "") if x)


# -- torchrun ------------------------------------------------------------------------
def torchrun(ctx: Ctx, name: str, nproc: int, script_args: list, timeout: float) -> tuple:
    """``PY -m torch.distributed.run --standalone ... --max-restarts 1``: (exit code or
    None when it did not end in time, its workers' output, its own log)."""
    base = os.path.join(ctx.work, name)
    env = ctx.job_env()
    with open(base + ".out", "wb") as out, open(base + ".err", "wb") as err:
        proc = subprocess.Popen(
            [ctx.py, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
             "--nproc-per-node", str(nproc), "--max-restarts", "1", "--monitor-interval",
             "0.1", *script_args], cwd=ctx.work, env=env, stdin=subprocess.DEVNULL,
            stdout=out, stderr=err, start_new_session=True)
    own(proc)
    try:
        rc = proc.wait(scaled(timeout))
    except subprocess.TimeoutExpired:
        rc = None
    stop_torchrun(proc)
    return rc, read_text(base + ".out"), read_text(base + ".err")


# -- what the workers printed ------------------------------------------------------------
CUDA_INIT = re.compile(r"^CUDA_INIT (\d+\.\d+) rank=(\d+)", re.M)
CUDA_STATE = re.compile(r"^CUDA_STATE rank=(\d+) initialized=(\d) bad_fork=(\d) libcuda=(\d)",
                        re.M)
MEM = re.compile(r"^MEM rank=(\d+) attempt=(\d+) free=(\d+) total=(\d+)", re.M)
FILL = re.compile(r"^FILL rank=(\d+) attempt=(\d+) bytes=(\d+)", re.M)
ITER_MEM = re.compile(r"^ITER_MEM rank=(\d+) iteration=(\d+) allocated=(\d+) reserved=(\d+) "
                      r"device_used=(\d+) rss=(\d+)", re.M)
DONE = re.compile(r"^DONE rank=(\d+) steps=\d+ iteration=\d+ check=(\w+)", re.M)
ENV = re.compile(r"^ENV rank=(\d+) cuda_visible=(\S+) gpus=(\S+)", re.M)
FIRST = re.compile(r"^FIRST_STEP (\d+\.\d+) attempt=(\d+) iteration=(\d+)", re.M)
CRASH = re.compile(r"^CRASH (\d+\.\d+) rank=(\d+)", re.M)


def crash_to_first(logs: str):
    """Seconds from the fault to the first step after it (workers' clock), or None."""
    crash, first, _, _ = fault_marks(logs)
    return None if crash is None or first is None else first - crash


def done_ok(logs: str, ranks: int) -> bool:
    got = DONE.findall(logs)
    return len(got) >= ranks and all(c == "ok" for _, c in got)


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def secs(x) -> str:
    return "-" if x is None else f"{x:.2f}s"


def mib(x) -> str:
    return "-" if x is None else f"{x / (1 << 20):.0f}MiB"


def cuda_init(logs: str):
    return median(float(t) for t, _ in CUDA_INIT.findall(logs))


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode(errors="replace")


def ctl(d: BenchDaemon, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``elasticctl --socket S ARGS`` with this run's interpreter, as a user would."""
    return subprocess.run([sys.executable, "-m", "elasticctl", "--socket", d.socket, *args],
                          capture_output=True, text=True, timeout=scaled(timeout),
                          stdin=subprocess.DEVNULL)
