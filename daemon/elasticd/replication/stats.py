"""What replication did on this node, for metrics and status: bytes each way, refusals by
reason, and per job where its newest snapshot is replicated (thread-safe)."""
from __future__ import annotations

import threading

from ..workers.snapshot_status import Replicated
from .channel import Refusal


class ReplicationStats:
    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._refused: dict[Refusal, int] = {r: 0 for r in Refusal}
        self._jobs: dict[str, Replicated] = {}

    def sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def received(self, n: int) -> None:
        with self._lock:
            self.bytes_received += n

    def refused(self, why: Refusal) -> None:
        with self._lock:
            self._refused[why] += 1

    def refusals(self) -> dict[Refusal, int]:
        with self._lock:
            return dict(self._refused)

    def replicated(self, job_id: str, rec: Replicated) -> None:
        with self._lock:
            self._jobs[job_id] = rec

    def of_job(self, job_id: str) -> Replicated | None:
        with self._lock:
            return self._jobs.get(job_id)

    def forget_others(self, live: set) -> None:
        """Drop the records of jobs no longer running here."""
        with self._lock:
            for job_id in [j for j in self._jobs if j not in live]:
                del self._jobs[job_id]

    def jobs(self) -> dict[str, Replicated]:
        with self._lock:
            return dict(self._jobs)
