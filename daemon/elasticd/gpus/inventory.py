"""This node's GPUs: what they are, found once at start.

``discover()`` answers with an ``Inventory`` of frozen ``Gpu`` records (index,
UUID, memory, PCI bus id, NUMA node and the CPUs local to it), from the first
source that answers, in order:

1. the test-only fake inventory (``daemon.fake_gpus_file``, a JSON file; see
   ``read_fake``): CPU machines and CI exercise the whole path with it;
2. NVML through ``nvidia-ml-py`` (module ``pynvml``), imported only if
   installed, never required;
3. ``nvidia-smi --query-gpu=...`` run with a timeout, its CSV parsed strictly
   (``parse_nvidia_smi``): a line that does not parse fails the whole answer
   rather than guessing;
4. nothing: no GPUs.

``daemon.gpus`` picks: ``auto`` (the above), ``none`` (no GPUs, whatever is
installed), or a list of indices (``0,1,3``: only those, each must exist).

NUMA locality comes from sysfs, not from NVML: ``/sys/bus/pci/devices/<bus
id>/numa_node`` and ``local_cpulist`` (what the kernel reports for the PCI
device; -1 / empty where the machine has one node). The records never change
after start; which job holds which GPU is gpus/alloc.py's.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass

from ..fields import MAX_GPUS
from ..values import BadValue, decode

log = logging.getLogger("elasticd.gpus")

FAKE_FILE_MAX_BYTES = 64 * 1024
NVIDIA_SMI_FIELDS = "index,uuid,memory.total,pci.bus_id"
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]{1,80}\Z")
_BUS_ID = re.compile(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])\Z")
_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*\Z")
MAX_CPU = 1 << 16


class InventoryError(ValueError):
    """The GPUs could not be read, or a source answered something malformed."""


@dataclass(frozen=True)
class Gpu:
    index: int                 # nvidia-smi's / NVML's index (PCI bus order)
    uuid: str                  # GPU-...: what CUDA_VISIBLE_DEVICES names (see workers)
    memory_mib: int
    numa_node: int = -1        # -1: unknown, or a one-node machine
    cpus: tuple = ()           # CPUs local to the GPU's NUMA node; (): unknown
    bus_id: str = ""           # sysfs form, e.g. 0000:3b:00.0; "" for a fake GPU


@dataclass(frozen=True)
class Inventory:
    gpus: tuple                # Gpu records, by index
    source: str                # fake | nvml | nvidia-smi | none | off

    @property
    def count(self) -> int:
        return len(self.gpus)

    def by_index(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)


# -- the setting -------------------------------------------------------------------
def parse_setting(value: str) -> str | tuple:
    """``daemon.gpus``: "auto", "none", or indices ("0,1,3"); InventoryError if not."""
    text = value.strip().lower()
    if text in ("auto", "none"):
        return text
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and len(p) <= 3 for p in parts):
        raise InventoryError(f"must be auto, none, or GPU indices like 0,1,3; got {value!r}")
    indices = tuple(int(p) for p in parts)
    if len(set(indices)) != len(indices) or max(indices) >= MAX_GPUS:
        raise InventoryError(f"indices must be distinct and below {MAX_GPUS}; got {value!r}")
    return indices


def discover(setting: str, fake_file: str = "", smi_timeout: float = 10.0,
             sysfs: str = "/sys") -> Inventory:
    """This node's GPUs as ``daemon.gpus`` and the fake file say (see the module doc)."""
    wanted = parse_setting(setting)
    if wanted == "none":
        return Inventory((), "off")
    if fake_file:
        inv = Inventory(read_fake(fake_file).gpus, "fake")
    else:
        inv = _nvml(sysfs) or _nvidia_smi(smi_timeout, sysfs) or Inventory((), "none")
    if wanted == "auto":
        return inv
    have = {g.index for g in inv.gpus}
    missing = [i for i in wanted if i not in have]
    if missing:
        raise InventoryError(f"GPU(s) {','.join(map(str, missing))} named but this node has "
                             f"{','.join(map(str, sorted(have))) or 'none'} ({inv.source})")
    return Inventory(tuple(g for g in inv.gpus if g.index in wanted), inv.source)


# -- the fake inventory (tests) ------------------------------------------------------
@dataclass(frozen=True)
class FakeState:
    gpus: tuple
    healthy: bool
    problem: str
    processes: dict            # GPU index -> pids of compute processes on it


