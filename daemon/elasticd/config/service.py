"""Settings of what the daemon serves and keeps: [control], [limits], [metrics], [events],
[retention] and [snapshot].

Each field is one setting, declared with ``setting(...)`` (settingfield.py): its
default, help text and bounds, as config/sample.py documents them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..settingfield import setting as _setting  # shared with the in-process settings


@dataclass(frozen=True)
class ControlSettings:
    token_ttl: float = _setting(300.0, "seconds a caller's credential token stays valid",
                                min=1, max=86400)
    rpc_threads: int = _setting(32, "threads serving short control RPCs (long-lived calls "
                                    "get limits.streams_total threads more)",
                                min=2, max=1024)
    max_message_bytes: int = _setting(4 * 1024 * 1024, "largest control request accepted",
                                      min=1024, max=1 << 30)
    max_field_bytes: int = _setting(64 * 1024, "longest single string field (argument, env "
                                               "value, path)", min=64, max=1 << 30)
    max_command_args: int = _setting(4096, "most arguments in a job's command", min=1, max=1 << 20)
    max_env_entries: int = _setting(4096, "most environment variables in a submission",
                                    min=0, max=1 << 20)
    max_nproc_per_node: int = _setting(1024, "largest --nproc-per-node accepted", min=1,
                                       max=1 << 20)
    max_nodes: int = _setting(4096, "largest --nnodes accepted", min=1, max=1 << 20)
    max_restarts_limit: int = _setting(100_000, "largest --max-restarts accepted", min=0,
                                       max=1 << 30)
    max_restarts_per_window_limit: int = _setting(
        1000, "largest --max-restarts-per-window accepted (the restart times within the "
              "window travel in the job's round state)", min=0, max=10_000)
    max_spares: int = _setting(64, "largest --spares accepted (spare nodes a job keeps beside "
                                   "its max nodes)", min=0, max=1 << 20)
    max_live_jobs: int = _setting(1000, "most unfinished jobs this daemon holds", min=1,
                                  max=1_000_000)
    cwd_check_timeout: float = _setting(10.0, "seconds the check that a submitter can enter "
                                              "the job's cwd may take (as that user)",
                                        min=0, exclusive_min=True, max=600)
    log_follow_interval: float = _setting(0.1, "seconds between reads when following logs",
                                          min=0.01, max=10)


@dataclass(frozen=True)
class LimitsSettings:
    """What one user, or everyone together, may hold of the daemon (control/service.py,
    node/coordinator.py). An error over a limit names it, e.g. RESOURCE_EXHAUSTED "uid
    1001 has 100 unfinished jobs (limits.jobs_per_user 100)". root counts as
    one user like any other."""
    streams_total: int = _setting(64, "long-lived calls (logs -f, events, wait) served at "
                                      "once; each holds a thread of its own, beside the "
                                      "control.rpc_threads kept for short calls",
                                  min=1, max=100_000)
    streams_per_user: int = _setting(16, "long-lived calls one uid may hold at once",
                                     min=1, max=100_000)
    calls_per_user: int = _setting(8, "short calls (list, status, submit, cancel, ...) one "
                                      "uid may have in progress at once; more are refused "
                                      "at once (below control.rpc_threads, so other users' "
                                      "calls always find a thread)", min=1, max=100_000)
    call_rate_per_user: float = _setting(200.0, "calls a second one uid may start (a burst of "
                                                "as many after a pause); its others wait "
                                                "their turn: a flood of calls answered at once "
                                                "cannot take every other user's share of the "
                                                "daemon", min=1, max=1_000_000)
    calls_queued_per_user: int = _setting(1024, "calls of one uid that may wait for their turn "
                                               "(over limits.call_rate_per_user); one that "
                                               "comes past them is refused in its turn, so a "
                                               "flood is answered, served or refused, no "
                                               "faster than that rate",
                                          min=1, max=1_000_000)
    jobs_per_user: int = _setting(100, "unfinished jobs one uid may hold on this node",
                                  min=1, max=1_000_000)
    spec_bytes_per_user: int = _setting(64 * 1024 * 1024, "bytes of job specs (command, "
                                                          "environment, cwd) of the unfinished "
                                                          "jobs one uid may hold on this node",
                                        min=1024, max=1 << 40)
    spec_bytes_total: int = _setting(512 * 1024 * 1024, "bytes of job specs of every "
                                                        "unfinished job on this node, all "
                                                        "users together",
                                     min=1024, max=1 << 40)
    max_connections: int = _setting(1024, "open connections to the control socket; more are "
                                          "closed at once (the daemon raises its open-file "
                                          "limit to fit)", min=4, max=1_000_000)
    handshake_timeout: float = _setting(10.0, "seconds a new control connection has to start "
                                              "speaking HTTP/2 before it is closed",
                                        min=0.1, max=3600)
    idle_timeout: float = _setting(30.0, "seconds a control connection may stay open "
                                         "with no call in progress before it is closed (a "
                                         "client reconnects by itself at its next call)",
                                   min=1, max=30 * 86400)
    response_bytes: int = _setting(2 * 1024 * 1024, "most bytes of one answer: `list` comes "
                                                    "in pages of this size, and a job's "
                                                    "command is shortened in answers to fit "
                                                    "(keep under 4 MiB, a gRPC client's "
                                                    "default receive limit)",
                                   min=64 * 1024, max=64 * 1024 * 1024)
    state_min_free_bytes: int = _setting(64 * 1024 * 1024, "free bytes under which the state "
                                                           "dir's filesystem counts as full "
                                                           "(`elasticctl nodes`, metric "
                                                           "elasticd_state_disk_full)",
                                         min=0, max=1 << 50)


@dataclass(frozen=True)
class MetricsSettings:
    port: int = _setting(9400, "Prometheus /metrics port (0: off)", min=0, max=65535)
    address: str = _setting("0.0.0.0", "address the metrics endpoint listens on: every "
                                       "interface by default, like other exporters; "
                                       "127.0.0.1 keeps it on this host")
    retry_interval: float = _setting(5.0, "seconds between tries to listen while the port "
                                          "cannot be had (another process holds it): the "
                                          "daemon serves jobs meanwhile and says so in "
                                          "`elasticctl nodes`", min=0.1, max=3600)


@dataclass(frozen=True)
class EventsSettings:
    """Job events shared across the cluster (cluster/eventlog.py): ``elasticctl events`` on any
    node shows every node's transitions, worker exits and restarts."""
    share: bool = _setting(True, "publish this node's job events to etcd and mirror the other "
                                 "nodes' into the local event log (of the jobs it runs, and "
                                 "of those asked about; ignored when standalone)")
    retry: float = _setting(1.0, "seconds before events that could not be written to etcd are "
                                 "tried again (they wait in the local event log meanwhile)",
                            min=0.05, max=600)
    keep_per_job: int = _setting(1000, "events each node keeps in etcd per job; older ones are "
                                       "deleted there (every node keeps its own copy)",
                                 min=1, max=1_000_000)


