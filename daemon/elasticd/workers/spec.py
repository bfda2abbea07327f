"""``GroupSpec``: everything needed to start one job's workers on this node for one
attempt (built by the agent, read by the worker group, the template and the spares)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .round_place import RoundPlace
from .snapshot_dirs import SnapshotGrant


@dataclass(frozen=True)
class GroupSpec:
    """Everything needed to start one job's workers on this node for one attempt."""
    job_id: str
    command: tuple
    cwd: str
    env: dict
    uid: int
    gid: int
    nproc: int
    restart_count: int
    max_restarts: int
    place: RoundPlace       # this node's place in the round (the rendezvous's, as it is)
    log_dir: str
    run_dir: str
    node_id: str = ""
    extra_env: dict = field(default_factory=dict)
    # The job's devices on this node (gpu_alloc.Binding.env) and the CPUs its
    # workers are bound to (() : not bound).
    device_env: dict = field(default_factory=dict)
    cpus: tuple = ()
    # The job's snapshot dir here and its ranks' budget (workers/snapshot_dirs.py);
    # None: no snapshots (what the node starts ahead of any job: template_ahead.py).
    snapshot: SnapshotGrant | None = None
