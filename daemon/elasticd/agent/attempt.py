"""What the running attempt of a job on this node does: its beats, its phases, its hangs.

``AttemptWatch`` owns, for the attempt under way, the progress beats seen and
when its workers started (for the wait before the next restart:
restartpolicy.plan_restart), the hang detector (hangs/detector.py) and, for a
job across nodes, the publisher of this node's phases and step times
(hangs/phase_board.py) from the first look at a running round until the job
ends here, and what this node reads of the other nodes' (rendezvous/phase_watch.py):
as the round's first member, every member's record, folded into the digest it
publishes (hangs/phase_digest.py); as any other member, that digest alone
(agent/phase_peers.py).
"""
from __future__ import annotations

import time

from ..config import Config
from ..hangs.detector import ProgressTracker
from ..hangs.phase_board import PhasePublisher
from ..jobs.records import Failure
from ..jobs.registry import JobRegistry
from ..jobs.restartpolicy import AttemptProgress
from ..rendezvous.phase_watch import JobPhases
from ..rendezvous.protocol import Result
from ..workers.group import WorkerGroup
from .phase_peers import PeerReader


class AttemptWatch:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry, phases: JobPhases,
                 metrics=None):
        self.job_id = job_id
        self._cfg = cfg
        self._phases = phases
        self._metrics = metrics
        self._beats = 0
        self.started = time.monotonic()           # when the attempt's workers started
        self.first_beat: float | None = None      # when its first beat came
        self._progress = ProgressTracker(
            job_id, cfg.agent, registry, cfg.daemon.node_id, on_beat=self._on_beat,
            seed=registry.get(job_id).hang_timeouts)  # the hang timeouts learned before
        self._phase_pub: PhasePublisher | None = None  # this node's phases, jobs across nodes
        self._peers: PeerReader | None = None    # what it reads of the other nodes' phases

    def _on_beat(self) -> None:
        if not self._beats:
            self.first_beat = time.monotonic()
        self._beats += 1
        if self._metrics:
            self._metrics.progress_beat(self.job_id)

    def begin(self) -> None:
        """A new attempt's workers start now."""
        self._beats, self.first_beat = 0, None
        self.started = time.monotonic()

    def progress(self) -> AttemptProgress:
        return AttemptProgress(self._beats, time.monotonic() - self.started)

    def check(self, group: WorkerGroup, result: Result) -> None:
        """Hang detection, one look; a job across nodes shares its ranks' phases and
        step times with its other nodes (hangs/phase_board.py) and decides on theirs."""
        if result.place.group_world_size <= 1 or not self._cfg.agent.hang_detection:
            self._progress.check(group)
            return
        if self._phase_pub is None:
            me = self._cfg.daemon.node_id
            self._phase_pub = PhasePublisher.for_agent(
                self.job_id, me, self._cfg.agent, self._phases.publish, self._phases.delete)
            self._phase_pub.start()
            self._peers = PeerReader(self.job_id, me, self._phases, self._cfg.agent)
        self._progress.check(group, self._peers.peers(list(result.members), result.place.round))
        self._phase_pub.offer(self._progress.snapshot(result.place.round))

    def forget(self, rank: int) -> None:
        """The rank was replaced: what was known of its progress goes."""
        self._progress.forget(rank)

    def explain(self, failure: Failure) -> Failure:
        """The failure, with what the hang detector knows of it."""
        return self._progress.explain(failure)

    def stop(self) -> None:
        if self._phase_pub is not None:
            self._phase_pub.stop()
            self._phase_pub = None
        if self._peers is not None:
            self._peers.stop()
