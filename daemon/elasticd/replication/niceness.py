"""The CPU priority of the threads that move replicas: training's, not the daemon's raised one.

The daemon runs at ``daemon.nice`` (-5 by default) so that its lease, beats and
control calls keep time on a node whose CPUs training saturates; a thread
inherits that. Copying, sealing, sending and writing snapshots is bulk work: at
-5 it takes the CPU from the training it protects. So the pusher's thread and
each receiving connection's thread move themselves to
``snapshot.replication_nice`` (0 by default) as they start (Linux: a niceness is
per thread). A thread already at a lower priority stays there. Not lower by
default: the daemon is one interpreter, and a thread preempted while it holds
the interpreter's lock stalls all the others until it runs again (seen: 2.2 s at
nice 10 on two busy CPUs).
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("elasticd.replication.niceness")


def lower_this_thread(nice: int) -> int:
    """Move the calling thread to ``nice`` unless it runs at that or lower priority
    already; the niceness it runs at now."""
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > now:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            now = nice
    except OSError as exc:   # not Linux, or a thread that is gone: it runs as it was
        log.debug("cannot set replication thread's nice to %d: %s", nice, exc)
        return nice
    return now
