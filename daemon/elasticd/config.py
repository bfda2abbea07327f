"""The daemon's one settings object.

Every timeout, interval, TTL and limit lives here as a named field with a
default. Values come, later ones winning, from: the defaults below, the TOML
file (``/etc/elasticd/elasticd.toml`` or ``--config``), ``ELASTICD_<SECTION>_<FIELD>``
environment variables, and command-line flags. ``load()`` validates the result
and raises :class:`ConfigError` naming every bad field at once.
"""
from __future__ import annotations

import dataclasses
import grp
import json
import os
import socket
import textwrap
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping

from .inprocess.settings import InprocessSettings, problems as inprocess_problems
from .settingfield import setting as _setting  # shared with the in-process settings

DEFAULT_CONFIG_PATH = "/etc/elasticd/elasticd.toml"
ENV_PREFIX = "ELASTICD_"


class ConfigError(ValueError):
    """One or more settings are invalid; ``errors`` names each bad field."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid configuration:\n  " + "\n  ".join(errors))


@dataclass(frozen=True)
class DaemonSettings:
    node_id: str = _setting("", "this node's id, unique in the cluster (default: hostname)")
    standalone: bool = _setting(False, "run one node with an in-memory store, no etcd")
    socket: str = _setting("", "control socket path (default: /run/elasticd/control.sock as root, "
                               "$XDG_RUNTIME_DIR/elasticd/control.sock otherwise, or "
                               "<state_dir>/control.sock without XDG_RUNTIME_DIR)")
    socket_group: str = _setting("elasticd", "group given access (0660) to the control socket; "
                                             "a name or a number; ignored if it does not exist")
    state_dir: str = _setting("", "where job records and logs live (default: /var/lib/elasticd "
                                  "as root, ~/.local/state/elasticd otherwise)")
    address: str = _setting("", "address peers use to reach this node's workers (MASTER_ADDR); "
                                "default: the local address that routes to etcd")
    slots: int = _setting(0, "worker processes this node runs at once, over all jobs "
                             "(0: one per CPU)", min=0, max=1_000_000)
    log_level: str = _setting("info", "log level", choices=("debug", "info", "warning", "error"))
    shutdown_timeout: float = _setting(30.0, "seconds a clean stop waits for workers to exit",
                                       min=0, exclusive_min=True)
    main_loop_interval: float = _setting(0.5, "seconds between main-loop ticks (watchdog pings)",
                                         min=0.01, max=60)
    # GPUs (gpus/inventory.py, gpus/alloc.py, gpus/health.py)
    gpus: str = _setting("auto", "this node's GPUs: auto (NVML if nvidia-ml-py is installed, "
                                 "else nvidia-smi, else none), none, or indices like 0,1,3")
    fake_gpus_file: str = _setting("", "TEST ONLY: a JSON file describing fake GPUs and their "
                                       "health, read instead of NVML/nvidia-smi (see README, "
                                       "GPUs); empty on real nodes")
    nvidia_smi_timeout: float = _setting(10.0, "seconds nvidia-smi may take to answer",
                                         min=0, exclusive_min=True, max=600)
    gpu_health_command: str = _setting("", "command run (as the daemon's user, not the job's) "
                                           "before this node joins a round of a job using GPUs; "
                                           "non-zero exit: the node does not join; empty: none")
    gpu_health_timeout: float = _setting(30.0, "seconds the GPU health check and command may "
                                               "take (no answer counts as a failure)",
                                         min=0, exclusive_min=True, max=3600)
    gpu_release_timeout: float = _setting(30.0, "seconds to wait, before a round, for the "
                                                "processes left on a job's GPUs (a dead rank's) "
                                                "to be gone; still there: a health failure",
                                          min=0, max=3600)
    gpu_health_retry_interval: float = _setting(10.0, "seconds a node whose GPU health check "
                                                      "failed waits before checking again",
                                                min=0, exclusive_min=True, max=3600)
    gpu_health_failures_to_drain: int = _setting(3, "GPU health failures in a row after which "
                                                    "the node drains itself (0: never)",
                                                 min=0, max=1_000_000)
    # A suspect node (cluster/suspicion.py)
    suspect_jobs: int = _setting(3, "this node is suspect once workers of this many different "
                                    "jobs failed here within daemon.suspect_window (0: never)",
                                 min=0, max=1_000_000)
    suspect_window: float = _setting(3600.0, "seconds a worker failure counts toward "
                                             "daemon.suspect_jobs", min=0, exclusive_min=True,
                                     max=30 * 86400)
    suspect_adopt_delay: float = _setting(1.0, "seconds a suspect node lets a cluster job's "
                                               "round wait for other nodes before it joins; "
                                               "below rendezvous.last_call it still joins a "
                                               "round with room, losing only when nodes compete",
                                          min=0, max=3600)


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: list = _setting(["http://127.0.0.1:2379"], "etcd client URLs, tried in order")
    prefix: str = _setting("/elasticd", "key prefix; keys live under <prefix>/v1/")
    api: str = _setting("auto", "etcd API: v3, v2 (needs etcd --enable-v2), or auto (v3 when "
                                "the server has it)", choices=("auto", "v3", "v2"))
    request_timeout: float = _setting(1.5, "seconds one etcd request may take",
                                      min=0, exclusive_min=True)
    ca_cert: str = _setting("", "CA bundle to verify etcd's TLS certificate (https endpoints)")
    cert: str = _setting("", "client certificate for etcd TLS client auth")
    key: str = _setting("", "client key for etcd TLS client auth")
    username: str = _setting("", "etcd user (auth enabled)")
    password_file: str = _setting("", "file holding the etcd user's password")


@dataclass(frozen=True)
class ClusterSettings:
    """Who may run what from etcd (trust/specs.py): every job spec a daemon writes is
    signed and its secrets encrypted with keys derived from the cluster key; adopting
    daemons verify, validate and check the job's uid before they run anything."""
    key_file: str = _setting("/etc/elasticd/cluster.key", "the cluster key, the same file on "
                                                           "every node, root-owned, mode 0600 "
                                                           "(`elasticd keygen` makes one); "
                                                           "not needed when standalone")
    allow_root_jobs: bool = _setting(False, "adopt cluster jobs that run as uid 0 (or gid 0) "
                                            "when another node submitted them; off: root's "
                                            "jobs run only on the node they were submitted on")
    min_uid: int = _setting(1000, "lowest uid (other than 0, see allow_root_jobs) whose cluster "
                                  "jobs this node adopts", min=0, max=2**32 - 2)
    allowed_uids: list = _setting([], "if not empty, the only uids whose cluster jobs this "
                                      "node adopts, as strings: [\"1001\", \"1002\"]")


