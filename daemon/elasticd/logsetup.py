"""Daemon logging: one line per event, journald-friendly.

Under systemd (JOURNAL_STREAM set) lines carry a ``<N>`` syslog priority
prefix and no timestamp, since journald adds its own. Elsewhere they carry
a timestamp. ``ctx()`` renders the job/node/round/rank fields every event
line names where they apply.
"""
from __future__ import annotations

import logging
import os
import sys

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4,
             logging.ERROR: 3, logging.CRITICAL: 2}


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6)
        return f"<{prio}>{super().format(record)}"


def under_journald() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM"))


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if under_journald():
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def ctx(job: str | None = None, node: str | None = None, round: int | None = None,
        rank: int | None = None) -> str:
    """``job=ab12 node=n1 round=3 rank=0`` for the fields that apply."""
    parts = []
    for key, value in (("job", job), ("node", node), ("round", round), ("rank", rank)):
        if value is not None and value != "":
            parts.append(f"{key}={value}")
    return " ".join(parts)
