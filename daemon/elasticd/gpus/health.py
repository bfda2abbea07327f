"""GPU health before a round: the quick check, the command hook, the drain.

Before this node joins a round of a job that uses GPUs here, the job's agent
asks ``HealthGate.before_round``. It runs, on the job's devices:

- the devices must run no process: a dead rank's memory is free only once its
  process is gone from the device, so it waits up to ``daemon.gpu_release_timeout``
  for the compute processes on them (NVML, nvidia-smi, the fake file) to go;
- the quick check of the inventory's source (``quick_check``): the fake
  file's ``healthy``/``problem`` (tests); NVML: each device answers, no page
  is pending retirement, no critical XID event since the last check, enough
  free memory; nvidia-smi: ``retired_pages.pending`` and ``memory.free``;
- then ``daemon.gpu_health_command`` if set: run as the daemon's own user
  (root on a real node: it is root's setting, like Slurm's HealthCheckProgram,
  never the job's), with ``daemon.gpu_health_timeout``, no stdin, a minimal
  environment naming the devices; exit 0 is healthy, anything else (or no
  answer in time) a failure whose first output line is the reason.

A failing node does not join: the agent waits ``daemon.gpu_health_retry_interval``
and asks again. Each failure is an event of the job and a line in
``elasticctl nodes`` (``problem()``); after ``daemon.gpu_health_failures_to_drain``
failures in a row the node drains itself (``elasticctl uncordon`` takes it
back). A passing check resets the count.
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from .inventory import Inventory, InventoryError, read_fake, run_nvidia_smi
from ..logsetup import ctx

log = logging.getLogger("elasticd.gpus")

HOOK_OUTPUT_MAX = 4096


@dataclass(frozen=True)
class HealthResult:
    ok: bool
    problems: tuple = ()        # one line each; empty when ok

    @property
    def reason(self) -> str:
        return "; ".join(self.problems)[:500]


OK = HealthResult(True)


def should_drain(failures_in_a_row: int, threshold: int) -> bool:
    """Whether a node with that many failed checks in a row drains itself (0: never)."""
    return threshold > 0 and failures_in_a_row >= threshold


# -- the quick check per source ----------------------------------------------------
def parse_smi_health(text: str, indices) -> list[str]:
    """Problems in ``nvidia-smi --query-gpu=index,retired_pages.pending,memory.free
    --format=csv,noheader,nounits`` for these GPU indices. A device missing from the
    answer is a problem; "[N/A]"/"[Not Supported]" for pending pages is not."""
    seen, problems = set(), []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit():
            return [f"nvidia-smi answered a line that does not parse: {line[:120]!r}"]
        index, pending = int(fields[0]), fields[1].lower()
        seen.add(index)
        if index in indices and pending == "yes":
            problems.append(f"GPU {index}: pages pending retirement (reset the GPU or reboot)")
    problems += [f"GPU {i}: nvidia-smi does not list it" for i in indices if i not in seen]
    return problems


def parse_smi_apps(text: str) -> dict[str, list[int]]:
    """``nvidia-smi --query-compute-apps=gpu_uuid,pid --format=csv,noheader``: the pids
    of compute processes by GPU UUID. Strict: InventoryError on a line that does not
    parse ("No running processes found" is not printed in CSV mode)."""
    apps: dict[str, list[int]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2 or not fields[1].isdigit() or not fields[0].startswith(("GPU-",
                                                                                    "MIG-")):
            raise InventoryError(f"nvidia-smi compute apps: {line[:120]!r} does not parse")
        apps.setdefault(fields[0], []).append(int(fields[1]))
    return apps


def processes_on(inv: Inventory, gpus: tuple, fake_file: str, timeout: float,
                 nv=None) -> dict[int, list[int]]:
    """Compute processes on these GPUs, by index ({} where the source cannot tell)."""
    if inv.source == "fake":
        try:
            procs = read_fake(fake_file).processes
        except InventoryError:
            return {}
        return {g.index: list(procs[g.index]) for g in gpus if procs.get(g.index)}
    if inv.source == "nvml" and nv is not None:
        out = {}
        for g in gpus:
            try:
                h = nv.nvmlDeviceGetHandleByIndex(g.index)
                pids = [int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
            except Exception:  # an unanswering device is the quick check's to report
                continue
            if pids:
                out[g.index] = pids
        return out
    if inv.source == "nvidia-smi":
        text = run_nvidia_smi(["--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"],
                              timeout)
        try:
            apps = parse_smi_apps(text or "")
        except InventoryError as exc:
            log.warning("%s", exc)
            return {}
        return {g.index: apps[g.uuid] for g in gpus if apps.get(g.uuid)}
    return {}


def wait_released(inv: Inventory, gpus: tuple, fake_file: str, timeout: float, nv=None,
                  poll: float = 0.25, clock=time.monotonic, sleep=time.sleep) -> list[str]:
    """Wait up to ``timeout`` for the job's GPUs to run no process (a dead rank's memory
    is only free once its process is gone from the device); problems if some stay."""
    deadline = clock() + timeout
    while True:
        busy = processes_on(inv, gpus, fake_file, timeout, nv)
        if not busy:
            return []
        if clock() >= deadline:
            return [f"GPU {i}: still used by pid {','.join(map(str, pids[:5]))} after "
                    f"{timeout:g}s (daemon.gpu_release_timeout)"
                    for i, pids in sorted(busy.items())]
        sleep(poll)


def quick_check(inv: Inventory, gpus: tuple, fake_file: str, timeout: float,
                nvml_state: "NvmlEvents | None") -> list[str]:
    """Problems found on ``gpus`` by the inventory's own source; [] when healthy."""
    if inv.source == "fake":
        try:
            fake = read_fake(fake_file)
        except InventoryError as exc:
            return [str(exc)]
        return [] if fake.healthy else [fake.problem or "the fake health check fails"]
    if inv.source == "nvml" and nvml_state is not None:
        return nvml_state.check(gpus)
    if inv.source == "nvidia-smi":
        out = run_nvidia_smi(["--query-gpu=index,retired_pages.pending,memory.free",
                              "--format=csv,noheader,nounits"], timeout)
        if out is None:
            return ["nvidia-smi did not answer"]
        return parse_smi_health(out, [g.index for g in gpus])
    return []