@dataclass(frozen=True)
class MembershipSettings:
    lease_ttl: int = _setting(3, "seconds after a daemon's last refresh that its node counts "
                                 "as lost", min=1, max=3600)
    refresh_interval: float = _setting(1.0, "seconds between lease refreshes", min=0.05,
                                       max=3600)
    lost_node_retention: float = _setting(3600.0, "seconds a lost node stays listed by "
                                                  "`elasticctl nodes`", min=0, max=30 * 86400)
    watch_retry: float = _setting(1.0, "seconds before a broken etcd watch is tried again",
                                  min=0.05, max=600)
    startup_timeout: float = _setting(10.0, "seconds the daemon tries to reach etcd at start "
                                            "before it gives up", min=0, max=3600)


@dataclass(frozen=True)
class RendezvousSettings:
    last_call: float = _setting(2.0, "seconds a round waits for more nodes once the job's min "
                                     "joined (a round closes at once when max joined, or every "
                                     "node of the last round)", min=0, max=3600)
    join_timeout: float = _setting(300.0, "seconds a round may stay below the job's min nodes "
                                          "before the job fails", min=0, exclusive_min=True,
                                   max=30 * 86400)
    scale_up: str = _setting("immediate", "when a node waiting to join a running job gets "
                                          "ranks: immediate (re-rendezvous now) or on_restart "
                                          "(at the next fault)",
                             choices=("immediate", "on_restart"))
    poll: float = _setting(0.5, "longest wait between two looks at a round (changes wake it "
                                "sooner)", min=0.01, max=60)
    # -- goodput (issue 22) --
    newcomer_warm_timeout: float = _setting(
        60.0, "seconds a node that is to join a running job (started later, or back after a "
              "crash) spends starting its warm spares (torch imported) before it asks for "
              "ranks, so that the restart every member makes to let it in is a warm one; "
              "past it, it asks anyway (0: ask at once)", min=0, max=3600)
    rejoin_timeout: float = _setting(
        1.0, "seconds a round opened after a fault or a membership change waits, once the "
             "job's min joined, for members of the last round that have not rejoined yet "
             "(alive ones rejoin within a fraction of a second: they see the round open, stop "
             "their ranks and join); a member whose node lease expired meanwhile is not "
             "waited for at all. Above rendezvous.last_call it changes nothing; a member "
             "later than this (ranks slow to stop, e.g. a SIGTERM handler that saves) joins "
             "the next round as a newcomer, one more restart", min=0, max=3600)
    round_stores: bool = _setting(
        True, "on a job across nodes, keep a round store process per job and node (the "
              "job's Python, as its user) whose new TCPStore, listening from the moment the "
              "node joins a round, is its MASTER_PORT offer: ranks of other nodes never wait "
              "for rank 0 to bind (torch retries a refused connect 0.25-0.75 s later); the "
              "ranks get TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun. Off, or not a "
              "`python SCRIPT`/`-m MODULE` command: rank 0 hosts the store")
    round_store_timeout: float = _setting(
        30.0, "seconds a node's round store process may take to import torch (the node's "
              "first join of a job waits for it, while the worker template imports too) or "
              "to open a new store at a join; past it the node stops using round stores for "
              "the job", min=0, exclusive_min=True, max=600)


