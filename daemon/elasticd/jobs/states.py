"""Job and worker states, and the legal moves between job states.

Kept free of I/O: ``jobs.JobRegistry.transition`` is the one writer of a job's
state, refuses moves not in ``JOB_TRANSITIONS``, and records each move as an
event.
"""
from __future__ import annotations

import enum


class JobState(str, enum.Enum):
    PENDING = "PENDING"          # accepted, waiting for slots
    RENDEZVOUS = "RENDEZVOUS"    # forming this round's node group
    RUNNING = "RUNNING"          # workers are up
    RESTARTING = "RESTARTING"    # a worker failed; the group is being stopped and restarted
    SUCCEEDED = "SUCCEEDED"      # every worker exited 0
    FAILED = "FAILED"            # out of restarts, or could not start
    CANCELLED = "CANCELLED"      # a user cancelled it


class WorkerState(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"          # stopped by us (restart, cancel, shutdown)


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
LIVE_STATES = frozenset(JobState) - TERMINAL_STATES
# States in which a job holds this node's slots.
ACTIVE_STATES = frozenset({JobState.RENDEZVOUS, JobState.RUNNING, JobState.RESTARTING})

JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # A job can end in any live state on another node's word (cluster jobs).
    JobState.PENDING: frozenset({JobState.RENDEZVOUS, JobState.SUCCEEDED, JobState.FAILED,
                                 JobState.CANCELLED}),
    JobState.RENDEZVOUS: frozenset({JobState.RUNNING, JobState.RESTARTING, JobState.PENDING,
                                    JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.RESTARTING, JobState.SUCCEEDED, JobState.FAILED,
                                 JobState.CANCELLED}),
    JobState.RESTARTING: frozenset({JobState.RENDEZVOUS, JobState.RUNNING, JobState.SUCCEEDED,
                                    JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: JobState, new: JobState) -> None:
    if new not in JOB_TRANSITIONS[current]:
        raise IllegalTransition(f"job cannot move from {current.value} to {new.value}")
