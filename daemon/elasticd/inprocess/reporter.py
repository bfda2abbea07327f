"""What a rank tells: JSON lines to the daemon's report file (ELASTICD_INPROCESS_REPORT,
workers/inprocess_reports.py) and sentences to its own log (stderr)."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

log = logging.getLogger("elasticd.inprocess")


class Reporter:
    """Appends JSON lines to the daemon's report file (ELASTICD_INPROCESS_REPORT)."""

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank

    def write(self, record: dict) -> None:
        if not self.path:
            return
        record = dict(record, rank=self.rank, pid=os.getpid(), time=time.time())
        try:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError as exc:
            log.warning("rank %d: cannot report to elasticd (%s): %s", self.rank, self.path,
                        exc)


def say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