def read_fake(path: str) -> FakeState:
    """The test-only fake inventory: a JSON object

        {"gpus": [{"index": 0, "uuid": "GPU-fake-0", "memory_mib": 81920,
                   "numa_node": 0, "cpus": "0-1"}, ...],
         "healthy": true, "problem": "", "processes": {"0": [1234]}}

    Read at start for the inventory and again at every health check (so a test
    flips ``healthy``). It is root's setting, yet checked like any input: a
    regular file (no link followed, no FIFO opened), at most
    FAKE_FILE_MAX_BYTES, every field typed and bounded."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InventoryError(f"fake GPU file {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InventoryError(f"fake GPU file {path}: not a regular file")
        data = os.read(fd, FAKE_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > FAKE_FILE_MAX_BYTES:
        raise InventoryError(f"fake GPU file {path}: larger than {FAKE_FILE_MAX_BYTES} bytes")
    try:
        doc = decode(data, max_bytes=FAKE_FILE_MAX_BYTES)
    except BadValue as bad:
        raise InventoryError(f"fake GPU file {path}: not a JSON object: {bad}") from None
    if not isinstance(doc.get("gpus"), list):
        raise InventoryError(f"fake GPU file {path}: needs an object with a \"gpus\" list")
    healthy, problem = doc.get("healthy", True), doc.get("problem", "")
    if not isinstance(healthy, bool) or not isinstance(problem, str):
        raise InventoryError(f"fake GPU file {path}: healthy must be a bool, problem a string")
    procs = doc.get("processes", {})
    if not isinstance(procs, dict) or len(procs) > MAX_GPUS or not all(
            isinstance(k, str) and k.isdigit() and len(k) <= 3 and isinstance(v, list)
            and len(v) <= 1024 and all(type(p) is int and 0 < p < 2**31 for p in v)
            for k, v in procs.items()):
        raise InventoryError(f"fake GPU file {path}: processes must map GPU indices to pids")
    if len(doc["gpus"]) > MAX_GPUS:
        raise InventoryError(f"fake GPU file {path}: more than {MAX_GPUS} GPUs")
    gpus = []
    for i, g in enumerate(doc["gpus"]):
        if not isinstance(g, dict):
            raise InventoryError(f"fake GPU file {path}: gpus[{i}] is not an object")
        try:
            gpus.append(_gpu(g.get("index"), g.get("uuid"), g.get("memory_mib", 0),
                             g.get("numa_node", -1), _cpu_list(g.get("cpus", ""))))
        except InventoryError as exc:
            raise InventoryError(f"fake GPU file {path}: gpus[{i}]: {exc}") from None
    return FakeState(_checked(gpus), healthy, problem[:500],
                     {int(k): tuple(v) for k, v in procs.items()})


def _gpu(index, uuid, memory_mib, numa_node, cpus: tuple, bus_id: str = "") -> Gpu:
    for name, value, hi in (("index", index, MAX_GPUS - 1), ("memory_mib", memory_mib, 1 << 30),
                            ("numa_node", numa_node, 1024)):
        if type(value) is not int or not (-1 if name == "numa_node" else 0) <= value <= hi:
            raise InventoryError(f"{name}: {value!r} is not a number in range")
    if not isinstance(uuid, str) or not _UUID.match(uuid):
        raise InventoryError(f"uuid: {str(uuid)[:90]!r} is not a GPU UUID (GPU-..., MIG-...)")
    return Gpu(index, uuid, memory_mib, numa_node, cpus, bus_id)


def _checked(gpus: list) -> tuple:
    if len({g.index for g in gpus}) != len(gpus) or len({g.uuid for g in gpus}) != len(gpus):
        raise InventoryError("two GPUs share an index or a UUID")
    return tuple(sorted(gpus, key=lambda g: g.index))


def _cpu_list(text) -> tuple:
    """A kernel CPU list ("0-3,8-11") as a tuple of CPU numbers; () for ""."""
    if not isinstance(text, str):
        raise InventoryError(f"cpus: {text!r} is not a CPU list like 0-3,8")
    text = text.strip()
    if not text:
        return ()
    if len(text) > 4096 or not _CPU_LIST.match(text):
        raise InventoryError(f"cpus: {text[:60]!r} is not a CPU list like 0-3,8")
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a or b >= MAX_CPU:
            raise InventoryError(f"cpus: range {part!r} is not valid")
        cpus.update(range(a, b + 1))
    return tuple(sorted(cpus))


def cpu_list_text(cpus) -> str:
    """CPU numbers back in the kernel's form ("0-3,8")."""
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


