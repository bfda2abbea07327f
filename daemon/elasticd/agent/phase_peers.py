"""What this node reads of a job's other nodes' phases, and the digest it writes for them.

For a job across nodes (hangs/phase_board.py, hangs/phase_digest.py): the round's
first member watches every member's record and publishes their digest; every
other member watches that digest alone (rendezvous/phase_watch.py). ``PeerReader``
is the one owner of that choice for one job on this node: ``peers`` switches
the watch (and starts or stops the digest's publisher) when this node becomes,
or stops being, the round's first member, and returns what the tracker
(hangs/detector.py) decides on. Used by the agent's attempt (agent/attempt.py)
and by bench/scale_sim.py.
"""
from __future__ import annotations

import time

from ..hangs.phase_board import JobPeers, PhasePublisher
from ..hangs.phase_digest import PhaseDigest, holds_records


class PeerReader:
    """One job's peers on this node: ``phases`` is its JobPhases (rendezvous/phase_watch.py),
    ``settings`` the agent settings (phase_publish_interval, phase_refresh_interval,
    phase_stale_after)."""

    RECORDS, DIGESTS = "records", "digests"

    def __init__(self, job_id: str, node_id: str, phases, settings, clock=time.monotonic):
        self.job_id, self.node_id = job_id, node_id
        self._phases, self._settings, self._clock = phases, settings, clock
        self._reading: str | None = None     # RECORDS or DIGESTS: what this node watches
        self._digest_pub: PhasePublisher | None = None   # as the first member
        self._folded = float("-inf")         # when the digest was last folded here

    @property
    def reading(self) -> str | None:
        return self._reading

    def peers(self, members: list[str], rnd: int) -> JobPeers:
        """The other members of round ``rnd`` as the tracker sees them, now."""
        s, now = self._settings, self._clock()
        if holds_records(members, self.node_id):
            self._read(self.RECORDS)
            received = self._phases.peers()
            # Folded at most ten times a publish interval: the publisher writes it at once
            # when it moved (a checkpoint began), else every refresh.
            if now - self._folded >= s.phase_publish_interval / 10:
                self._folded = now
                self._digest_pub.offer(PhaseDigest.fold(received, members, self.node_id, rnd,
                                                        s.phase_stale_after, now))
            return JobPeers.of(received, members, self.node_id, rnd, s.phase_stale_after, now)
        self._read(self.DIGESTS)
        got = self._phases.digest(members[0]) if members else None
        if got is None:
            return JobPeers(complete=False)
        return got[0].peers(members, self.node_id, rnd, max(0.0, now - got[1]),
                            s.phase_stale_after)

    def stop(self) -> None:
        """Stop watching (and delete this node's digest, if it wrote one)."""
        if self._reading == self.RECORDS:
            self._digest_pub.stop()   # its key deleted: a later first member writes its own
            self._digest_pub = None
            self._phases.unfollow()
        elif self._reading == self.DIGESTS:
            self._phases.unfollow_digests()
        self._reading = None

    def _read(self, what: str) -> None:
        if self._reading == what:
            return
        self.stop()
        if what == self.RECORDS:
            self._phases.follow()
            self._digest_pub = PhasePublisher.for_agent(
                self.job_id, self.node_id, self._settings, self._phases.publish_digest,
                self._phases.delete_digest, name="phasedigest")
            self._digest_pub.start()
        else:
            self._phases.follow_digests()
        self._reading = what
