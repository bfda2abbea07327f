"""Checking control requests before anything acts on them.

Pure functions: a request message and the limits in, a clean value out, or
``InvalidArgument`` naming the field and what would be accepted; and one
check that asks the system (``caller_can_enter``: can the caller enter the cwd).
"""
from __future__ import annotations

import os
import re

from ..config import ControlSettings
from ..errors import InvalidArgument
from ..gpus.alloc import CPU_BIND_MODES
from ..gpus.inventory import MAX_GPUS
from ..coordinator.coordinator import JobRequest
from ..workers.group import can_enter, cwd_unusable

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
_JOB_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


def _text(field: str, value: str, limits: ControlSettings) -> str:
    if len(value.encode("utf-8", "surrogatepass")) > limits.max_field_bytes:
        raise InvalidArgument(f"{field}: longer than {limits.max_field_bytes} bytes "
                              "(control.max_field_bytes)")
    if "\x00" in value:
        raise InvalidArgument(f"{field}: contains a NUL byte")
    return value


def _count(field: str, value: int, lo: int, hi: int, setting: str) -> int:
    if not lo <= value <= hi:
        raise InvalidArgument(f"{field}: must be between {lo} and {hi}, got {value}"
                              + (f" ({setting})" if setting else ""))
    return value


def job_key(value: str) -> str:
    """A job id or name as given to GetJob/CancelJob/Logs..."""
    if not value:
        raise InvalidArgument("id: a job id or name is required")
    if not _JOB_KEY.match(value):
        raise InvalidArgument(f"id: {value[:80]!r} is not a job id or name (letters, digits, "
                              "'.', '_', '-'; at most 63)")
    return value


def caller_can_enter(cwd: str, uid: int, gid: int, timeout: float) -> None:
    """The submitted cwd, checked as the caller: one message whether it is missing or
    only hidden from them, so a check run by root tells nobody what exists."""
    if not can_enter(cwd, uid, gid, timeout):
        raise InvalidArgument(f"cwd: {cwd_unusable(cwd, uid)} on this node")


def submit_request(req, limits: ControlSettings) -> JobRequest:
    command = _command(list(req.command), limits)

    cwd = _cwd_path(req.cwd, limits)

    env = _env(req.env, limits)
    name = _name(req.name)

    min_nodes = _count("min_nodes", req.min_nodes or 1, 1, limits.max_nodes, "control.max_nodes")
    max_nodes = _count("max_nodes", req.max_nodes or min_nodes, 1, limits.max_nodes,
                       "control.max_nodes")
    if max_nodes < min_nodes:
        raise InvalidArgument(f"max_nodes: {max_nodes} is below min_nodes {min_nodes}")
    nproc = _count("nproc_per_node", req.nproc_per_node or 1, 1, limits.max_nproc_per_node,
                   "control.max_nproc_per_node")
    max_restarts = _count("max_restarts", req.max_restarts, -1, limits.max_restarts_limit,
                          "control.max_restarts_limit; -1 means the daemon's default")
    per_window = None
    if req.HasField("max_restarts_per_window"):
        per_window = _count("max_restarts_per_window", req.max_restarts_per_window, -1,
                            limits.max_restarts_per_window_limit,
                            "control.max_restarts_per_window_limit; -1 means no budget over "
                            "a window")
    nodes = _nodes(tuple(req.nodes), limits)
    if nodes and len(set(nodes)) < min_nodes:
        raise InvalidArgument(f"nodes: {len(set(nodes))} node(s) named but the job needs at "
                              f"least {min_nodes}")
    gpus = _gpus_per_node(req.gpus_per_node if req.HasField("gpus_per_node") else -1)
    return JobRequest(command=tuple(command), cwd=cwd, env=env, name=name,
                      min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
                      max_restarts=max_restarts, max_restarts_per_window=per_window,
                      nodes=tuple(sorted(set(nodes))),
                      inprocess=bool(req.inprocess),
                      gpus_per_node=gpus, cpu_bind=_cpu_bind(req.cpu_bind or "none"))


# -- the pieces a submission and a cluster spec share ------------------------------
def _command(command: list, limits: ControlSettings) -> list:
    if not command or not command[0].strip():
        raise InvalidArgument("command: empty; give the program to run after `--`, e.g. "
                              "elasticctl submit -- python train.py")
    if len(command) > limits.max_command_args:
        raise InvalidArgument(f"command: {len(command)} arguments, at most "
                              f"{limits.max_command_args} (control.max_command_args)")
    for i, arg in enumerate(command):
        _text(f"command[{i}]", arg, limits)
    return command


def _cwd_path(cwd: str, limits: ControlSettings) -> str:
    cwd = _text("cwd", cwd, limits)
    if not os.path.isabs(cwd):
        raise InvalidArgument(f"cwd: must be an absolute path, got {cwd[:200]!r}")
    return cwd


def _env(env, limits: ControlSettings) -> dict:
    if len(env) > limits.max_env_entries:
        raise InvalidArgument(f"env: {len(env)} variables, at most {limits.max_env_entries} "
                              "(control.max_env_entries)")
    out = {}
    for key, value in env.items():
        if not _ENV_NAME.match(key):
            raise InvalidArgument(f"env: {key[:80]!r} is not a valid variable name "
                                  "(letters, digits and '_', not starting with a digit)")
        out[key] = _text(f"env[{key}]", value, limits)
    return out