@dataclass(frozen=True)
class AgentSettings:
    monitor_interval: float = _setting(0.05, "seconds between checks of a job's worker processes",
                                       min=0.005, max=60)
    stop_grace_period: float = _setting(5.0, "seconds workers get after SIGTERM before SIGKILL",
                                        min=0, max=3600)
    default_max_restarts: int = _setting(-1, "restarts a job gets over its whole life when its "
                                             "submission names none (-1: no lifetime limit; "
                                             "the budget over agent.restart_window ends a job "
                                             "that keeps failing)", min=-1, max=1_000_000)
    default_max_restarts_per_window: int = _setting(
        10, "restarts a job gets within any agent.restart_window when its submission names "
            "none (-1: no such budget, then agent.default_max_restarts must be set)",
        min=-1, max=1_000_000)
    restart_window: float = _setting(3600.0, "seconds over which the restart budget of "
                                             "--max-restarts-per-window is counted",
                                     min=0, exclusive_min=True, max=365 * 86400)
    restart_backoff_initial: float = _setting(0.0, "seconds before the first restart after "
                                                   "an attempt without progress",
                                              min=0, max=3600)
    restart_backoff_step: float = _setting(0.5, "seconds added to the wait before each further "
                                                "restart without progress in between (doubling)",
                                           min=0, max=3600)
    restart_backoff_max: float = _setting(30.0, "longest wait between two restarts",
                                          min=0, max=86400)
    progress_min_beats: int = _setting(2, "progress beats (optimizer steps, heartbeat() calls; "
                                          "seen while agent.hang_detection is on) of a failed "
                                          "attempt that show it made progress: it restarts at "
                                          "once and the backoff starts over",
                                       min=1, max=1_000_000)
    progress_min_runtime: float = _setting(600.0, "seconds a failed attempt must have run to "
                                                  "count as progress without beats (scripts "
                                                  "that never beat)",
                                           min=0, exclusive_min=True, max=30 * 86400)
    warm_spares: bool = _setting(True, "keep one pre-started Python interpreter per local rank, "
                                       "torch imported, to take over at the next restart "
                                       "(only for `python SCRIPT` / `python -m MODULE` jobs)")
    warm_preload: list = _setting(["torch", "torch.distributed", "torch._dynamo"],
                                  "modules a warm spare imports ahead of need (torch._dynamo is "
                                  "what the first optimizer construction imports)")
    warm_spare_delay: float = _setting(3.0, "seconds after workers start before their spares "
                                            "are started (keeps the import off the start-up path)",
                                       min=0, max=3600)
    error_file_max_bytes: int = _setting(1 << 20, "largest worker error file "
                                                  "(TORCHELASTIC_ERROR_FILE) the daemon reads; "
                                                  "a larger one is an unreadable error file",
                                         min=1024, max=1 << 30)
    failure_tail_lines: int = _setting(20, "last lines of a failed rank's output (since its "
                                           "start) kept as its failure's traceback when it "
                                           "left no error file: what `elasticctl status` "
                                           "shows, its last line the cause; 0: none",
                                       min=0, max=1000)
    crash_loop_limit: int = _setting(3, "attempts in a row that fail the same way (exit, "
                                        "last line of the failed rank's output) without "
                                        "progress after which the job fails at once as a "
                                        "crash loop, its budget unspent; 0: never",
                                     min=0, max=1000)
    warm_spare_restart_delay: float = _setting(0.0, "seconds after the first progress beat of "
                                                    "workers that started from spares before "
                                                    "the spares are started again (workers "
                                                    "that never beat: warm_spare_delay after "
                                                    "their start)", min=0, max=3600)
    warm_spare_nice: int = _setting(0, "niceness of warm spares until they become workers "
                                        "(set back to 0 then), so that their torch import "
                                        "yields the CPU to the running workers; only a daemon "
                                        "running as root sets it (it alone can set it back); "
                                        "0: off (under a sustained load from elsewhere, "
                                        "niced spares may not be ready by the next fault)",
                                    min=0, max=19)
    # -- the worker template (workers/template.py) --
    worker_template: bool = _setting(True, "keep one process per job on this node, started "
                                           "as the job's user with agent.warm_preload "
                                           "imported, that forks every rank (first start, "
                                           "restarts, in-process replacements) in "
                                           "milliseconds; only for `python SCRIPT` / "
                                           "`python -m MODULE` jobs; warm spares are then "
                                           "kept only while it is unusable")
    template_ready_timeout: float = _setting(60.0, "seconds the first start of a job waits "
                                                   "for its worker template to finish its "
                                                   "imports before giving up on it (its "
                                                   "ranks then start cold)",
                                             min=0, exclusive_min=True, max=3600)
    template_fork_timeout: float = _setting(10.0, "seconds the worker template has to answer "
                                                  "a request to fork a rank before it counts "
                                                  "as broken (ranks then start cold)",
                                            min=0, exclusive_min=True, max=600)
    template_preload_max: int = _setting(32, "most modules a worker template learns to "
                                             "import ahead (the top-level non-stdlib "
                                             "modules a rank imported by its first step, "
                                             "imported by the job's next template, each "
                                             "tried in a throw-away child first); 0: off",
                                         min=0, max=256)
    # -- templates shared between a user's jobs (workers/template_pool.py) --
    template_idle_timeout: float = _setting(600.0, "seconds a worker template whose job "
                                                   "ended waits, idle, for the same user's "
                                                   "next job with the same interpreter, "
                                                   "directory, environment and preload "
                                                   "(which then forks its ranks with no "
                                                   "import after the submit); 0: every "
                                                   "template ends with its job",
                                            min=0, max=7 * 86400)
    template_idle_per_user: int = _setting(2, "most idle worker templates one uid may hold "
                                              "on this node (the longest idle ends first; "
                                              "each holds its imports in memory, see the "
                                              "metric elasticd_idle_template_rss_bytes)",
                                           min=0, max=256)
    template_idle_max: int = _setting(4, "most idle worker templates on this node, all "
                                         "users together", min=0, max=1024)
    template_restore: bool = _setting(True, "at start, start again the worker templates "
                                            "this node had when the daemon last ran (idle "
                                            "ones within agent.template_idle_timeout of "
                                            "their last use, and running jobs'; kept in the "
                                            "state dir as they change, so a crash loses "
                                            "nothing of it), so a user's first job after a "
                                            "restart, a crash or an upgrade is warm too; "
                                            "each then idles like any other")
    template_idle_rss_max: int = _setting(4 << 30, "bytes of resident memory the idle "
                                                   "worker templates of this node may hold "
                                                   "together (the longest idle ends first; "
                                                   "at start, what each last measured "
                                                   "bounds what is started again); 0: none "
                                                   "is kept", min=0, max=1 << 50)
    template_key_env: list = _setting([], "environment variables that also shape what a "
                                          "worker template imports, beyond the built-in "
                                          "list and what its imports read through "
                                          "os.environ (e.g. one a C extension reads with "
                                          "getenv() as it loads): a name, or a prefix "
                                          "ending in '*'; a job differing in one gets "
                                          "a template of its own")
    template_idle_check_interval: float = _setting(1.0, "seconds between looks at the idle "
                                                        "worker templates (ended when their "
                                                        "time is up, or dropped when dead)",
                                                   min=0.05, max=60)
    # -- hang detection (hangs/detector.py) --
    hang_detection: bool = _setting(True, "watch each rank's progress beats (every optimizer "
                                          "step, or elasticd_heartbeat.heartbeat()); dump the "
                                          "stacks of, then kill, a rank that stops beating")
    hang_soft_timeout: float = _setting(60.0, "seconds without a beat before a rank's Python "
                                              "stacks are dumped into its log",
                                        min=0, exclusive_min=True, max=86400)
    hang_hard_timeout: float = _setting(180.0, "seconds without a beat before a rank is killed "
                                               "as hung and the job recovers",
                                        min=0, exclusive_min=True, max=86400)
    first_step_timeout: float = _setting(600.0, "seconds a rank of a job that beats may take "
                                                "from its start to its first step (optimizer "
                                                "step or heartbeat()), and to exit",
                                         min=0, exclusive_min=True, max=7 * 86400)
    # -- bounded logs (logfiles.LogKeeper) --
    log_max_bytes: int = _setting(256 * 1024 * 1024, "bytes one rank's log may take on disk, "
                                                     "its rotated part (rank-R.log.1) included; "
                                                     "the oldest output goes first, restart "
                                                     "markers are kept", min=1024 * 1024,
                                  max=1 << 50)
    log_check_interval: float = _setting(1.0, "seconds between checks of the size of running "
                                              "jobs' logs (a log may pass log_max_bytes by "
                                              "what a rank writes in this time)",
                                         min=0.05, max=3600)
    # -- learned hang timeouts (hangs/timeouts.py); the two above stay the upper bound --
    hang_learn_floor: float = _setting(10.0, "the shortest learned hang timeout: a phase's "
                                             "timeout is max(floor, factor x the longest gap "
                                             "between beats seen in that phase)",
                                       min=0, exclusive_min=True, max=86400)
    hang_learn_factor: float = _setting(5.0, "learned hang timeout = max(floor, factor x the "
                                             "longest gap between beats seen in the phase)",
                                        min=1, max=1000)
    hang_learn_warmup: int = _setting(10, "gaps between beats a steady phase (train, forward) "
                                          "must show before its timeout is learned; checkpoint "
                                          "and named sections need one",
                                      min=1, max=1_000_000)
    hang_learn_dump_fraction: float = _setting(0.5, "a learned timeout dumps a silent rank's "
                                                    "stacks at this fraction of it",
                                               min=0, exclusive_min=True, max=0.95)
    hang_learn_persist_interval: float = _setting(5.0, "seconds between writes of what was "
                                                       "learned into the job record",
                                                  min=0, max=3600)
    # -- stragglers (hangs/stragglers.py) --
    straggler_threshold: float = _setting(2.0, "a rank whose work per step is this many times "
                                               "the median rank's is named a straggler (an "
                                               "event)", min=1, exclusive_min=True, max=1000)
    straggler_window: float = _setting(60.0, "seconds of beats the per-rank step times are "
                                             "computed over", min=1, max=86400)
    # -- phases across nodes (hangs/phase_board.py): jobs on several nodes --
    phase_publish_interval: float = _setting(1.0, "seconds between writes of this node's "
                                                  "ranks' phases and step times for a job "
                                                  "across nodes (one etcd key per node per "
                                                  "job; a change of phase is written at once)",
                                             min=0.1, max=60)
    phase_stale_after: float = _setting(5.0, "seconds after which another node's phase "
                                             "record counts as stale: until every other "
                                             "node of the round has a fresh one, a job "
                                             "across nodes keeps the fixed hang timeouts "
                                             "(below agent.hang_learn_floor)",
                                        min=0.5, max=3600)


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
    coordinator/). An error over a limit names it, e.g. RESOURCE_EXHAUSTED "uid
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
                                               "(over limits.call_rate_per_user); one more is "
                                               "refused at once: what a flood holds of the "
                                               "daemon's memory stays bounded",
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
                                 "nodes' into the local event log (ignored when standalone)")
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


