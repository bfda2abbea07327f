"""A cluster job's spec: the typed record every node runs the job from, and its one check.

The submitting daemon builds a ``JobSpec`` from the job's record
(``JobSpec.of_record``); trust/specs.py seals its wire form (``to_wire``, the
one place it is serialised: the fields as etcd has always held them) and
opens another daemon's, which ``JobSpec.from_wire`` checks field by field
with the same rules as a submission (control/validation.py): the field checks
below are the one validator of both. A node that adopts the job makes its
record from the spec (``record``). Other modules read the spec's fields,
never a dict.
"""
from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Protocol

from ..errors import InvalidArgument
from ..fields import MAX_GPUS
from .jobrecord import JobRecord

JOB_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")   # a job id, a name, a node id
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_ID = 2**32 - 2
_MAX_RESTART_WINDOW = 365 * 86400.0  # agent.restart_window's own upper bound


class CpuBind(str, enum.Enum):
    """Where a job's workers may run on a node's CPUs (gpus/alloc.py)."""
    NONE = "none"      # anywhere
    NUMA = "numa"      # on the CPUs of their GPUs' NUMA node


class SpecLimits(Protocol):
    """The bounds a spec is checked against (config.ControlSettings has them)."""
    max_field_bytes: int
    max_command_args: int
    max_env_entries: int
    max_nproc_per_node: int
    max_nodes: int
    max_restarts_limit: int
    max_restarts_per_window_limit: int
    max_spares: int


# -- the field checks a submission and a spec from etcd share ------------------------
def text(name: str, value: str, limits: SpecLimits) -> str:
    if len(value.encode("utf-8", "surrogatepass")) > limits.max_field_bytes:
        raise InvalidArgument(f"{name}: longer than {limits.max_field_bytes} bytes "
                              "(control.max_field_bytes)")
    if "\x00" in value:
        raise InvalidArgument(f"{name}: contains a NUL byte")
    return value


def count(name: str, value: int, lo: int, hi: int, setting: str) -> int:
    if not lo <= value <= hi:
        raise InvalidArgument(f"{name}: must be between {lo} and {hi}, got {value}"
                              + (f" ({setting})" if setting else ""))
    return value


def command(args: list, limits: SpecLimits) -> list:
    if not args or not args[0].strip():
        raise InvalidArgument("command: empty; give the program to run after `--`, e.g. "
                              "elasticctl submit -- python train.py")
    if len(args) > limits.max_command_args:
        raise InvalidArgument(f"command: {len(args)} arguments, at most "
                              f"{limits.max_command_args} (control.max_command_args)")
    for i, arg in enumerate(args):
        text(f"command[{i}]", arg, limits)
    return args


def cwd_path(cwd: str, limits: SpecLimits) -> str:
    cwd = text("cwd", cwd, limits)
    if not os.path.isabs(cwd):
        raise InvalidArgument(f"cwd: must be an absolute path, got {cwd[:200]!r}")
    return cwd


def environment(env, limits: SpecLimits) -> dict:
    if len(env) > limits.max_env_entries:
        raise InvalidArgument(f"env: {len(env)} variables, at most {limits.max_env_entries} "
                              "(control.max_env_entries)")
    out = {}
    for key, value in env.items():
        if not _ENV_NAME.match(key):
            raise InvalidArgument(f"env: {key[:80]!r} is not a valid variable name "
                                  "(letters, digits and '_', not starting with a digit)")
        out[key] = text(f"env[{key}]", value, limits)
    return out


def job_name(name: str) -> str:
    if name and not JOB_KEY.match(name):
        raise InvalidArgument(f"name: {name[:80]!r} is not a valid job name (letters, digits, "
                              "'.', '_', '-'; at most 63; starting with a letter or digit)")
    return name


def node_ids(nodes: tuple, limits: SpecLimits) -> tuple:
    if len(nodes) > limits.max_nodes:
        raise InvalidArgument(f"nodes: {len(nodes)} named, at most {limits.max_nodes}")
    for node in nodes:
        if not JOB_KEY.match(node):
            raise InvalidArgument(f"nodes: {node[:80]!r} is not a node id")
    return nodes


def spares(value: int, limits: SpecLimits) -> int:
    """Spare nodes a job keeps beside its max nodes (rendezvous/round.py stands them by)."""
    return count("spares", value, 0, limits.max_spares, "control.max_spares")


