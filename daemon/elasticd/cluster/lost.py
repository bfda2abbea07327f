"""A lost node's row, ``/v1/lost/<node>``: written by a loss witness (cluster/witness.py)
when the node's key goes, listed by every daemon for `elasticctl nodes`
(membership.NodeWatcher ``snapshot``), deleted by the node itself when it registers
again (membership.LeaseKeeper) and by a witness once older than
``membership.lost_node_retention``.

The row is built here and serialised here (``LostNode.seal``); it is read in one place
(``open_lost``), sealed with the cluster key and bound to its key like every record: a
row that does not verify or check is refused (trust/refusals.py) and lists nothing.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..fields import is_ident
from ..trust.sealed import Kind, Reason, Refused
from .node_record import node_fields, node_key

LOST = "/v1/lost"


def lost_key(node_id: str) -> str:
    return f"{LOST}/{node_id}"


@dataclass(frozen=True)
class LostNode:
    """A node whose key went: when a witness saw it go, the node's record as that
    witness last read it (``{"node_id": id}`` when it had read none), and the witness."""
    node_id: str
    lost_at: float        # the witness's clock (time.time())
    record: dict
    witness: str

    def seal(self, records) -> str:
        body = {"node_id": self.node_id, "lost_at": self.lost_at, "record": self.record,
                "witness": self.witness}
        return records.seal(Kind.LOST, lost_key(self.node_id), json.dumps(body))


def open_lost(records, key: str, value) -> LostNode:
    """The lost row stored at ``key``; Refused if it is not one this cluster wrote."""
    doc = records.open(Kind.LOST, key, value).doc
    node = key[len(LOST) + 1:]
    if not key.startswith(LOST + "/") or not is_ident(node):
        raise Refused(Reason.BAD_KEY, "not a lost node's key")
    try:
        if not isinstance(doc, dict) or doc.get("node_id") != node:
            raise ValueError("names another node than its key")
        lost_at, record, witness = doc.get("lost_at"), doc.get("record"), doc.get("witness")
        if isinstance(lost_at, bool) or not isinstance(lost_at, (int, float)) \
                or not math.isfinite(lost_at) or lost_at < 0:
            raise ValueError("lost_at: not a time")
        if not is_ident(witness):
            raise ValueError("witness: not a node id")
        if not isinstance(record, dict):
            raise ValueError("record: not a node record")
        node_fields(node_key(node), record)
    except ValueError as exc:
        raise Refused(Reason.INVALID, str(exc)) from None
    return LostNode(node, float(lost_at), record, witness)
