"""Checking control requests before anything acts on them.

Pure functions: a request message and the limits in, a clean value out, or
``InvalidArgument`` naming the field and what would be accepted; and one
check that asks the system (``caller_can_enter``: can the caller enter the cwd).
A submission's fields go through the same checks as a job spec read from etcd
(jobs/spec.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ControlSettings
from ..errors import InvalidArgument
from ..jobs import spec as checks
from ..jobs.spec import JOB_KEY, CpuBind
from ..workers.group import can_enter, cwd_unusable


@dataclass(frozen=True)
class JobRequest:
    """A validated submission: what the caller asked for, before the node adds its own."""
    command: tuple
    cwd: str
    env: dict
    name: str = ""
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = -1
    max_restarts_per_window: int | None = None   # None: the daemon's default; -1: none
    nodes: tuple = ()
    inprocess: bool = False
    gpus_per_node: int = -1                      # -1: one per local rank on a GPU node
    cpu_bind: CpuBind = CpuBind.NONE
    spares: int | None = None                    # None: the cluster's default


def job_key(value: str) -> str:
    """A job id or name as given to GetJob/CancelJob/Logs..."""
    if not value:
        raise InvalidArgument("id: a job id or name is required")
    if not JOB_KEY.match(value):
        raise InvalidArgument(f"id: {value[:80]!r} is not a job id or name (letters, digits, "
                              "'.', '_', '-'; at most 63)")
    return value


def caller_can_enter(cwd: str, uid: int, gid: int, timeout: float) -> None:
    """The submitted cwd, checked as the caller: one message whether it is missing or
    only hidden from them, so a check run by root tells nobody what exists."""
    if not can_enter(cwd, uid, gid, timeout):
        raise InvalidArgument(f"cwd: {cwd_unusable(cwd, uid)} on this node")


def submit_request(req, limits: ControlSettings) -> JobRequest:
    command = checks.command(list(req.command), limits)

    cwd = checks.cwd_path(req.cwd, limits)

    env = checks.environment(req.env, limits)
    name = checks.job_name(req.name)

    min_nodes = checks.count("min_nodes", req.min_nodes or 1, 1, limits.max_nodes,
                             "control.max_nodes")
    max_nodes = checks.count("max_nodes", req.max_nodes or min_nodes, 1, limits.max_nodes,
                             "control.max_nodes")
    if max_nodes < min_nodes:
        raise InvalidArgument(f"max_nodes: {max_nodes} is below min_nodes {min_nodes}")
    nproc = checks.count("nproc_per_node", req.nproc_per_node or 1, 1,
                         limits.max_nproc_per_node, "control.max_nproc_per_node")
    max_restarts = checks.count("max_restarts", req.max_restarts, -1,
                                limits.max_restarts_limit,
                                "control.max_restarts_limit; -1 means the daemon's default")
    per_window = None
    if req.HasField("max_restarts_per_window"):
        per_window = checks.count("max_restarts_per_window", req.max_restarts_per_window,
                                  -1, limits.max_restarts_per_window_limit,
                                  "control.max_restarts_per_window_limit; -1 means no "
                                  "budget over a window")
    nodes = checks.node_ids(tuple(req.nodes), limits)
    if nodes and len(set(nodes)) < min_nodes:
        raise InvalidArgument(f"nodes: {len(set(nodes))} node(s) named but the job needs at "
                              f"least {min_nodes}")
    gpus = checks.gpus_per_node(req.gpus_per_node if req.HasField("gpus_per_node") else -1)
    spares = checks.spares(req.spares, limits) if req.HasField("spares") else None
    return JobRequest(command=tuple(command), cwd=cwd, env=env, name=name,
                      min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
                      max_restarts=max_restarts, max_restarts_per_window=per_window,
                      nodes=tuple(sorted(set(nodes))),
                      inprocess=bool(req.inprocess),
                      gpus_per_node=gpus, cpu_bind=checks.cpu_bind(req.cpu_bind or "none"),
                      spares=spares)
