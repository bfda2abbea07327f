"""The rules between settings, checked once every field is in its bounds.

``check_relations`` appends one sentence per broken rule, each naming the
field to change (``section.field: ...``), for ``load`` to report all at once.
"""
from __future__ import annotations

import os

from ..workers.inprocess_settings import problems as inprocess_problems
from .model import Config


def check_relations(cfg: Config, errors: list[str]) -> None:
    a = cfg.agent
    if a.restart_backoff_initial > a.restart_backoff_max:
        errors.append("agent.restart_backoff_initial: must not exceed agent.restart_backoff_max "
                      f"({a.restart_backoff_initial} > {a.restart_backoff_max})")
    if a.default_max_restarts < 0 and a.default_max_restarts_per_window < 0:
        errors.append("agent.default_max_restarts: a job needs a restart budget: set it, or "
                      "agent.default_max_restarts_per_window (both are -1)")
    if a.hang_soft_timeout >= a.hang_hard_timeout:
        errors.append("agent.hang_soft_timeout: must be below agent.hang_hard_timeout "
                      f"({a.hang_soft_timeout} >= {a.hang_hard_timeout})")
    if a.first_step_timeout < a.hang_hard_timeout:
        errors.append("agent.first_step_timeout: must be at least agent.hang_hard_timeout "
                      f"({a.first_step_timeout} < {a.hang_hard_timeout})")
    if a.phase_stale_after <= 2 * a.phase_publish_interval:
        errors.append("agent.phase_stale_after: must exceed twice agent.phase_publish_interval "
                      f"({a.phase_stale_after} <= 2 x {a.phase_publish_interval})")
    if a.phase_refresh_interval < a.phase_publish_interval:
        errors.append("agent.phase_refresh_interval: must be at least "
                      f"agent.phase_publish_interval ({a.phase_refresh_interval} < "
                      f"{a.phase_publish_interval})")
    if a.phase_stale_after <= 2 * a.phase_refresh_interval \
            and not any(e.startswith("agent.phase_stale_after:") for e in errors):
        # An unchanged record is written once per refresh: one lost, the next in time.
        errors.append("agent.phase_stale_after: must exceed twice agent.phase_refresh_interval "
                      f"({a.phase_stale_after} <= 2 x {a.phase_refresh_interval})")
    if a.hang_detection and a.phase_stale_after >= a.hang_learn_floor:
        # A peer's checkpoint that began just after its last record must be seen, or the
        # record counted stale (fixed bounds), before a learned timeout can end the wait.
        errors.append("agent.phase_stale_after: must be below agent.hang_learn_floor "
                      f"({a.phase_stale_after} >= {a.hang_learn_floor})")
    i = cfg.inprocess
    for problem in inprocess_problems(i):   # the wrapper's own rules, worded once
        where = f"inprocess.{problem.field}:"
        if not any(e.startswith(where) for e in errors):  # a bound already said it
            errors.append(f"{where} {problem.message}")
    if a.hang_detection and a.hang_hard_timeout >= i.barrier_timeout:
        errors.append("inprocess.barrier_timeout: must exceed agent.hang_hard_timeout "
                      f"({i.barrier_timeout} <= {a.hang_hard_timeout}), or the healthy ranks "
                      "give up on a hung rank before elasticd kills and replaces it")
    from ..workers.template_key import KEY_ENV_ENTRY
    bad = [v for v in a.template_key_env if not KEY_ENV_ENTRY.match(v)]
    if bad:
        errors.append(f"agent.template_key_env: {bad[0][:80]!r} is not a variable name or "
                      "a prefix ending in '*' (letters, digits, '_')")
    if a.template_idle_per_user > a.template_idle_max:
        errors.append("agent.template_idle_per_user: must not exceed agent.template_idle_max "
                      f"({a.template_idle_per_user} > {a.template_idle_max})")
    lim = cfg.limits
    if lim.spec_bytes_per_user > lim.spec_bytes_total:
        errors.append(f"limits.spec_bytes_per_user: must not exceed limits.spec_bytes_total "
                      f"({lim.spec_bytes_per_user} > {lim.spec_bytes_total})")
    if lim.calls_per_user >= cfg.control.rpc_threads:
        errors.append(f"limits.calls_per_user: must be below control.rpc_threads "
                      f"({lim.calls_per_user} >= {cfg.control.rpc_threads}), or one uid's "
                      "calls could hold every thread short calls have")
    if lim.streams_per_user > lim.streams_total:
        errors.append(f"limits.streams_per_user: must not exceed limits.streams_total "
                      f"({lim.streams_per_user} > {lim.streams_total})")
    if not cfg.metrics.address.strip():
        errors.append("metrics.address: must be an address to listen on, e.g. 0.0.0.0 or "
                      "127.0.0.1")
    d = cfg.daemon
    if d.node_id and (len(d.node_id) > 128 or not all(c.isalnum() or c in "-_." for c in d.node_id)):
        errors.append(f"daemon.node_id: use letters, digits, '-', '_' or '.', at most 128 "
                      f"characters, got {d.node_id!r}")
    if not os.path.isabs(d.socket):
        errors.append(f"daemon.socket: must be an absolute path, got {d.socket!r}")
    elif len(d.socket.encode()) + len(".cred") > 107:
        errors.append(f"daemon.socket: path too long for a unix socket ({len(d.socket)} bytes)")
    from ..gpus.inventory import InventoryError, parse_setting
    try:
        parse_setting(d.gpus)
    except InventoryError as exc:
        errors.append(f"daemon.gpus: {exc}")
    if d.fake_gpus_file and not os.path.isabs(d.fake_gpus_file):
        errors.append(f"daemon.fake_gpus_file: must be an absolute path, got "
                      f"{d.fake_gpus_file!r}")
    if d.gpu_health_command:
        import shlex
        try:
            if not shlex.split(d.gpu_health_command):
                raise ValueError("empty")
        except ValueError as exc:
            errors.append(f"daemon.gpu_health_command: not a command line ({exc})")
    if not os.path.isabs(d.state_dir):
        errors.append(f"daemon.state_dir: must be an absolute path, got {d.state_dir!r}")
    if not cfg.etcd.prefix.startswith("/") or cfg.etcd.prefix.endswith("/") and cfg.etcd.prefix != "/":
        errors.append(f"etcd.prefix: must start with '/' and not end with one, got {cfg.etcd.prefix!r}")
    m = cfg.membership
    if not d.standalone and m.refresh_interval + cfg.etcd.request_timeout > m.lease_ttl:
        errors.append(f"membership.refresh_interval: plus etcd.request_timeout must fit in "
                      f"membership.lease_ttl ({m.refresh_interval} + "
                      f"{cfg.etcd.request_timeout} > {m.lease_ttl}), or a slow refresh "
                      "loses the lease")
    for name in ("ca_cert", "cert", "key", "password_file"):
        path = getattr(cfg.etcd, name)
        if path and not os.path.isfile(path):
            errors.append(f"etcd.{name}: file {path} does not exist")
    if bool(cfg.etcd.cert) != bool(cfg.etcd.key):
        errors.append("etcd.cert: etcd.cert and etcd.key go together")
    bad = [u for u in cfg.cluster.allowed_uids if not (u.isdigit() and int(u) < 2**32 - 1)]
    if bad:
        errors.append(f"cluster.allowed_uids: must be uids (numbers), got {bad!r}")
    if not os.path.isabs(cfg.cluster.key_file):
        errors.append(f"cluster.key_file: must be an absolute path, got {cfg.cluster.key_file!r}")
    snap = cfg.snapshot
    if not os.path.isabs(snap.root) or os.path.normpath(snap.root) in ("/", "//"):
        errors.append(f"snapshot.root: must be an absolute path below /, got {snap.root!r}")
    if snap.job_budget and snap.node_budget and snap.job_budget > snap.node_budget:
        errors.append(f"snapshot.job_budget: must not exceed snapshot.node_budget "
                      f"({snap.job_budget} > {snap.node_budget})")
    if not d.standalone and not cfg.etcd.endpoints:
        errors.append("etcd.endpoints: at least one URL is needed unless daemon.standalone is set")
