"""Checking control requests before anything acts on them.

Pure functions: a request message and the limits in, a clean value out, or
``InvalidArgument`` naming the field and what would be accepted.
"""
from __future__ import annotations

import os
import re

from .config import ControlSettings
from .errors import InvalidArgument
from .manager import JobRequest

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


def submit_request(req, limits: ControlSettings) -> JobRequest:
    command = list(req.command)
    if not command or not command[0].strip():
        raise InvalidArgument("command: empty; give the program to run after `--`, e.g. "
                              "elasticctl submit -- python train.py")
    if len(command) > limits.max_command_args:
        raise InvalidArgument(f"command: {len(command)} arguments, at most "
                              f"{limits.max_command_args} (control.max_command_args)")
    for i, arg in enumerate(command):
        _text(f"command[{i}]", arg, limits)

    cwd = _text("cwd", req.cwd, limits)
    if not os.path.isabs(cwd):
        raise InvalidArgument(f"cwd: must be an absolute path, got {cwd[:200]!r}")
    if not os.path.isdir(cwd):
        raise InvalidArgument(f"cwd: directory {cwd[:200]} does not exist on this node")

    if len(req.env) > limits.max_env_entries:
        raise InvalidArgument(f"env: {len(req.env)} variables, at most {limits.max_env_entries} "
                              "(control.max_env_entries)")
    env = {}
    for key, value in req.env.items():
        if not _ENV_NAME.match(key):
            raise InvalidArgument(f"env: {key[:80]!r} is not a valid variable name "
                                  "(letters, digits and '_', not starting with a digit)")
        env[key] = _text(f"env[{key}]", value, limits)

    name = req.name
    if name and not _JOB_NAME.match(name):
        raise InvalidArgument(f"name: {name[:80]!r} is not a valid job name (letters, digits, "
                              "'.', '_', '-'; at most 63; starting with a letter or digit)")

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
    nodes = tuple(req.nodes)
    if len(nodes) > limits.max_nodes:
        raise InvalidArgument(f"nodes: {len(nodes)} named, at most {limits.max_nodes}")
    for node in nodes:
        if not _JOB_KEY.match(node):
            raise InvalidArgument(f"nodes: {node[:80]!r} is not a node id")
    if nodes and len(set(nodes)) < min_nodes:
        raise InvalidArgument(f"nodes: {len(set(nodes))} node(s) named but the job needs at "
                              f"least {min_nodes}")
    return JobRequest(command=tuple(command), cwd=cwd, env=env, name=name,
                      min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
                      max_restarts=max_restarts, max_restarts_per_window=per_window,
                      nodes=tuple(sorted(set(nodes))),
                      inprocess=bool(req.inprocess))