class NvmlEvents:
    """NVML health: each device answers, no pending page retirement, no critical XID
    event since the last check (an event set registered once, drained at each check)."""

    def __init__(self, nv, inv: Inventory):
        self._nv = nv
        self._set = None
        try:
            self._set = nv.nvmlEventSetCreate()
            for g in inv.gpus:
                try:
                    nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(g.index),
                                                nv.nvmlEventTypeXidCriticalError, self._set)
                except nv.NVMLError as exc:  # e.g. not supported on this board
                    log.info("GPU %d: no XID events from NVML: %s", g.index, exc)
        except Exception as exc:
            log.info("NVML event set unavailable: %s", exc)
            self._set = None

    def _xids(self) -> dict[int, list[int]]:
        """Critical XIDs per device index since the last call (never blocks)."""
        nv, got = self._nv, {}
        if self._set is None:
            return got
        for _ in range(256):
            try:
                ev = nv.nvmlEventSetWait(self._set, 0)
            except nv.NVMLError:  # NVML_ERROR_TIMEOUT: nothing (more) happened
                break
            try:
                index = nv.nvmlDeviceGetIndex(ev.device)
            except nv.NVMLError:
                index = -1
            got.setdefault(index, []).append(int(ev.eventData))
        return got

    def check(self, gpus: tuple) -> list[str]:
        nv, problems = self._nv, []
        xids = self._xids()
        for g in gpus:
            try:
                h = nv.nvmlDeviceGetHandleByIndex(g.index)
                nv.nvmlDeviceGetMemoryInfo(h)
            except Exception as exc:
                problems.append(f"GPU {g.index}: does not answer NVML: {exc}")
                continue
            try:
                if nv.nvmlDeviceGetRetiredPagesPendingStatus(h):
                    problems.append(f"GPU {g.index}: pages pending retirement (reset the GPU "
                                    "or reboot)")
            except nv.NVMLError:
                pass  # not supported on this board
            if xids.get(g.index):
                problems.append(f"GPU {g.index}: XID {','.join(map(str, xids[g.index][:5]))} "
                                "since the last check")
        return problems


def run_hook(command: str, gpus: tuple, node_id: str, job_id: str, timeout: float) -> list[str]:
    """``daemon.gpu_health_command``: [] if it exits 0, else one line saying why."""
    argv = shlex.split(command)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ELASTICD_NODE_ID": node_id,
           "ELASTICD_JOB_ID": job_id,
           "ELASTICD_GPUS": ",".join(str(g.index) for g in gpus),
           "ELASTICD_GPU_UUIDS": ",".join(g.uuid for g in gpus)}
    try:  # its own session: on a timeout the whole group goes, children it left too
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, close_fds=True,
                                start_new_session=True)
    except OSError as exc:
        return [f"health command {argv[0]}: {exc.strerror or exc}"]
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return [f"health command did not answer within {timeout:g}s (daemon.gpu_health_timeout)"]
    _kill_group(proc)  # exited: whatever it left in its group must not live on
    if proc.returncode == 0:
        return []
    first = next((ln.strip() for ln in out[:HOOK_OUTPUT_MAX].decode(errors="replace")
                  .splitlines() if ln.strip()), "")
    return [f"health command exited {proc.returncode}" + (f": {first[:200]}" if first else "")]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.stdout is not None:
        proc.stdout.close()
    proc.wait()