def gpus_per_node(value: int) -> int:
    """-1 (one per local rank where the node has GPUs), or 0..MAX_GPUS."""
    return count("gpus_per_node", value, -1, MAX_GPUS,
                 "-1 or unset: one per local rank on a node with GPUs")


def cpu_bind(value: str) -> CpuBind:
    try:
        return CpuBind(value)
    except ValueError:
        raise InvalidArgument(f"cpu_bind: must be one of {', '.join(b.value for b in CpuBind)}"
                              f", got {value[:40]!r}") from None


# -- the spec ---------------------------------------------------------------------
# Each field of the wire form and the JSON type it must have.
_WIRE_TYPES = {"id": str, "name": str, "command": list, "cwd": str, "env": dict, "uid": int,
               "gid": int, "user": str, "min_nodes": int, "max_nodes": int,
               "nproc_per_node": int, "max_restarts": int, "max_restarts_per_window": int,
               "restart_window": float, "nodes": list,
               "created_at": float, "submitted_on": str, "inprocess": bool,
               "gpus_per_node": int, "cpu_bind": str, "spares": int}


@dataclass(frozen=True)
class JobSpec:
    """What every node needs to run a cluster job: what, whose, how many, its budgets."""
    id: str
    command: tuple[str, ...]
    cwd: str
    uid: int
    gid: int
    user: str = ""
    name: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 3                 # over the job's life; -1: no lifetime limit
    max_restarts_per_window: int = -1     # within restart_window seconds; -1: none
    restart_window: float = 3600.0
    nodes: tuple[str, ...] = ()           # the nodes it may run on (empty: any)
    created_at: float = 0.0
    submitted_on: str = ""                # the node that took the submission
    inprocess: bool = False
    gpus_per_node: int = -1               # -1: one per local rank on a node with GPUs
    cpu_bind: CpuBind = CpuBind.NONE
    spares: int = 0                       # spare nodes kept beside max_nodes

    def __post_init__(self):
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @classmethod
    def of_record(cls, rec: JobRecord, nodes: tuple = ()) -> "JobSpec":
        """The spec of a job this node took (``nodes``: those it names, else the record's)."""
        return cls(id=rec.id, name=rec.name, command=tuple(rec.command), cwd=rec.cwd,
                   env=rec.env, uid=rec.uid, gid=rec.gid, user=rec.user,
                   min_nodes=rec.min_nodes, max_nodes=rec.max_nodes,
                   nproc_per_node=rec.nproc_per_node, max_restarts=rec.max_restarts,
                   max_restarts_per_window=rec.max_restarts_per_window,
                   restart_window=rec.restart_window, nodes=tuple(nodes or rec.nodes),
                   created_at=rec.created_at, submitted_on=rec.node_id,
                   inprocess=rec.inprocess, gpus_per_node=rec.gpus_per_node,
                   cpu_bind=CpuBind(rec.cpu_bind), spares=rec.spares)

    def record(self) -> JobRecord:
        """A local record for the job, adopted from the cluster."""
        return JobRecord(
            id=self.id, name=self.name, command=list(self.command), cwd=self.cwd,
            env=dict(self.env), uid=self.uid, gid=self.gid, user=self.user,
            min_nodes=self.min_nodes, max_nodes=self.max_nodes,
            nproc_per_node=self.nproc_per_node, max_restarts=self.max_restarts,
            max_restarts_per_window=self.max_restarts_per_window,
            restart_window=self.restart_window, created_at=self.created_at,
            node_id=self.submitted_on, inprocess=self.inprocess, nodes=list(self.nodes),
            gpus_per_node=self.gpus_per_node, cpu_bind=self.cpu_bind.value,
            spares=self.spares, reason="adopted from the cluster")

    def to_wire(self) -> dict:
        """The spec as JSON values, as trust/specs.py seals it: each field as it is."""
        return {"id": self.id, "name": self.name, "command": list(self.command),
                "cwd": self.cwd, "env": dict(self.env), "uid": self.uid, "gid": self.gid,
                "user": self.user, "min_nodes": self.min_nodes, "max_nodes": self.max_nodes,
                "nproc_per_node": self.nproc_per_node, "max_restarts": self.max_restarts,
                "max_restarts_per_window": self.max_restarts_per_window,
                "restart_window": self.restart_window, "nodes": list(self.nodes),
                "created_at": self.created_at, "submitted_on": self.submitted_on,
                "inprocess": self.inprocess, "gpus_per_node": self.gpus_per_node,
                "cpu_bind": self.cpu_bind.value, "spares": self.spares}

    @classmethod
    def from_wire(cls, doc: dict, limits: SpecLimits) -> "JobSpec":
        """A spec another daemon wrote to etcd (already verified and decrypted), checked
        with the same rules as a submission, plus the fields a submission does not carry
        (id, uid, gid, user, submitting node, time); InvalidArgument names a bad field."""
        for name, kind in _WIRE_TYPES.items():
            value = doc.get(name)
            ok = (type(value) in (int, float) if kind is float else type(value) is kind)
            if not ok:
                raise InvalidArgument(f"{name}: expected {kind.__name__}, got "
                                      f"{type(value).__name__}")
        if not all(isinstance(a, str) for a in doc["command"]) or \
                not all(isinstance(n, str) for n in doc["nodes"]) or \
                not all(isinstance(k, str) and isinstance(v, str)
                        for k, v in doc["env"].items()):
            raise InvalidArgument("command, nodes and env: must hold strings")
        job_id = doc["id"]
        if not JOB_KEY.match(job_id):
            raise InvalidArgument(f"id: {job_id[:80]!r} is not a job id (letters, digits, '.', "
                                  "'_', '-'; at most 63; starting with a letter or digit)")
        for name in ("uid", "gid"):
            if not 0 <= doc[name] <= _MAX_ID:
                raise InvalidArgument(f"{name}: {doc[name]} is not a valid id")
        user = text("user", doc["user"], limits)
        submitted_on = doc["submitted_on"]
        if not JOB_KEY.match(submitted_on):
            raise InvalidArgument(f"submitted_on: {submitted_on[:80]!r} is not a node id")
        created = float(doc["created_at"])
        if not 0 <= created < float("inf"):
            raise InvalidArgument(f"created_at: {created!r} is not a time")
        min_nodes = count("min_nodes", doc["min_nodes"], 1, limits.max_nodes,
                          "control.max_nodes")
        max_nodes = count("max_nodes", doc["max_nodes"], min_nodes, limits.max_nodes,
                          "control.max_nodes")
        # The restart budgets, as a submission gives them (-1: none of that kind; a job
        # needs at least one), and the window the second is counted over.
        max_restarts = count("max_restarts", doc["max_restarts"], -1,
                             limits.max_restarts_limit,
                             "control.max_restarts_limit; -1: no lifetime limit")
        per_window = count("max_restarts_per_window", doc["max_restarts_per_window"], -1,
                           limits.max_restarts_per_window_limit,
                           "control.max_restarts_per_window_limit; -1: no budget over a "
                           "window")
        if max_restarts < 0 and per_window < 0:
            raise InvalidArgument("max_restarts, max_restarts_per_window: the job has no "
                                  "restart budget at all")
        window = float(doc["restart_window"])
        if not 0 < window <= _MAX_RESTART_WINDOW:
            raise InvalidArgument(f"restart_window: {window!r} is not a number of seconds in "
                                  f"(0, {_MAX_RESTART_WINDOW:g}]")
        return cls(
            id=job_id, name=job_name(doc["name"]),
            command=tuple(command(list(doc["command"]), limits)),
            cwd=cwd_path(doc["cwd"], limits), env=environment(doc["env"], limits),
            uid=doc["uid"], gid=doc["gid"], user=user,
            min_nodes=min_nodes, max_nodes=max_nodes,
            nproc_per_node=count("nproc_per_node", doc["nproc_per_node"], 1,
                                 limits.max_nproc_per_node, "control.max_nproc_per_node"),
            max_restarts=max_restarts, max_restarts_per_window=per_window,
            restart_window=window, nodes=tuple(node_ids(tuple(doc["nodes"]), limits)),
            created_at=created, submitted_on=submitted_on, inprocess=doc["inprocess"],
            gpus_per_node=gpus_per_node(doc["gpus_per_node"]),
            cpu_bind=cpu_bind(doc["cpu_bind"]), spares=spares(doc["spares"], limits))
