"""Why a job spec read from etcd was not run: the typed record every part shares.

Made by trust/specs.py (verification, validation, the uid policy), kept by
the jobs view, reported once by the dispatcher (log line, metric, event) and
shown by ``status`` and ``events``. No imports: the view imports it too.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RejectReason(str, enum.Enum):
    """Why a spec from etcd was not run: the metric's label values, one each."""
    MALFORMED = "malformed"            # not a spec object, or fields missing / unknown
    UNSIGNED = "unsigned"              # no signature (a forged spec, or an old daemon's)
    BAD_SIGNATURE = "bad_signature"    # signed with another key, or changed since
    ID_MISMATCH = "id_mismatch"        # a signed spec replayed under another job id
    UNDECRYPTABLE = "undecryptable"    # its secret part does not open
    INVALID = "invalid"                # fails the checks a local submission gets
    UID_NOT_ALLOWED = "uid_not_allowed"  # its user may not run cluster jobs here


@dataclass(frozen=True)
class Rejection:
    job_id: str          # the id under which it was found in etcd (as is: never a path)
    reason: RejectReason
    detail: str          # one line for a person
    time: float
    uid: int | None = None  # the job's uid once the signature vouched for it, else None

    @property
    def message(self) -> str:
        return f"rejected ({self.reason.value}): {self.detail}"


class SpecRejected(Exception):
    def __init__(self, rejection: Rejection):
        super().__init__(rejection.message)
        self.rejection = rejection
