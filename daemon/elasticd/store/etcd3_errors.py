"""What an etcd v3 error means: the StoreError for a gRPC code and message, as etcd's
JSON gateway reports them (store/etcd3.py) or its gRPC streams do (store/lease_stream.py)."""
from __future__ import annotations

import json
from typing import Any

from .base import (
    LeaseNotFound, StoreAuthError, StoreCorrupt, StoreError, StoreUnavailable, WatchCompacted,
)

# gRPC status codes, as the gateway reports them in "code" ("grpc_code" in
# a stream).  Canceled is what a stream gets when etcd shuts down.
TRANSIENT_CODES = {1, 4, 10, 14}  # Canceled, DeadlineExceeded, Aborted, Unavailable
_TRANSIENT_HTTP = {408, 429, 502, 503, 504}
_PERMISSION, _OUT_OF_RANGE, _UNAUTHENTICATED = 7, 11, 16


def json_error(raw: bytes) -> dict:
    """The gateway's error answer as a dict (its text as the message when it is no JSON)."""
    try:
        err = json.loads(raw)
    except ValueError:
        err = None
    return err if isinstance(err, dict) else {"message": raw[:200].decode("utf-8", "replace")}


def etcd_error(url: str, path: str, status: int | None, err: Any) -> StoreError:
    """The error to raise for ``err`` (``{"code", "message"}`` or the gateway's fields),
    which etcd at ``url`` answered to ``path``; ``status`` is the HTTP status (None on a
    gRPC stream)."""
    if not isinstance(err, dict):
        err = {"message": str(err)}
    code = err.get("code", err.get("grpc_code"))
    if status is not None:
        status = int(err.get("http_code", status))
    msg = str(err.get("message") or err.get("error") or "")
    text = (f"etcd at {url} refused {path}: {msg} ("
            + (f"HTTP {status}, " if status is not None else "") + f"code {code})")
    if "lease not found" in msg:
        return LeaseNotFound(text)
    if code == _OUT_OF_RANGE or "compacted" in msg:
        return WatchCompacted(text)
    if code in TRANSIENT_CODES or status in _TRANSIENT_HTTP:
        return StoreUnavailable(text)
    if (code in (_PERMISSION, _UNAUTHENTICATED) or status in (401, 403)
            or any(w in msg for w in ("auth", "user name", "permission denied"))):
        return StoreAuthError(text)
    if status == 404 and code is None:
        return StoreCorrupt(f"{url} has no v3 gateway at /v3{path} (etcd older than 3.4?)")
    return StoreError(text)
