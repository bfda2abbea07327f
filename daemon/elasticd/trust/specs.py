"""Job specs in etcd: sealed by the submitting daemon, opened by the others.

Anyone who can write etcd could otherwise make every daemon run anything as
anyone, and anyone who can read it would see every job's environment. So,
as Slurm does with MUNGE credentials, the daemon that accepted a submission
(and learned the user from the kernel) vouches for the spec with the
cluster key (trust/clusterkey.py):

* ``seal``: of the job's ``JobSpec`` (its wire form, ``JobSpec.to_wire``),
  the command and environment (where tokens and passwords live) are encrypted with AES-256-GCM, the job id bound in as associated
  data; then an HMAC-SHA256 is taken over a canonical encoding of every
  field (a fixed tuple, versioned and labelled: ``FORMAT`` and
  ``_MAC_LABEL``), the ciphertext included. What is stored::

      {"format": "elasticd-spec/1", "id", "name", "cwd", "uid", "gid", "user",
       "min_nodes", "max_nodes", "nproc_per_node", "max_restarts", "nodes",
       "created_at", "submitted_on", "inprocess", "gpus_per_node", "cpu_bind", "spares",
       "sealed": b64(nonce|ct), "mac": hex}

* ``open``: the other way round, refusing with a typed ``Rejection`` (a
  bounded ``RejectReason``) anything that is not exactly that: unknown or
  missing fields (but ``spares``, which a spec sealed before it existed
  lacks and its MAC does not cover: read as 0), a MAC that does not match (any field changed), a spec
  stored under another job's key (replay), a ciphertext that does not open,
  then the same checks as a local submission (``JobSpec.from_wire``,
  jobs/spec.py), which makes the typed ``JobSpec`` every other module reads.

``ClusterPolicy.refusal`` decides, without I/O, whether this node runs a
verified job's uid (no root jobs from the cluster by default). Nothing here
logs or counts: the dispatcher reports each rejection once.
"""
from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
import time
from dataclasses import dataclass
from hashlib import sha256

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from . import clusterkey
from .clusterkey import DerivedKeys
from ..errors import InvalidArgument
from .rejections import RejectReason, Rejection, SpecRejected
from .sealed import SealedRecords
from .seqmark import SeqMark
from ..values import BadValue, decode
from ..jobs.spec import JobSpec

FORMAT = "elasticd-spec/1"
_MAC_LABEL = b"elasticd/v1 job-spec mac\x00"
_AAD_LABEL = b"elasticd/v1 job-spec secret\x00"
_NONCE = 12
# Stored in clear (signed); "sealed" holds the rest.
CLEAR_FIELDS = ("id", "name", "cwd", "uid", "gid", "user", "min_nodes", "max_nodes",
                "nproc_per_node", "max_restarts", "max_restarts_per_window", "restart_window",
                "nodes", "created_at", "submitted_on", "inprocess",
                "gpus_per_node", "cpu_bind",  # GPUs: gpus/alloc.py
                "spares")  # spare nodes: rendezvous/round.py
SECRET_FIELDS = ("command", "env")
MAX_STORED = 4 << 20   # bytes of a stored spec (control's limits keep a real one far below)
SIGNED_FIELDS = ("format", *CLEAR_FIELDS, "sealed")
_STORED = frozenset(SIGNED_FIELDS) | {"mac"}
# Fields a spec from an older release lacks (its MAC is over the rest): read as their
# defaults, so the jobs submitted before an upgrade stay adoptable and shown.
_ADDED = frozenset({"spares"})
_DEFAULTS = {"spares": 0}


def _canonical(values) -> bytes:
    return json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


