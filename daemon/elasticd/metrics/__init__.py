"""Prometheus metrics of this daemon (``elasticd_`` prefix, units in names).

Where each number comes from:

- Counters and histograms of job life move from the events the job
  registry emits (``_on_event``), so every state change is seen in one
  place: transitions, rendezvous duration (time in RENDEZVOUS: forming the
  round and starting the workers), fault -> RUNNING again.
- The agent reports each fault it handled (``fault_handled``: a failed
  worker, a hung rank killed, a lost node) with the layer that restarts
  after it and the record its move left: RESTARTING counts a restart,
  FAILED only the fault.
- Store requests are timed by ``TimedStore``, a proxy with the ``Store``
  interface that the daemon puts around its store.
- Gauges (jobs by state, workers, slots, the node lease) are read from
  the live objects at scrape time, so they are never stale.

Labels stay bounded: no label takes a job name, rank or round; only the
per-job straggler gauges take the job id (label ``job_id``: ``job`` is
Prometheus's own), for live jobs on this node (as
many as its slots at most), and a rank is a value, never a label.
``elasticd_job_progress_beat_max_age_seconds`` has a sample only once
something calls ``progress_beat`` (the hang detector, when it sees a beat);
until then it is declared with no sample.

Where each part lives: ``Metrics`` (recorder.py), ``TimedStore`` (timed_store.py), the
scrape-time collectors (collectors.py).
"""
from .recorder import CAUSES, LAYERS, Metrics, failure_cause
from .timed_store import STORE_OPERATIONS, TimedStore, store_error_kind

__all__ = ["CAUSES", "LAYERS", "Metrics", "STORE_OPERATIONS", "TimedStore", "failure_cause",
           "store_error_kind"]
