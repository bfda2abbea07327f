"""The GPU check's runner: one step, the versions, the sweep, the summary and the tarball.

bench/gpu/check.sh calls it once per step, each under its own timeout:

    run.py versions --work ROOT [--cpu]     what this run uses (ROOT/versions.txt)
    run.py step NAME --work ROOT [--cpu]    one step; its rows go to ROOT/results/NAME.json
    run.py record NAME --work ROOT --status S --note TEXT [--seconds N]
                                            a row check.sh adds (a step that timed out)
    run.py sweep --work ROOT [--cpu]        end this run's leftovers; wait for an idle GPU
    run.py summary --work ROOT --out OUT    the table (stdout, OUT/summary.txt,
                                            OUT/results.json); exit 1 if a row failed
    run.py pack --work ROOT --out OUT       OUT/logs.tar.gz of every log under ROOT
"""
from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench/gpu, bench/ (common.py)
import gpunvml  # noqa: E402
import results  # noqa: E402

STEPS = {  # name -> (module, function, what it checks)
    "e2e": ("steps_jobs", "e2e", "1 CUDA jobs end to end, nodes, metrics"),
    "crash": ("steps_jobs", "crash", "2 crash with a full card; vs torchrun"),
    "inprocess": ("steps_faults", "inprocess", "3 in-process x20, memory growth"),
    "hang": ("steps_faults", "hang", "4 hung CUDA kernel"),
    "template": ("steps_warm", "template", "5 templates and spares vs CUDA"),
    "snapshot": ("steps_warm", "snapshot", "6 snapshots of CUDA tensors"),
}
DISTS = ("grpcio", "grpcio-health-checking", "protobuf", "cryptography", "psutil",
         "prometheus-client", "nvidia-ml-py")
PACK_FILE_MAX = 2 << 20   # bytes of one file kept in the tarball (its tail)
PACK_MAX = 15 << 20       # the tarball must come back from the device (16 MiB a file)


def run_step(name: str, work_root: str, cpu: bool) -> int:
    work = os.path.join(work_root, name)
    os.makedirs(work, exist_ok=True)
    step = results.Step(name, work)
    nv = None
    if not cpu:
        nv = gpunvml.nvml()
        if nv is None:
            step.add(STEPS[name][2], False, note="NVML (pynvml) is not usable: no GPU, or no "
                     "nvidia-ml-py; use --cpu for the dry run")
            return 0
    module, func, label = STEPS[name]
    try:
        import gpucheck  # the daemon's client: grpcio, protobuf
        getattr(importlib.import_module(module), func)(
            gpucheck.Ctx(cpu=cpu, work=work, nvml=nv), step)
    except Exception as exc:
        step.crashed(label, exc)
    return 0


def record(name: str, work_root: str, status: str, note: str) -> None:
    work = os.path.join(work_root, name)
    os.makedirs(work, exist_ok=True)
    results.Step(name, work).add(STEPS[name][2], None if status == results.SKIP else False,
                                 note=note)


def _dist_version(name: str) -> str:
    """An installed distribution's version, as this interpreter (and PYTHONPATH) sees it."""
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


CUDA_PROBE = """
import time, torch
t0 = time.perf_counter()
x = torch.randn(4096, 4096, device="cuda")
(x @ x).sum().item()
print(f"ok: {torch.cuda.get_device_name()}, context + first matmul "
      f"{time.perf_counter() - t0:.2f}s, {torch.cuda.device_count()} device(s)")
"""