def _name(name: str) -> str:
    if name and not _JOB_NAME.match(name):
        raise InvalidArgument(f"name: {name[:80]!r} is not a valid job name (letters, digits, "
                              "'.', '_', '-'; at most 63; starting with a letter or digit)")
    return name


def _nodes(nodes: tuple, limits: ControlSettings) -> tuple:
    if len(nodes) > limits.max_nodes:
        raise InvalidArgument(f"nodes: {len(nodes)} named, at most {limits.max_nodes}")
    for node in nodes:
        if not _JOB_KEY.match(node):
            raise InvalidArgument(f"nodes: {node[:80]!r} is not a node id")
    return nodes


def _gpus_per_node(value: int) -> int:
    """-1 (one per local rank where the node has GPUs), or 0..MAX_GPUS."""
    return _count("gpus_per_node", value, -1, MAX_GPUS,
                  "-1 or unset: one per local rank on a node with GPUs")


def _cpu_bind(value: str) -> str:
    if value not in CPU_BIND_MODES:
        raise InvalidArgument(f"cpu_bind: must be one of {', '.join(CPU_BIND_MODES)}, got "
                              f"{value[:40]!r}")
    return value


# -- a job spec read from etcd (trust/specs.py) --------------------------------------
_SPEC_TYPES = {"id": str, "name": str, "command": list, "cwd": str, "env": dict, "uid": int,
               "gid": int, "user": str, "min_nodes": int, "max_nodes": int,
               "nproc_per_node": int, "max_restarts": int, "max_restarts_per_window": int,
               "restart_window": float, "nodes": list,
               "created_at": float, "submitted_on": str, "inprocess": bool,
               "gpus_per_node": int, "cpu_bind": str}
_MAX_ID = 2**32 - 2
_MAX_RESTART_WINDOW = 365 * 86400.0  # agent.restart_window's own upper bound


def cluster_spec(spec: dict, limits: ControlSettings) -> dict:
    """A job spec another daemon wrote to etcd (already verified and decrypted), checked
    with the same rules as a submission, plus the fields a submission does not carry
    (id, uid, gid, user, submitting node, time). Returns it as the record's fields."""
    for field, kind in _SPEC_TYPES.items():
        value = spec.get(field)
        ok = (type(value) in (int, float) if kind is float else type(value) is kind)
        if not ok:
            raise InvalidArgument(f"{field}: expected {kind.__name__}, got "
                                  f"{type(value).__name__}")
    if not all(isinstance(a, str) for a in spec["command"]) or \
            not all(isinstance(n, str) for n in spec["nodes"]) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in spec["env"].items()):
        raise InvalidArgument("command, nodes and env: must hold strings")
    job_id = spec["id"]
    if not _JOB_KEY.match(job_id):
        raise InvalidArgument(f"id: {job_id[:80]!r} is not a job id (letters, digits, '.', "
                              "'_', '-'; at most 63; starting with a letter or digit)")
    for field in ("uid", "gid"):
        if not 0 <= spec[field] <= _MAX_ID:
            raise InvalidArgument(f"{field}: {spec[field]} is not a valid id")
    user = _text("user", spec["user"], limits)
    submitted_on = spec["submitted_on"]
    if not _JOB_KEY.match(submitted_on):
        raise InvalidArgument(f"submitted_on: {submitted_on[:80]!r} is not a node id")
    created = float(spec["created_at"])
    if not 0 <= created < float("inf"):
        raise InvalidArgument(f"created_at: {created!r} is not a time")
    min_nodes = _count("min_nodes", spec["min_nodes"], 1, limits.max_nodes, "control.max_nodes")
    max_nodes = _count("max_nodes", spec["max_nodes"], min_nodes, limits.max_nodes,
                       "control.max_nodes")
    # The restart budgets, as a submission gives them (-1: none of that kind; a job
    # needs at least one), and the window the second is counted over.
    max_restarts = _count("max_restarts", spec["max_restarts"], -1, limits.max_restarts_limit,
                          "control.max_restarts_limit; -1: no lifetime limit")
    per_window = _count("max_restarts_per_window", spec["max_restarts_per_window"], -1,
                        limits.max_restarts_per_window_limit,
                        "control.max_restarts_per_window_limit; -1: no budget over a window")
    if max_restarts < 0 and per_window < 0:
        raise InvalidArgument("max_restarts, max_restarts_per_window: the job has no restart "
                              "budget at all")
    window = float(spec["restart_window"])
    if not 0 < window <= _MAX_RESTART_WINDOW:
        raise InvalidArgument(f"restart_window: {window!r} is not a number of seconds in "
                              f"(0, {_MAX_RESTART_WINDOW:g}]")
    return {"id": job_id, "name": _name(spec["name"]),
            "command": _command(list(spec["command"]), limits),
            "cwd": _cwd_path(spec["cwd"], limits), "env": _env(spec["env"], limits),
            "uid": spec["uid"], "gid": spec["gid"], "user": user,
            "min_nodes": min_nodes, "max_nodes": max_nodes,
            "nproc_per_node": _count("nproc_per_node", spec["nproc_per_node"], 1,
                                     limits.max_nproc_per_node, "control.max_nproc_per_node"),
            "max_restarts": max_restarts, "max_restarts_per_window": per_window,
            "restart_window": window,
            "nodes": list(_nodes(tuple(spec["nodes"]), limits)), "created_at": created,
            "submitted_on": submitted_on, "inprocess": spec["inprocess"],
            "gpus_per_node": _gpus_per_node(spec["gpus_per_node"]),
            "cpu_bind": _cpu_bind(spec["cpu_bind"])}
