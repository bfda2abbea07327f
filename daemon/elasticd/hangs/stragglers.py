"""Stragglers: which rank does the most work per step, and how much more than the median.

Each beat carries the rank's step count and its *busy* time (worker
contract: worker_site/elasticd_heartbeat.py): its own work per step, not
counting the wait for slower ranks in a collective. So in a job whose ranks
step in lockstep, the slow rank still stands out. Per rank the daemon keeps
the (steps, busy) of its latest beats (``RankSamples``, a bounded window);
``find_straggler`` compares the ranks' busy time per step. The median is the
lower middle value (with two ranks, the faster one), so one slow rank of two
shows its full ratio. Pure functions; the tracker (hangs/detector.py) feeds them.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

MIN_STEPS = 5        # steps a rank's window must span before its step time counts
WINDOW = 64          # beats kept per rank


@dataclass
class RankSamples:
    """The latest (daemon time, steps, busy microseconds) of one rank's beats."""
    window: collections.deque = field(default_factory=lambda: collections.deque(maxlen=WINDOW))

    def add(self, at: float, steps: int, busy_us: int) -> None:
        if self.window and (steps < self.window[-1][1] or busy_us < self.window[-1][2]):
            self.window.clear()  # a new process: its counters started again
        if not self.window or steps != self.window[-1][1]:
            self.window.append((at, steps, busy_us))

    def drop_older_than(self, at: float) -> None:
        while len(self.window) > 2 and self.window[0][0] < at:
            self.window.popleft()

    def step_seconds(self) -> float | None:
        """Busy seconds per step over the window, or None with fewer than MIN_STEPS."""
        if len(self.window) < 2:
            return None
        _, s0, b0 = self.window[0]
        _, s1, b1 = self.window[-1]
        if s1 - s0 < MIN_STEPS:
            return None
        return (b1 - b0) / 1e6 / (s1 - s0)


@dataclass(frozen=True)
class Straggler:
    rank: int
    ratio: float               # its step time over the median rank's
    step_seconds: float
    median_step_seconds: float
    ranks: int                 # ranks compared
    nodes: int = 1             # nodes those ranks run on (a job across nodes: all of them)
    rank_node: str = ""        # the node the slowest rank runs on ("" : not known)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "ratio": round(self.ratio, 3),
                "step_seconds": round(self.step_seconds, 6),
                "median_step_seconds": round(self.median_step_seconds, 6), "ranks": self.ranks,
                "nodes": self.nodes, "rank_node": self.rank_node}

    @classmethod
    def from_dict(cls, data) -> "Straggler | None":
        try:
            return cls(int(data["rank"]), float(data["ratio"]), float(data["step_seconds"]),
                       float(data["median_step_seconds"]), int(data["ranks"]),
                       int(data.get("nodes", 1)), str(data.get("rank_node", "")))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def find_straggler(step_seconds: dict[int, float],
                   nodes: dict[int, str] | None = None) -> Straggler | None:
    """The slowest of two or more ranks, against the (lower) median; None if fewer.
    ``nodes``: each rank's node, for a job across nodes (the ranks of every node)."""
    known = sorted((t, r) for r, t in step_seconds.items() if t is not None and t >= 0)
    if len(known) < 2:
        return None
    median = known[(len(known) - 1) // 2][0]
    slowest, rank = known[-1]
    ratio = slowest / median if median > 0 else (1.0 if slowest <= 0 else float("inf"))
    nodes = nodes or {}
    on = {nodes.get(r, "") for _, r in known}
    return Straggler(rank, min(ratio, 1e6), slowest, median, len(known), max(1, len(on)),
                     nodes.get(rank, ""))


def crossed(before: Straggler | None, now: Straggler | None, threshold: float) -> str | None:
    """'above' or 'below' when the ratio crossed ``threshold`` (or the slowest rank
    changed while above it); None otherwise: when to record an event."""
    was = before is not None and before.ratio >= threshold
    is_ = now is not None and now.ratio >= threshold
    if is_ and (not was or before.rank != now.rank):
        return "above"
    if was and not is_:
        return "below"
    return None
