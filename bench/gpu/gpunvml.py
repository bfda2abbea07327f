"""What the GPU check asks NVML (never CUDA): the GPU, its compute processes, the driver.

The runner must not create a CUDA context of its own: it would count as a
process on the GPU and hold up the daemon's health gate, which waits for
the device to run nothing before a round.
"""
from __future__ import annotations

import time


def nvml():
    """pynvml, initialised; None where it is missing or finds no driver."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_gpu(nv) -> dict:
    """GPU 0: uuid, name, bus id, total and used bytes, the driver's version."""
    h = nv.nvmlDeviceGetHandleByIndex(0)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    return {"uuid": _text(nv.nvmlDeviceGetUUID(h)), "name": _text(nv.nvmlDeviceGetName(h)),
            "bus_id": _text(nv.nvmlDeviceGetPciInfo(h).busId), "total": int(mem.total),
            "used": int(mem.used), "driver": _text(nv.nvmlSystemGetDriverVersion())}


def gpu_pids(nv) -> list[int]:
    """Compute processes on GPU 0, as NVML names them (in a container, maybe the host's)."""
    h = nv.nvmlDeviceGetHandleByIndex(0)
    return [int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]


def wait_gpu_idle(nv, timeout: float) -> tuple[bool, list[int]]:
    """Wait up to ``timeout`` s for GPU 0 to run no compute process: (idle, pids left)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = gpu_pids(nv)
        if not pids or time.monotonic() >= deadline:
            return not pids, pids
        time.sleep(0.2)


def libcuda_mapped(pid: int) -> bool | None:
    """Whether the CUDA driver library is loaded in a process (None: cannot tell)."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return any("libcuda.so" in line for line in fh)
    except OSError:
        return None
