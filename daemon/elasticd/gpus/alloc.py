"""Which job holds which of this node's GPUs, and the binding a worker gets.

``GpuLedger`` is owned by the job manager and changed under its lock: a job's
agent takes its devices when it starts on this node and gives them back when
it exits, so every restart and replaced rank of the job on this node runs on
the same devices. A job asks for ``gpus_per_node`` (``needed()``: -1, the
default, means one per local rank when the node has GPUs, none otherwise).
``take()`` prefers the devices the job held before (its record keeps them, so
a daemon restart gives them back), then devices on one NUMA node (the
fullest node that still fits, keeping whole nodes free for bigger jobs),
then the lowest indices. ``Binding`` is what the workers get: the devices,
and with ``--cpu-bind numa`` the CPUs local to them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .inventory import Inventory, cpu_list_text

CPU_BIND_MODES = ("none", "numa")


def needed(gpus_per_node: int, nproc: int, node_gpus: int) -> int:
    """GPUs a job takes on a node with ``node_gpus`` GPUs."""
    if gpus_per_node < 0:
        return nproc if node_gpus else 0
    return gpus_per_node


@dataclass(frozen=True)
class Binding:
    """A job's devices on this node and the CPUs its workers are bound to."""
    gpus: tuple = ()           # Gpu records, in the order CUDA_VISIBLE_DEVICES lists them
    cpus: tuple = ()           # () : no CPU binding
    node_has_gpus: bool = False

    @property
    def indices(self) -> list[int]:
        return [g.index for g in self.gpus]

    def env(self) -> dict[str, str]:
        """What each worker of the job gets. CUDA_VISIBLE_DEVICES names the devices
        by UUID: an index means CUDA's own order (fastest first unless
        CUDA_DEVICE_ORDER=PCI_BUS_ID), which need not be nvidia-smi's, so the
        wrong GPU could be used; a UUID is one device whatever the order. The whole
        set, so LOCAL_RANK indexes into it as under torchrun. A job without
        GPUs on a node that has some sees none (an empty list), not all of them.
        ELASTICD_GPUS: the nvidia-smi indices, for people and tools."""
        if not self.node_has_gpus:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in self.gpus),
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "ELASTICD_GPUS": ",".join(str(g.index) for g in self.gpus)}

    @property
    def cpus_text(self) -> str:
        return cpu_list_text(self.cpus)


def numa_cpus(gpus, allowed=None) -> tuple:
    """The CPUs local to these GPUs that this daemon may use; () if none is known."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    local = set()
    for g in gpus:
        local.update(g.cpus)
    return tuple(sorted(local & allowed))


class GpuLedger:
    def __init__(self, inv: Inventory):
        self.inventory = inv
        self._held: dict[str, tuple] = {}     # job id -> indices

    @property
    def total(self) -> int:
        return self.inventory.count

    def held(self) -> dict[str, tuple]:
        return dict(self._held)

    def free(self) -> list[int]:
        taken = {i for held in self._held.values() for i in held}
        return [g.index for g in self.inventory.gpus if g.index not in taken]

    def holder(self, index: int) -> str:
        return next((j for j, held in self._held.items() if index in held), "")

    def take(self, job_id: str, count: int, prefer=()) -> tuple | None:
        """``count`` free devices for the job (its own if it holds some); None if
        not that many are free."""
        if job_id in self._held:
            return tuple(self.inventory.by_index(i) for i in self._held[job_id])
        free = self.free()
        if count > len(free):
            return None
        chosen = pick(self.inventory, free, count, prefer)
        self._held[job_id] = chosen
        return tuple(self.inventory.by_index(i) for i in chosen)

    def release(self, job_id: str) -> None:
        self._held.pop(job_id, None)


def pick(inv: Inventory, free: list[int], count: int, prefer=()) -> tuple:
    """Which free indices to give (pure): the preferred ones if all are free, else the
    fullest NUMA node that fits, else the lowest indices."""
    if count == 0:
        return ()
    prefer = tuple(prefer)
    if len(prefer) == count and all(i in free for i in prefer):
        return prefer
    by_node: dict[int, list[int]] = {}
    for i in free:
        by_node.setdefault(inv.by_index(i).numa_node, []).append(i)
    fitting = [(len(ids), node) for node, ids in by_node.items() if len(ids) >= count]
    if fitting:
        _, node = min(fitting)
        return tuple(sorted(by_node[node])[:count])
    return tuple(sorted(free)[:count])


def binding_for(gpus: tuple, cpu_bind: str, node_has_gpus: bool, allowed=None) -> Binding:
    cpus = numa_cpus(gpus, allowed) if cpu_bind == "numa" else ()
    return Binding(tuple(gpus), cpus, node_has_gpus)

