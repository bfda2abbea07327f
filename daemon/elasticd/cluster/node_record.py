"""A node record, ``/v1/nodes/<node-id>``: its key and the one check of its fields.

Written by membership.LeaseKeeper, read by membership.NodeWatcher and kept inside a
lost node's row (cluster/lost.py); every reader opens it here (``open_node``), sealed
with the cluster key and bound to its key (trust/sealed.py).
"""
from __future__ import annotations

from ..trust.sealed import Kind, Opened, Reason, Refused
from ..fields import is_ident

NODES = "/v1/nodes"


def node_key(node_id: str) -> str:
    return f"{NODES}/{node_id}"


# Fields of a node record and the types every reader may rely on.
_INT32_MAX = 2**31 - 1
_MAX_JOBS = 100_000
_RECORD_FIELDS = {"slots": int, "slots_free": int, "pid": int, "started_at": (int, float),
                  "lease_ttl": (int, float),
                  "host": str, "address": str, "version": str,
                  "gpus": int, "gpus_free": int, "gpu_source": str, "gpu_health": str,
                  "suspect": str, "replication_port": int}


def node_fields(key: str, data: dict) -> dict:
    """The node record stored at ``key``, in a decoded value; ValueError says what is
    wrong with it."""
    if not is_ident(data.get("node_id")) or data["node_id"] != key.rsplit("/", 1)[-1]:
        raise ValueError("the record names another node than its key")
    # Every field a reader uses must have the type it expects (a record with
    # "jobs": 7 or slots beyond int32 once made `elasticctl nodes` fail).
    for name, kinds in _RECORD_FIELDS.items():
        got = data.get(name)
        if got is not None and (isinstance(got, bool) or not isinstance(got, kinds)):
            raise ValueError(f"{name}: of the wrong type")
    for name in ("slots", "slots_free", "gpus", "gpus_free"):
        if not 0 <= data.get(name, 0) <= _INT32_MAX:
            raise ValueError(f"{name}: out of range")
    if not 0 <= data.get("replication_port", 0) <= 65535:
        raise ValueError("replication_port: not a port")
    for name in ("gpu_source", "gpu_health", "suspect", "host", "address", "version"):
        if len(data.get(name, "")) > 500:
            raise ValueError(f"{name}: too long")
    jobs = data.get("jobs", [])
    if not isinstance(jobs, list) or len(jobs) > _MAX_JOBS \
            or not all(isinstance(j, str) and len(j) <= 253 for j in jobs):
        raise ValueError("jobs: not a list of job ids")
    return data


def open_node(records, key: str, value: str | None) -> tuple[dict, int]:
    """(the record, its writer's count) at ``key``; Refused if it is not one."""
    opened: Opened = records.open(Kind.NODE, key, value)
    try:
        return node_fields(key, opened.doc), opened.seq
    except ValueError as exc:
        raise Refused(Reason.INVALID, str(exc)) from None


def parse_node(key: str, value: str | None, records) -> dict | None:
    """A node record from the store, or None if it is not one we can vouch for."""
    try:
        return open_node(records, key, value)[0]
    except Refused:
        return None