def _cuda_probe() -> str:
    """CUDA works for this torch: a matmul in a throw-away process (never this one's)."""
    try:
        res = subprocess.run([sys.executable, "-c", CUDA_PROBE], capture_output=True,
                             text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "FAILED: no answer within 120 s"
    if res.returncode == 0:
        return res.stdout.strip()
    return "FAILED: " + (res.stderr.strip().splitlines() or ["?"])[-1][:300]


def versions(work_root: str, cpu: bool) -> int:
    torch = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, "
                            "torch.version.cuda, torch.cuda.nccl.version() if "
                            "torch.version.cuda else '-')"],
                           capture_output=True, text=True, timeout=120)
    tv = torch.stdout.split() if torch.returncode == 0 else ["missing", "-", "-"]
    lines = [f"mode: {'--cpu (gloo on CPU tensors, fake GPU inventory)' if cpu else 'GPU'}",
             f"python: {sys.executable} {platform.python_version()}",
             f"torch: {tv[0]}, CUDA {tv[1]}, NCCL {' '.join(tv[2:]) or '-'}",
             ", ".join(f"{d} {_dist_version(d)}" for d in DISTS),
             f"machine: {os.cpu_count()} CPUs, {platform.machine()}, kernel "
             f"{platform.release()}, load {os.getloadavg()[0]:.1f}"]
    nv = None if cpu else gpunvml.nvml()
    if nv is not None:
        info = gpunvml.nvml_gpu(nv)
        lines.append(f"GPU: {info['name']}, {info['total'] >> 20} MiB ({info['used'] >> 20} "
                     f"used), driver {info['driver']}, {info['uuid']}, bus {info['bus_id']}, "
                     f"compute processes now {gpunvml.gpu_pids(nv) or 'none'}")
        lines.append(f"CUDA probe (a process of its own): {_cuda_probe()}")
    elif not cpu:
        lines.append("GPU: NVML not usable (no driver, or no nvidia-ml-py)")
    if torch.returncode != 0:
        lines.append(f"torch import failed: {torch.stderr.strip().splitlines()[-1:]}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(work_root, "versions.txt"), "w") as fh:
        fh.write(text + "\n")
    return 0


def sweep(work_root: str, cpu: bool) -> int:
    """SIGKILL every process of this run still alive (marked by its environment), then
    wait for the GPU to run nothing (a step's leftovers would hold it up for the next)."""
    import psutil
    mine = {os.getpid()} | {p.pid for p in psutil.Process().parents()}
    left = []
    for p in psutil.process_iter(["pid"]):
        if p.pid in mine:
            continue
        try:
            if p.environ().get(results.TAG_ENV) == work_root:
                left.append(p)
        except (psutil.Error, OSError):
            continue
    from common import kill_procs
    kill_procs(left)
    if left:
        print(f"sweep: killed {len(left)} leftover process(es): "
              f"{', '.join(str(p.pid) for p in left[:10])}", flush=True)
    nv = None if cpu else gpunvml.nvml()
    if nv is not None:
        ok, pids = gpunvml.wait_gpu_idle(nv, 20)
        if not ok:
            print(f"sweep: the GPU still runs {pids} after 20 s", flush=True)
    return 0


def _rows(work_root: str) -> list[tuple[str, results.Row]]:
    return [(name, row) for name in STEPS
            for row in results.load(os.path.join(work_root, "results", f"{name}.json"))]


def summary(work_root: str, out_dir: str) -> int:
    rows = _rows(work_root)
    meta = {}
    for name in STEPS:
        try:
            with open(os.path.join(work_root, "results", f"{name}.meta")) as fh:
                meta[name] = fh.read().split()
        except OSError:
            pass
    times = ", ".join(f"{n} {m[1]}s (limit {m[2]}s, exit {m[0]})" for n, m in meta.items())
    failed = [r for _, r in rows if r.status == results.FAIL]
    verdict = (f"FAILED: {len(failed)} of {len(rows)} checks" if failed else
               f"OK: {sum(r.status == results.PASS for _, r in rows)} passed, "
               f"{sum(r.status == results.SKIP for _, r in rows)} skipped")
    if not rows:
        verdict = "FAILED: no check ran"
    try:
        with open(os.path.join(work_root, "versions.txt")) as fh:
            head = fh.read().strip()
    except OSError:
        head = "versions: not recorded"
    text = (f"{head}\n\n{results.markdown([r for _, r in rows])}\n\n"
            f"step times: {times or '-'}\n{verdict}\n")
    print("\n== GPU check ==\n" + text, flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump({"rows": [dict(step=n, **r.__dict__) for n, r in rows], "verdict": verdict,
                   "meta": meta, "time": time.time()}, fh, indent=1)
    return 1 if failed or not rows else 0


def pack(work_root: str, out_dir: str) -> int:
    """Every regular file under the work root, each cut to its last PACK_FILE_MAX bytes,
    into OUT/logs.tar.gz; files are left out (named in SKIPPED.txt) past PACK_MAX."""
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, "logs.tar.gz")
    skipped, total = [], 0
    with tarfile.open(target, "w:gz") as tar:
        for base, dirs, files in os.walk(work_root):
            dirs[:] = [d for d in dirs if d != "site"]  # the installed wheels
            for f in sorted(files):
                path = os.path.join(base, f)
                rel = os.path.relpath(path, os.path.dirname(work_root))
                try:
                    if not os.path.isfile(path) or os.path.islink(path):
                        continue
                    size = os.path.getsize(path)
                    with open(path, "rb") as fh:
                        fh.seek(max(0, size - PACK_FILE_MAX))
                        data = fh.read()
                except OSError:
                    continue
                if total + len(data) > PACK_MAX * 4:  # ~4x gzip on logs; checked below too
                    skipped.append(rel)
                    continue
                total += len(data)
                info = tarfile.TarInfo(rel)
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
    if os.path.getsize(target) > PACK_MAX:
        print(f"pack: {target} is {os.path.getsize(target) >> 20} MiB: larger than the "
              f"{PACK_MAX >> 20} MiB that comes back from the device", flush=True)
    if skipped:
        with open(os.path.join(out_dir, "SKIPPED.txt"), "w") as fh:
            fh.write("\n".join(skipped) + "\n")
    print(f"logs: {target} ({os.path.getsize(target) >> 10} KiB)", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("versions", "step", "record", "sweep", "summary", "pack"))
    p.add_argument("name", nargs="?", default="")
    p.add_argument("--work", required=True)
    p.add_argument("--out", default="")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--status", default=results.FAIL)
    p.add_argument("--note", default="")
    a = p.parse_args(argv)
    if a.what in ("step", "record") and a.name not in STEPS:
        p.error(f"step must be one of {', '.join(STEPS)}")
    if a.what == "step":
        return run_step(a.name, a.work, a.cpu)
    if a.what == "record":
        record(a.name, a.work, a.status, a.note)
        return 0
    if a.what == "versions":
        return versions(a.work, a.cpu)
    if a.what == "sweep":
        return sweep(a.work, a.cpu)
    if a.what == "summary":
        return summary(a.work, a.out)
    return pack(a.work, a.out)


if __name__ == "__main__":
    sys.exit(main())