class SpecCodec:
    """Seals specs this daemon writes and opens those it reads (see the module doc).
    ``records`` seals and opens every other record, from the same cluster key
    (trust/sealed.py; ``domain``: the etcd prefix, bound into each MAC)."""

    def __init__(self, keys: DerivedKeys, limits, clock=time.time, domain: str = "",
                 mark: SeqMark | None = None):
        self._mac_key = keys.mac
        self._aead = AESGCM(keys.enc)
        self._limits = limits
        self._clock = clock
        self.records = SealedRecords(keys.records, domain, mark=mark)
        self.replication_key = keys.replication   # replication/channel.py

    # -- writing -------------------------------------------------------------
    def seal(self, job: JobSpec) -> dict:
        """The record to store for the job's spec."""
        spec = job.to_wire()
        job_id = spec["id"]
        nonce = os.urandom(_NONCE)
        secret = _canonical({f: spec[f] for f in SECRET_FIELDS})
        ct = self._aead.encrypt(nonce, secret, _AAD_LABEL + job_id.encode())
        record = {"format": FORMAT, **{f: spec[f] for f in CLEAR_FIELDS},
                  "sealed": base64.b64encode(nonce + ct).decode()}
        record["mac"] = self._mac(record)
        return record

    def _mac(self, record: dict) -> str:
        signed = [f for f in SIGNED_FIELDS if f in record or f not in _ADDED]
        return hmac.new(self._mac_key, _MAC_LABEL + _canonical([record[f] for f in signed]),
                        sha256).hexdigest()

    # -- reading -------------------------------------------------------------
    def open(self, job_id: str, text: str) -> JobSpec:
        """The verified, decrypted and checked spec stored under ``job_id``;
        SpecRejected otherwise."""
        def reject(reason: RejectReason, detail: str, uid: int | None = None):
            return SpecRejected(Rejection(job_id[:200], reason, detail[:500], self._clock(),
                                          uid))
        try:
            record = decode(text, max_bytes=MAX_STORED)
        except BadValue as bad:
            raise reject(RejectReason.MALFORMED, f"not a spec: {bad}") from None
        if "mac" not in record or record.get("format") != FORMAT:
            raise reject(RejectReason.UNSIGNED, "the spec carries no signature of the cluster "
                         "key (written by something other than an elasticd daemon of this "
                         "cluster, or by an older one)")
        if set(record) != _STORED and set(record) != _STORED - _ADDED:
            extra, missing = sorted(set(record) - _STORED), sorted(_STORED - set(record))
            raise reject(RejectReason.MALFORMED, f"unexpected fields {extra[:5]}, missing "
                         f"{missing[:5]}")
        try:
            expected = self._mac(record)
        except (TypeError, ValueError):
            raise reject(RejectReason.MALFORMED, "a field is not plain JSON") from None
        mac = record["mac"]
        if not isinstance(mac, str) or not hmac.compare_digest(expected, mac):
            raise reject(RejectReason.BAD_SIGNATURE, "its signature does not match (changed "
                         "after signing, or signed with another cluster key)")
        uid = record["uid"] if type(record["uid"]) is int else None
        if record["id"] != job_id:
            raise reject(RejectReason.ID_MISMATCH, f"signed for job {str(record['id'])[:80]!r}, "
                         "found under another id (replayed)", uid)
        try:
            raw = base64.b64decode(record["sealed"], validate=True)
            secret = decode(self._aead.decrypt(raw[:_NONCE], raw[_NONCE:],
                                               _AAD_LABEL + job_id.encode()),
                            max_bytes=MAX_STORED)
            spec = {**_DEFAULTS, **{f: record[f] for f in CLEAR_FIELDS if f in record},
                    **{f: secret[f] for f in SECRET_FIELDS}}
        except (InvalidTag, binascii.Error, ValueError, TypeError, KeyError):
            raise reject(RejectReason.UNDECRYPTABLE, "its secret fields do not decrypt",
                         uid) from None
        try:
            return JobSpec.from_wire(spec, self._limits)
        except InvalidArgument as exc:
            raise reject(RejectReason.INVALID, str(exc), uid) from None


@dataclass(frozen=True)
class ClusterPolicy:
    """Whose jobs from other nodes this node runs (the ``cluster`` settings)."""
    allow_root_jobs: bool = False
    min_uid: int = 1000
    allowed_uids: frozenset = frozenset()

    @classmethod
    def from_settings(cls, s) -> "ClusterPolicy":
        return cls(s.allow_root_jobs, s.min_uid, frozenset(int(u) for u in s.allowed_uids))

    def refusal(self, uid: int, gid: int) -> str:
        """Why this node does not run a cluster job as uid:gid ("" if it does)."""
        if uid == 0 or gid == 0:
            return "" if self.allow_root_jobs else (
                f"it runs as {'uid' if uid == 0 else 'gid'} 0 and cluster.allow_root_jobs is "
                "false: root's jobs run only on the node they were submitted on")
        if uid < self.min_uid:
            return f"uid {uid} is below cluster.min_uid {self.min_uid}"
        if self.allowed_uids and uid not in self.allowed_uids:
            return f"uid {uid} is not in cluster.allowed_uids"
        return ""


def codec_for(cfg) -> SpecCodec:
    """The daemon's codec: keys from the cluster key file, or (standalone) ephemeral
    ones. Raises clusterkey.ClusterKeyError when a daemon on etcd has no usable key."""
    if cfg.daemon.standalone:      # records no other daemon reads: no mark to keep
        return SpecCodec(clusterkey.ephemeral(), cfg.control, domain=cfg.etcd.prefix)
    return SpecCodec(clusterkey.load(cfg.cluster.key_file), cfg.control,
                     domain=cfg.etcd.prefix, mark=SeqMark(cfg.daemon.state_dir))