SECTIONS: dict[str, type] = {
    "daemon": DaemonSettings,
    "etcd": EtcdSettings,
    "cluster": ClusterSettings,
    "membership": MembershipSettings,
    "rendezvous": RendezvousSettings,
    "agent": AgentSettings,
    "inprocess": InprocessSettings,
    "control": ControlSettings,
    "limits": LimitsSettings,
    "metrics": MetricsSettings,
    "events": EventsSettings,
    "retention": RetentionSettings,
}


@dataclass(frozen=True)
class Config:
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    membership: MembershipSettings = field(default_factory=MembershipSettings)
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    inprocess: InprocessSettings = field(default_factory=InprocessSettings)
    control: ControlSettings = field(default_factory=ControlSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    events: EventsSettings = field(default_factory=EventsSettings)
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    source: str = ""  # which file, if any, was read

    @property
    def cred_socket(self) -> str:
        return self.daemon.socket + ".cred"

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.daemon.state_dir, "logs")

    @property
    def jobs_run_dir(self) -> str:
        """Where each job gets a dir its user writes error files and progress
        beats into: beside the control socket (a dir users can reach), not in
        the state dir (root's alone)."""
        return os.path.join(os.path.dirname(self.daemon.socket), "jobs")


def _coerce(section: str, name: str, ftype: Any, raw: Any, errors: list[str]) -> Any:
    """Turn a raw value (TOML value or env/flag string) into the field's type."""
    where = f"{section}.{name}"
    tname = ftype if isinstance(ftype, str) else ftype.__name__
    try:
        if tname == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(raw, str) and raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tname == "int":
            if isinstance(raw, bool):
                raise ValueError
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw)
        if tname == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if tname == "list":
            if isinstance(raw, str):
                return [p.strip() for p in raw.split(",") if p.strip()]
            if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
                return list(raw)
            raise ValueError
        if tname == "str":
            if not isinstance(raw, (str, int)) or isinstance(raw, bool):
                raise ValueError
            return str(raw)
    except (TypeError, ValueError):
        pass
    errors.append(f"{where}: expected {tname}, got {raw!r}")
    return None


