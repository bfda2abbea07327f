"""Settings of the per-job agent: [agent] (restarts, warm spares, worker templates, hang
detection, logs, stragglers, phases across nodes).

Each field is one setting, declared with ``setting(...)`` (settingfield.py): its
default, help text and bounds, as config/sample.py documents them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..settingfield import setting as _setting  # shared with the in-process settings


@dataclass(frozen=True)
class AgentSettings:
    monitor_interval: float = _setting(0.05, "seconds between checks of a job's worker "
                                             "processes (a worker's exit ends the wait at "
                                             "once: its pidfd)", min=0.005, max=60)
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
    warm_preload: list = _setting(["torch", "torch.distributed", "torch._dynamo",
                                   "torch.distributed.elastic.multiprocessing.errors",
                                   "torch.profiler._cupti_monitor"],
                                  "modules a warm spare or a worker template imports ahead "
                                  "of need (torch._dynamo is what the first optimizer "
                                  "construction imports; torch elastic's `record` what "
                                  "torchrun-style scripts import; the last what the first "
                                  "optimizer zero_grad imports, which each forked rank's "
                                  "first step paid for; one this torch lacks is skipped)")
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
    phase_publish_interval: float = _setting(1.0, "seconds within which a change of this "
                                                  "node's phase record that the other nodes "
                                                  "decide on is written (a rank's time per "
                                                  "step, what was learned; a change of phase "
                                                  "at once): one etcd key per node per job "
                                                  "across nodes",
                                             min=0.1, max=60)
    phase_refresh_interval: float = _setting(3.0, "seconds between writes of this node's "
                                                  "phase record while nothing the other "
                                                  "nodes decide on changed: it stays fresh "
                                                  "for agent.phase_stale_after (at least "
                                                  "agent.phase_publish_interval)",
                                             min=0.1, max=600)
    phase_stale_after: float = _setting(7.0, "seconds after which another node's phase "
                                             "record counts as stale: until every other "
                                             "node of the round has a fresh one, a job "
                                             "across nodes keeps the fixed hang timeouts "
                                             "(above twice agent.phase_refresh_interval, "
                                             "below agent.hang_learn_floor)",
                                        min=0.5, max=3600)