@dataclass(frozen=True)
class RetentionSettings:
    """What a node keeps of finished jobs (jobs/retirer.py, decided by jobs/retention.py):
    oldest finished first, never a live job's; the record of a job whose logs the byte
    budget took stays (with its events) until its age or the count retires it."""
    max_age: float = _setting(14 * 86400.0, "seconds a finished job is kept (its record, "
                                            "events here and in etcd, logs); older ones are "
                                            "retired whole", min=0, exclusive_min=True,
                              max=3650 * 86400)
    max_jobs: int = _setting(1000, "finished jobs whose records this node keeps (also: jobs "
                                   "known here only by their events); the oldest beyond are "
                                   "retired whole", min=1, max=10_000_000)
    log_bytes: int = _setting(10 * 1024 ** 3, "bytes of finished jobs' logs this node keeps "
                                              "(on disk); past it the oldest finished jobs' "
                                              "logs are retired, their records stay. Running "
                                              "jobs' logs are bounded by agent.log_max_bytes "
                                              "per rank; keep this above what one job's can "
                                              "take", min=1024 * 1024, max=1 << 50)
    record_bytes: int = _setting(256 * 1024 * 1024, "bytes of finished jobs' specs (command, "
                                                    "environment, cwd) kept in their records; "
                                                    "past it the oldest are retired whole",
                                 min=1024, max=1 << 40)
    interval: float = _setting(60.0, "seconds between retirement passes (one also runs at "
                                     "start and whenever a job ends here)",
                               min=0.05, max=86400)


