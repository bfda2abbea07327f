"""What `elasticctl nodes` is told: every live and lost node; for this node also its
problems, its devices and the idle worker templates the caller may see."""
from __future__ import annotations

import time

from .. import statedir
from .auth import Caller
from .messages import gpus_to_proto, node_to_proto
from ..store import StoreError
from ..workers import hostname
from ..v1 import control_pb2 as pb


def answer(cfg, cluster, manager, caller: Caller, endpoint=None,
           spare_for: dict | None = None) -> pb.ListNodesResponse:
    """The ListNodes answer from ``cluster`` (cluster/node.Cluster), ``manager``
    (node/coordinator.Coordinator), the metrics ``endpoint``
    (exposition/endpoint.MetricsEndpoint, or None) and ``spare_for`` ({node: the
    jobs it stands by for as a spare}: control/remote_jobs.spare_roles)."""
    spare_for = spare_for or {}
    view = cluster.watcher.snapshot()
    try:
        drains = cluster.drain_states()
    except StoreError:
        drains = {}
    me = cfg.daemon.node_id
    live = dict(view.live)
    if me not in live:  # not (yet) registered: still say who we are
        live[me] = cluster.record()
    nodes = []
    for node_id, rec in sorted(live.items()):
        # Our own refresh we timed; a peer's lease is alive, so its last
        # refresh was within its TTL (-1: "less than lease_ttl_seconds").
        age = (time.time() - cluster.keeper.last_refresh
               if node_id == me and cluster.keeper.last_refresh else -1.0)
        msg = node_to_proto(rec, _state(drains.get(node_id)), age)
        msg.quarantine.extend(drains.get(node_id, {}).get("reasons", ()))
        msg.spare_for.extend(spare_for.get(node_id, ())[:1000])
        if node_id == me:
            msg.problems.extend(problems(cfg, manager, endpoint))
            gpus_to_proto(msg, manager.gpus.inventory, manager.gpu_holders())
            msg.gpus_free = manager.gpus_free()  # now, not at the last refresh
            msg.idle_templates.extend(  # another user's only to root
                pb.IdleTemplate(uid=t.uid, pid=t.pid, key=t.key, idle_seconds=t.idle_seconds,
                                rss_bytes=t.rss_bytes, origin=t.origin, state=t.state)
                for t in manager.templates.idle() if caller.may_act_on(t.uid))
        nodes.append(msg)
    for node_id, (lost_at, rec) in sorted(view.lost.items()):
        if node_id not in live:
            msg = node_to_proto(rec, "lost", time.time() - lost_at)
            msg.lost_at = lost_at
            msg.quarantine.extend(drains.get(node_id, {}).get("reasons", ()))
            nodes.append(msg)
    return pb.ListNodesResponse(nodes=nodes, store=cluster.kind, store_health=cluster.health())


def _state(drain: dict | None) -> str:
    """ready, draining, or quarantined (a drain mark with reasons: cluster/quarantine.py)."""
    if drain is None:
        return "ready"
    return "quarantined" if drain.get("reasons") else "draining"


def problems(cfg, manager, endpoint=None) -> list[str]:
    """What is wrong on this node, one line each."""
    try:
        space = statedir.disk_space(cfg.daemon.state_dir, cfg.limits.state_min_free_bytes)
    except OSError as exc:
        return [f"state dir {cfg.daemon.state_dir}: {exc}"]
    suspect = manager.suspect_reason()
    return [p for p in (space.problem(cfg.daemon.state_dir),
                        endpoint.problem() if endpoint is not None else "",
                        hostname.cached_problem(),
                        manager.gpu_problem(),
                        f"suspect, preferred last for cluster jobs: {suspect}" if suspect
                        else "") if p]