def _check_field(section: str, f: dataclasses.Field, value: Any, errors: list[str]) -> None:
    meta = f.metadata
    where = f"{section}.{f.name}"
    if meta.get("choices") and value not in meta["choices"]:
        errors.append(f"{where}: must be one of {', '.join(meta['choices'])}, got {value!r}")
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):
            errors.append(f"{where}: must be a finite number, got {value!r}")
        elif lo is not None and (value < lo or (meta.get("exclusive_min") and value == lo)):
            op = ">" if meta.get("exclusive_min") else ">="
            errors.append(f"{where}: must be {op} {lo}, got {value!r}")
        elif hi is not None and value > hi:
            errors.append(f"{where}: must be <= {hi}, got {value!r}")


def _check_relations(cfg: Config, errors: list[str]) -> None:
    a = cfg.agent
    if a.restart_backoff_initial > a.restart_backoff_max:
        errors.append("agent.restart_backoff_initial: must not exceed agent.restart_backoff_max "
                      f"({a.restart_backoff_initial} > {a.restart_backoff_max})")
    if a.default_max_restarts < 0 and a.default_max_restarts_per_window < 0:
        errors.append("agent.default_max_restarts: a job needs a restart budget: set it, or "
                      "agent.default_max_restarts_per_window (both are -1)")
    if a.hang_soft_timeout >= a.hang_hard_timeout:
        errors.append("agent.hang_soft_timeout: must be below agent.hang_hard_timeout "
                      f"({a.hang_soft_timeout} >= {a.hang_hard_timeout})")
    if a.first_step_timeout < a.hang_hard_timeout:
        errors.append("agent.first_step_timeout: must be at least agent.hang_hard_timeout "
                      f"({a.first_step_timeout} < {a.hang_hard_timeout})")
    if a.phase_stale_after <= 2 * a.phase_publish_interval:
        errors.append("agent.phase_stale_after: must exceed twice agent.phase_publish_interval "
                      f"({a.phase_stale_after} <= 2 x {a.phase_publish_interval})")
    if a.hang_detection and a.phase_stale_after >= a.hang_learn_floor:
        # A peer's checkpoint that began just after its last record must be seen, or the
        # record counted stale (fixed bounds), before a learned timeout can end the wait.
        errors.append("agent.phase_stale_after: must be below agent.hang_learn_floor "
                      f"({a.phase_stale_after} >= {a.hang_learn_floor})")
    i = cfg.inprocess
    for problem in inprocess_problems(i):   # the wrapper's own rules, worded once
        where = f"inprocess.{problem.field}:"
        if not any(e.startswith(where) for e in errors):  # a bound already said it
            errors.append(f"{where} {problem.message}")
    if a.hang_detection and a.hang_hard_timeout >= i.barrier_timeout:
        errors.append("inprocess.barrier_timeout: must exceed agent.hang_hard_timeout "
                      f"({i.barrier_timeout} <= {a.hang_hard_timeout}), or the healthy ranks "
                      "give up on a hung rank before elasticd kills and replaces it")
    from .workers.template_key import KEY_ENV_ENTRY
    bad = [v for v in a.template_key_env if not KEY_ENV_ENTRY.match(v)]
    if bad:
        errors.append(f"agent.template_key_env: {bad[0][:80]!r} is not a variable name or "
                      "a prefix ending in '*' (letters, digits, '_')")
    if a.template_idle_per_user > a.template_idle_max:
        errors.append("agent.template_idle_per_user: must not exceed agent.template_idle_max "
                      f"({a.template_idle_per_user} > {a.template_idle_max})")
    lim = cfg.limits
    if lim.spec_bytes_per_user > lim.spec_bytes_total:
        errors.append(f"limits.spec_bytes_per_user: must not exceed limits.spec_bytes_total "
                      f"({lim.spec_bytes_per_user} > {lim.spec_bytes_total})")
    if lim.calls_per_user >= cfg.control.rpc_threads:
        errors.append(f"limits.calls_per_user: must be below control.rpc_threads "
                      f"({lim.calls_per_user} >= {cfg.control.rpc_threads}), or one uid's "
                      "calls could hold every thread short calls have")
    if lim.streams_per_user > lim.streams_total:
        errors.append(f"limits.streams_per_user: must not exceed limits.streams_total "
                      f"({lim.streams_per_user} > {lim.streams_total})")
    if not cfg.metrics.address.strip():
        errors.append("metrics.address: must be an address to listen on, e.g. 0.0.0.0 or "
                      "127.0.0.1")
    d = cfg.daemon
    if d.node_id and (len(d.node_id) > 128 or not all(c.isalnum() or c in "-_." for c in d.node_id)):
        errors.append(f"daemon.node_id: use letters, digits, '-', '_' or '.', at most 128 "
                      f"characters, got {d.node_id!r}")
    if not os.path.isabs(d.socket):
        errors.append(f"daemon.socket: must be an absolute path, got {d.socket!r}")
    elif len(d.socket.encode()) + len(".cred") > 107:
        errors.append(f"daemon.socket: path too long for a unix socket ({len(d.socket)} bytes)")
    from .gpus.inventory import InventoryError, parse_setting
    try:
        parse_setting(d.gpus)
    except InventoryError as exc:
        errors.append(f"daemon.gpus: {exc}")
    if d.fake_gpus_file and not os.path.isabs(d.fake_gpus_file):
        errors.append(f"daemon.fake_gpus_file: must be an absolute path, got "
                      f"{d.fake_gpus_file!r}")
    if d.gpu_health_command:
        import shlex
        try:
            if not shlex.split(d.gpu_health_command):
                raise ValueError("empty")
        except ValueError as exc:
            errors.append(f"daemon.gpu_health_command: not a command line ({exc})")
    if not os.path.isabs(d.state_dir):
        errors.append(f"daemon.state_dir: must be an absolute path, got {d.state_dir!r}")
    if not cfg.etcd.prefix.startswith("/") or cfg.etcd.prefix.endswith("/") and cfg.etcd.prefix != "/":
        errors.append(f"etcd.prefix: must start with '/' and not end with one, got {cfg.etcd.prefix!r}")
    m = cfg.membership
    if not d.standalone and m.refresh_interval + cfg.etcd.request_timeout > m.lease_ttl:
        errors.append(f"membership.refresh_interval: plus etcd.request_timeout must fit in "
                      f"membership.lease_ttl ({m.refresh_interval} + "
                      f"{cfg.etcd.request_timeout} > {m.lease_ttl}), or a slow refresh "
                      "loses the lease")
    for name in ("ca_cert", "cert", "key", "password_file"):
        path = getattr(cfg.etcd, name)
        if path and not os.path.isfile(path):
            errors.append(f"etcd.{name}: file {path} does not exist")
    if bool(cfg.etcd.cert) != bool(cfg.etcd.key):
        errors.append("etcd.cert: etcd.cert and etcd.key go together")
    bad = [u for u in cfg.cluster.allowed_uids if not (u.isdigit() and int(u) < 2**32 - 1)]
    if bad:
        errors.append(f"cluster.allowed_uids: must be uids (numbers), got {bad!r}")
    if not os.path.isabs(cfg.cluster.key_file):
        errors.append(f"cluster.key_file: must be an absolute path, got {cfg.cluster.key_file!r}")
    if not d.standalone and not cfg.etcd.endpoints:
        errors.append("etcd.endpoints: at least one URL is needed unless daemon.standalone is set")