# -- NUMA locality from sysfs ------------------------------------------------------
def sysfs_bus_id(bus_id: str) -> str:
    """nvidia-smi's / NVML's "00000000:3B:00.0" as sysfs names it, "0000:3b:00.0"."""
    m = _BUS_ID.match(bus_id.strip())
    if not m:
        raise InventoryError(f"pci bus id {bus_id[:40]!r} is not domain:bus:device.function")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def numa_of(bus_id: str, sysfs: str = "/sys") -> tuple[int, tuple]:
    """(NUMA node, local CPUs) of a PCI device; (-1, ()) where sysfs does not say."""
    base = os.path.join(sysfs, "bus", "pci", "devices", bus_id)
    node, cpus = -1, ()
    try:
        with open(os.path.join(base, "numa_node")) as fh:
            node = max(-1, min(1024, int(fh.read(32).strip())))
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(base, "local_cpulist")) as fh:
            cpus = _cpu_list(fh.read(4096).strip())
    except (OSError, InventoryError):
        pass
    return node, cpus


# -- nvidia-smi ----------------------------------------------------------------------
def parse_nvidia_smi(text: str, sysfs: str | None = None) -> tuple:
    """The GPUs in ``nvidia-smi --query-gpu=index,uuid,memory.total,pci.bus_id
    --format=csv,noheader,nounits`` output: one line per GPU, four fields.
    Strict: a line that does not parse (a "[N/A]", an error text, a field too
    many) fails the whole answer with InventoryError."""
    gpus = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise InventoryError(f"nvidia-smi line {n}: expected 4 fields, got {line[:120]!r}")
        index, uuid, memory, bus = fields
        if not index.isdigit() or not memory.isdigit():
            raise InventoryError(f"nvidia-smi line {n}: index and memory must be numbers, got "
                                 f"{line[:120]!r}")
        bus_id = sysfs_bus_id(bus)
        node, cpus = numa_of(bus_id, sysfs) if sysfs else (-1, ())
        try:
            gpus.append(_gpu(int(index), uuid, int(memory), node, cpus, bus_id))
        except InventoryError as exc:
            raise InventoryError(f"nvidia-smi line {n}: {exc}") from None
        if len(gpus) > MAX_GPUS:
            raise InventoryError(f"nvidia-smi: more than {MAX_GPUS} GPUs")
    return _checked(gpus)


def run_nvidia_smi(args: list, timeout: float) -> str | None:
    """nvidia-smi's output for these arguments; None when it is not installed, fails
    or does not answer within ``timeout``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi did not answer: %s", exc)
        return None
    if done.returncode != 0:
        log.warning("nvidia-smi exited %d: %s", done.returncode,
                    done.stderr.decode(errors="replace").strip()[:200])
        return None
    return done.stdout[:1 << 20].decode(errors="replace")


def _nvidia_smi(timeout: float, sysfs: str) -> Inventory | None:
    out = run_nvidia_smi([f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv,noheader,nounits"],
                         timeout)
    if out is None:
        return None
    return Inventory(parse_nvidia_smi(out, sysfs), "nvidia-smi")


# -- NVML (nvidia-ml-py), only if installed --------------------------------------------
def nvml_module():
    """pynvml, initialised, or None where it is not installed or finds no driver."""
    try:
        import pynvml  # nvidia-ml-py: optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and its many subclasses
        log.info("NVML present but not usable (%s); trying nvidia-smi", exc)
        return None
    return pynvml


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml(sysfs: str) -> Inventory | None:
    nv = nvml_module()
    if nv is None:
        return None
    gpus = []
    try:
        for i in range(min(nv.nvmlDeviceGetCount(), MAX_GPUS)):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            bus_id = sysfs_bus_id(_text(nv.nvmlDeviceGetPciInfo(h).busId))
            node, cpus = numa_of(bus_id, sysfs)
            gpus.append(_gpu(i, _text(nv.nvmlDeviceGetUUID(h)),
                             int(nv.nvmlDeviceGetMemoryInfo(h).total) >> 20, node, cpus,
                             bus_id))
    except InventoryError:
        raise
    except Exception as exc:
        raise InventoryError(f"NVML: {exc}") from None
    return Inventory(_checked(gpus), "nvml")