class HealthGate:
    """The node's health verdicts: one lock, a count of failures in a row, the last
    problem; drains the node (``drain(reason)``) once the count reaches the threshold."""

    def __init__(self, cfg, inv: Inventory, registry, drain, metrics=None, nvml=None):
        self._cfg = cfg
        self._inv = inv
        self._registry = registry
        self._drain = drain
        self._metrics = metrics
        self._nv = nvml
        self._nvml = NvmlEvents(nvml, inv) if nvml is not None and inv.source == "nvml" else None
        self._lock = threading.Lock()
        self.failures = 0
        self.last: HealthResult | None = None     # None: not checked yet
        self.drained = False

    @property
    def active(self) -> bool:
        """Whether there is anything to check on this node (it has GPUs)."""
        return self._inv.count > 0

    def before_round(self, job_id: str, gpus: tuple) -> HealthResult:
        """Check ``gpus`` (the job's devices here) before joining a round."""
        d = self._cfg.daemon
        with self._lock:  # one check at a time: jobs starting together share the devices
            problems = wait_released(self._inv, gpus, d.fake_gpus_file, d.gpu_release_timeout,
                                     self._nv)
            problems += quick_check(self._inv, gpus, d.fake_gpus_file, d.gpu_health_timeout,
                                    self._nvml)
            if not problems and d.gpu_health_command:
                problems = run_hook(d.gpu_health_command, gpus, d.node_id, job_id,
                                    d.gpu_health_timeout)
            result = HealthResult(not problems, tuple(problems))
            self.last = result
            self.failures = 0 if result.ok else self.failures + 1
            failures = self.failures
            drain = not result.ok and should_drain(failures, d.gpu_health_failures_to_drain) \
                and not self.drained
            # Claimed here, under the lock: two jobs failing at once drain it once.
            self.drained = drain or (self.drained and not result.ok)
        if self._metrics is not None:
            self._metrics.gpu_health(result.ok)
        if result.ok:
            return result
        where = ctx(job=job_id, node=d.node_id)
        log.warning("%s: GPU health check failed (%d in a row): %s", where, failures,
                    result.reason)
        self._registry.event(job_id, "gpu_health",
                             f"GPU health check failed on {d.node_id} ({failures} in a row); "
                             f"not joining: {result.reason}")
        if drain:
            why = (f"GPU health failed {failures} times in a row "
                   f"(daemon.gpu_health_failures_to_drain): {result.reason}")
            try:
                self._drain(why)
                log.error("%s: draining this node: %s; `elasticctl uncordon %s` takes it back",
                          where, why, d.node_id)
                self._registry.event(job_id, "gpu_health", f"node {d.node_id} drained itself: "
                                     f"{why}")
            except Exception as exc:  # etcd away: try again at the next failure
                log.warning("%s: could not drain this node: %s", where, exc)
                with self._lock:
                    self.drained = False
        return result

    def probe(self) -> HealthResult:
        """Every GPU of the node checked outside any round (the quick check, then
        ``daemon.gpu_health_command``): a quarantined node's way back
        (cluster/quarantine.py). No event, no count toward a drain."""
        d = self._cfg.daemon
        gpus = tuple(g.index for g in self._inv.gpus)
        with self._lock:
            problems = quick_check(self._inv, gpus, d.fake_gpus_file, d.gpu_health_timeout,
                                   self._nvml)
            if not problems and d.gpu_health_command:
                problems = run_hook(d.gpu_health_command, gpus, d.node_id, "",
                                    d.gpu_health_timeout)
        return HealthResult(not problems, tuple(problems))

    def problem(self) -> str:
        """The node's GPU problem for `elasticctl nodes`; "" when the last check passed."""
        with self._lock:
            if self.last is None or self.last.ok:
                return ""
            threshold = self._cfg.daemon.gpu_health_failures_to_drain
            tail = f"; drains after {threshold}" if threshold and not self.drained else ""
            return (f"GPU health check failing ({self.failures} in a row{tail}): "
                    f"{self.last.reason}")

    def status(self) -> str:
        """ok | failing: <why> | "" (no GPUs, or not checked yet)."""
        if not self.active:
            return ""
        with self._lock:
            if self.last is None:
                return ""
            return "ok" if self.last.ok else f"failing: {self.last.reason}"[:300]