def _default_paths(uid: int) -> tuple[str, str]:
    """(socket, state dir) by default. Not root: $XDG_RUNTIME_DIR/elasticd/control.sock,
    else (no runtime dir, as under ``su``) the socket in the state dir under the
    user's home; never a shared directory such as /tmp, where anyone could
    create the path first."""
    if uid == 0:
        return "/run/elasticd/control.sock", "/var/lib/elasticd"
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    state = os.path.join(state_home, "elasticd")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    sock = (os.path.join(runtime, "elasticd", "control.sock") if runtime
            else os.path.join(state, "control.sock"))
    return sock, state


def default_socket_path() -> str:
    """Where a client looks for the control socket when told nothing."""
    return os.environ.get("ELASTICD_DAEMON_SOCKET") or _default_paths(os.geteuid())[0]


def load(path: str | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    """Build and validate the settings.

    ``path``: TOML file; None reads ``/etc/elasticd/elasticd.toml`` if present.
    ``env``: environment to read ``ELASTICD_*`` from (default ``os.environ``).
    ``overrides``: ``{"section.field": value}`` from flags; wins over all.
    """
    env = os.environ if env is None else env
    errors: list[str] = []
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    source = ""

    file_path = path if path is not None else (
        DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None)
    if file_path:
        try:
            with open(file_path, "rb") as fh:
                data = tomllib.load(fh)
            source = file_path
        except FileNotFoundError:
            raise ConfigError([f"config file {file_path}: does not exist"]) from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError([f"config file {file_path}: {exc}"]) from None
        for sname, body in data.items():
            if sname not in SECTIONS:
                errors.append(f"{sname}: unknown section (known: {', '.join(SECTIONS)})")
                continue
            if not isinstance(body, dict):
                errors.append(f"{sname}: must be a table, got {body!r}")
                continue
            raw[sname].update(body)

    for sname, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = f"{ENV_PREFIX}{sname}_{f.name}".upper()
            if key in env:
                raw[sname][f.name] = env[key]

    for dotted, value in (overrides or {}).items():
        sname, _, fname = dotted.partition(".")
        if sname not in SECTIONS:
            errors.append(f"{dotted}: unknown section (known: {', '.join(SECTIONS)})")
            continue
        raw[sname][fname] = value

    sections: dict[str, Any] = {}
    for sname, cls in SECTIONS.items():
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for fname, value in raw[sname].items():
            f = known.get(fname)
            if f is None:
                errors.append(f"{sname}.{fname}: unknown setting (known: {', '.join(known)})")
                continue
            coerced = _coerce(sname, fname, f.type, value, errors)
            if coerced is not None:
                _check_field(sname, f, coerced, errors)
                values[fname] = coerced
        sections[sname] = cls(**values)

    cfg = Config(**sections, source=source)
    cfg = _resolve_defaults(cfg)
    _check_relations(cfg, errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def _resolve_defaults(cfg: Config) -> Config:
    d = cfg.daemon
    sock, state = _default_paths(os.geteuid())
    d = dataclasses.replace(
        d,
        node_id=d.node_id or socket.gethostname().split(".")[0],
        socket=d.socket or sock,
        state_dir=d.state_dir or state,
        slots=d.slots or (os.cpu_count() or 1),
    )
    return dataclasses.replace(cfg, daemon=d)


def socket_gid(cfg: Config) -> int | None:
    """The gid of ``daemon.socket_group``, or None if there is no such group."""
    g = cfg.daemon.socket_group
    if not g:
        return None
    try:
        return int(g) if g.isdigit() else grp.getgrnam(g).gr_gid
    except KeyError:
        return None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, str)):
        return json.dumps(value)
    return repr(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def sample_toml(header: str) -> str:
    """The sample config file: every setting commented out, with its default."""
    out = [header.rstrip("\n"), ""]
    for sname, cls in SECTIONS.items():
        out.append(f"[{sname}]")
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                else f.default
            out.extend("# " + line for line in textwrap.wrap(meta["help"], 78))
            rules = []
            if meta.get("choices"):
                rules.append("one of: " + ", ".join(meta["choices"]))
            if meta.get("min") is not None:
                rules.append(f"{'>' if meta.get('exclusive_min') else '>='} {_num(meta['min'])}")
            if meta.get("max") is not None:
                rules.append(f"<= {_num(meta['max'])}")
            rules.append(f"env {ENV_PREFIX}{sname}_{f.name}".upper().replace("ENV ", "env "))
            out.append("# " + "; ".join(rules))
            out.append(f"# {f.name} = {_toml_value(default)}")
            out.append("")
        out[-1:] = [""] if sname != list(SECTIONS)[-1] else []
    return "\n".join(out) + "\n"


def describe() -> str:
    """Every setting with its default and meaning, for --help-config."""
    lines = []
    for sname, cls in SECTIONS.items():
        lines.append(f"[{sname}]")
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            env = f"{ENV_PREFIX}{sname}_{f.name}".upper()
            lines.append(f"  {f.name} = {default!r}  # {f.metadata['help']}  (env {env})")
    return "\n".join(lines)