@dataclass(frozen=True)
class SnapshotSettings:
    """Jobs' in-memory snapshots on this node (workers/snapshot_dirs.py): each job whose
    workers start here gets ``<root>/<job id>``, its user's, 0700, and a budget of bytes
    its ranks' slot files may hold there (``ELASTICD_SNAPSHOT_DIR`` and
    ``ELASTICD_SNAPSHOT_BUDGET_BYTES`` in every worker's environment); the dir outlives
    worker crashes, restarts and a daemon restart, and goes once the job ended here."""
    root: str = _setting("", "where jobs' snapshot dirs live, one per job (<root>/<job id>, "
                            "the job's user's, 0700) in this dir (the daemon's, 0711); "
                            "default: /dev/shm/elasticd as root, /dev/shm/elasticd-<uid> "
                            "otherwise. Keep it on tmpfs (memory): a snapshot restores at "
                            "memory speed and a reboot leaves nothing. One daemon per dir: "
                            "it removes the dirs of jobs it does not run")
    node_budget: int = _setting(0, "bytes every job's snapshots on this node may hold "
                                   "together (all four slots of every rank, and peers' "
                                   "replicas); 0: half the size "
                                   "of the filesystem holding snapshot.root, read at start "
                                   "and logged (tmpfs is half of RAM by default, so a "
                                   "quarter of RAM): snapshots never take the memory "
                                   "training needs, on any node size. Set bytes for the "
                                   "same figure on every node", min=0, max=1 << 60)
    job_budget: int = _setting(0, "bytes one job's ranks on this node may hold (all four "
                                  "slots of every rank, and peers' replicas); 0: snapshot.node_budget, since a "
                                  "training node usually runs one job. A job gets the least "
                                  "of this and what snapshot.node_budget leaves after the "
                                  "other live jobs here (their budgets, not what they use); "
                                  "where several jobs share a node, give each a share",
                               min=0, max=1 << 60)
    pin_every: int = _setting(10, "the pin grid, in steps: a save of a step that is a "
                                  "multiple of it goes into a rank's second pair of "
                                  "slots, so every rank keeps the two newest grid steps "
                                  "however often it saves, and only those are replicated "
                                  "to the buddy node: the ranks that take over a lost "
                                  "node's part restore a grid step the survivors still "
                                  "hold. Make it more steps than replicating a snapshot "
                                  "takes. 0: no grid (two slots per rank, the newest "
                                  "snapshot replicated; a lost node's ranks find none in "
                                  "common with the survivors)", min=0, max=1 << 30)
    restore_wait: float = _setting(5.0, "seconds restore() waits, where a rank holds no "
                                        "snapshot while another does (it took over a "
                                        "lost node's ranks), for the replica the buddy "
                                        "forwards to it; no wait on a first start or "
                                        "when every rank holds one", min=0, max=3600)
    replication_port: int = _setting(0, "TCP port of this daemon's replication listener "
                                        "(replication/), which takes peers' snapshot "
                                        "replicas; 0: a free port picked at start. Either "
                                        "way the node record publishes it (sealed), so peers "
                                        "find it. Not used by a standalone daemon",
                                     min=0, max=65535)
    replication_address: str = _setting("0.0.0.0", "address the replication listener "
                                                   "binds (every connection must prove "
                                                   "it holds the cluster key)")
    replication_rate: int = _setting(64 << 20, "bytes per second this node sends replicas "
                                               "at, all jobs together: 64 MiB/s is about "
                                               "5 % of a 10 Gbit/s link, so training's own "
                                               "traffic keeps the rest; 1 GiB of state per "
                                               "node is replicated in about 16 s",
                                     min=1 << 16, max=1 << 40)
    replication_interval: float = _setting(0.2, "seconds between the pusher's looks at this "
                                                "node's jobs for a newer snapshot to "
                                                "replicate (a look reads a few slot "
                                                "headers): a lost node's ranks restore "
                                                "about this much older state, plus the "
                                                "send; the bytes sent stay within "
                                                "snapshot.replication_rate however often "
                                                "it looks", min=0.05, max=3600)
    replication_timeout: float = _setting(10.0, "seconds a replication peer may stay "
                                                "silent (the handshake, a frame, a reply) "
                                                "before its connection is dropped",
                                          min=0.1, max=3600)
    replication_max_frame: int = _setting(1 << 20, "largest replication frame accepted "
                                                   "(bytes of a chunk of a slot file); a "
                                                   "larger one drops the connection",
                                          min=4096, max=64 << 20)
    replication_nice: int = _setting(0, "scheduling priority (nice) of the threads that "
                                        "copy, seal, send and receive replicas "
                                        "(replication/niceness.py): 0, training's, so they "
                                        "do not take the CPU from it at daemon.nice's higher "
                                        "priority; a value at or below daemon.nice leaves "
                                        "them at the daemon's. Above 0 they yield to "
                                        "training, but one preempted while it holds the "
                                        "interpreter's lock stalls the daemon's other "
                                        "threads (2.2 s seen at 10 on two busy CPUs)",
                                     min=-20, max=19)
    status_ask_timeout: float = _setting(1.0, "seconds `elasticctl status` (GetJob) waits "
                                              "for the job's other nodes to answer with "
                                              "their snapshot rows, over the replication "
                                              "channel, all asked at once; a node that "
                                              "has not answered by then is left out of "
                                              "the answer", min=0.05, max=60)
    status_ask_max: int = _setting(16, "most other nodes of a job `status` asks for their "
                                       "snapshot rows (the first in the round's order); 0: "
                                       "only the answering node's row", min=0, max=1024)
    replication_max_peers: int = _setting(16, "replication connections served at once; "
                                              "one more is closed at once (counted)",
                                          min=1, max=4096)
