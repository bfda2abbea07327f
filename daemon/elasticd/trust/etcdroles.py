"""``elasticd etcd-roles``: the etcd RBAC that keeps the daemons' keys theirs.

Two roles, each read-write on one prefix and nothing else:

* ``elasticd-daemon``   the daemons' prefix (``etcd.prefix``, default ``/elasticd/``):
                         job specs, rounds, nodes, events. Give it to the user the
                         daemons log in as (``etcd.username``).
* ``elasticd-torchrun`` the torchrun adapter's prefix (default ``/elasticd-torchrun/``),
                         for the users who run ``torchrun --rdzv-backend elasticd``.

Both grants are on the prefix *with* its trailing slash: ``/elasticd`` alone would
also cover ``/elasticd-torchrun``. ``plan`` is the list of steps (pure);
``commands`` prints them as etcdctl lines; ``apply`` makes them through etcd's v3
gateway as an etcd user allowed to change RBAC (root), and is safe to run again.
"""
from __future__ import annotations

import base64
import shlex
from dataclasses import dataclass

from ..store import StoreError

DAEMON_ROLE = "elasticd-daemon"
TORCHRUN_ROLE = "elasticd-torchrun"
TORCHRUN_PREFIX = "/elasticd-torchrun"


@dataclass(frozen=True)
class Grant:
    role: str
    prefix: str          # with its trailing slash


@dataclass(frozen=True)
class UserRole:
    user: str
    role: str


def plan(daemon_prefix: str, torchrun_prefix: str = TORCHRUN_PREFIX, daemon_user: str = "",
         torchrun_user: str = "") -> list:
    grants = [Grant(DAEMON_ROLE, daemon_prefix.rstrip("/") + "/"),
              Grant(TORCHRUN_ROLE, torchrun_prefix.rstrip("/") + "/")]
    if grants[0].prefix.startswith(grants[1].prefix) or \
            grants[1].prefix.startswith(grants[0].prefix):
        raise ValueError(f"the daemons' prefix {daemon_prefix} and torchrun's "
                         f"{torchrun_prefix} overlap: give them separate prefixes")
    users = [UserRole(u, r) for u, r in ((daemon_user, DAEMON_ROLE),
                                         (torchrun_user, TORCHRUN_ROLE)) if u]
    return [*grants, *users]


def commands(steps: list) -> list[str]:
    out = []
    for s in steps:
        if isinstance(s, Grant):
            out += [f"etcdctl role add {s.role}",
                    f"etcdctl role grant-permission {s.role} --prefix=true readwrite "
                    f"{shlex.quote(s.prefix)}"]
        else:
            out.append(f"etcdctl user grant-role {shlex.quote(s.user)} {s.role}")
    return out


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _range_end(prefix: str) -> str:
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


def apply(store, steps: list) -> list[str]:
    """Make ``steps`` on the etcd behind ``store`` (an Etcd3Store logged in as a user
    allowed to change RBAC); what it did, a line each. Existing roles are kept."""
    done = []
    for s in steps:
        if isinstance(s, Grant):
            try:
                store.call("/auth/role/add", {"name": s.role})
                done.append(f"added role {s.role}")
            except StoreError as exc:
                if "already exists" not in str(exc):
                    raise
            store.call("/auth/role/grant", {"name": s.role, "perm": {
                "permType": "READWRITE", "key": _b64(s.prefix), "range_end": _range_end(s.prefix)}})
            done.append(f"role {s.role}: readwrite on {s.prefix}*")
        else:
            store.call("/auth/user/grant", {"user": s.user, "role": s.role})
            done.append(f"user {s.user}: role {s.role}")
    return done
