"""Settings of the node and its place in the cluster: [daemon], [etcd], [cluster],
[membership] and [rendezvous].

Each field is one setting: its default, its help text and its bounds are the
``setting(...)`` call that declares it (settingfield.py), which ``--help-config``,
the sample TOML and docs/settings.md read (config/sample.py: ``documented()``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..settingfield import setting as _setting  # shared with the in-process settings


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
    nice: int = _setting(-5, "scheduling priority (nice) of the daemon's own threads, so a "
                             "node whose CPUs training saturates still keeps its lease, "
                             "beats and control calls on time; jobs' processes start at 0. "
                             "Lowering it needs root or the unit's Nice=; otherwise the "
                             "daemon says so and runs as it was started", min=-20, max=19)
    main_loop_interval: float = _setting(0.5, "seconds between main-loop ticks (watchdog pings)",
                                         min=0.01, max=60)
    # GPUs (gpus/inventory.py, gpus/alloc.py, gpus/health.py)
    gpus: str = _setting("auto", "this node's GPUs: auto (NVML if nvidia-ml-py is installed, "
                                 "else nvidia-smi, else none), none, or indices like 0,1,3")
    fake_gpus_file: str = _setting("", "TEST ONLY: a JSON file describing fake GPUs and their "
                                       "health, read instead of NVML/nvidia-smi "
                                       "(docs/gpus.md); empty on real nodes")
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
    # A node's memory of its faults (cluster/faults.py, cluster/quarantine.py)
    quarantine_faults: int = _setting(5, "a node is quarantined (it takes no new rounds until "
                                         "`elasticctl uncordon`) once this many faults it owns "
                                         "(GPU health failures, lost leases, workers killed by "
                                         "SIGBUS; never a job's own failures) were recorded "
                                         "for it within cluster.quarantine_window (0: never; "
                                         "a standalone daemon keeps none)", min=0,
                                      max=1000)
    quarantine_window: float = _setting(600.0, "seconds a node's recorded fault counts toward "
                                               "cluster.quarantine_faults (older ones age out of "
                                               "its record)", min=1, max=30 * 86400)
    quarantine_recheck: float = _setting(2.0, "seconds a job's agent on a quarantined node "
                                              "waits before it looks again whether the node "
                                              "was uncordoned; and between the GPU health "
                                              "checks of cluster.quarantine_health_release",
                                         min=0, exclusive_min=True, max=3600)
    default_spares: int = _setting(0, "spare nodes a cluster job keeps beside its max nodes "
                                      "when its submission names none (`elasticctl submit "
                                      "--spares`): each stands by with the job's worker "
                                      "template warm and takes a lost member's place at the "
                                      "same world size", min=0, max=1 << 20)
    quarantine_health_release: bool = _setting(False, "a quarantined node with GPUs checks "
                                                      "them all (the quick check and "
                                                      "daemon.gpu_health_command) every "
                                                      "cluster.quarantine_recheck seconds and "
                                                      "returns by itself once they pass; off: "
                                                      "only `elasticctl uncordon` brings it "
                                                      "back")


@dataclass(frozen=True)
class MembershipSettings:
    lease_ttl: int = _setting(3, "seconds after a daemon's last refresh that its node counts "
                                 "as lost", min=1, max=3600)
    refresh_interval: float = _setting(1.0, "seconds between lease refreshes", min=0.05,
                                       max=3600)
    lease_transport: str = _setting("grpc", "how lease refreshes reach etcd's v3 API: grpc (one "
                                            "keep-alive stream, about half etcd's CPU per "
                                            "refresh) or gateway (one HTTP POST a refresh to "
                                            "its JSON gateway); etcd's v2 API ignores it",
                                    choices=("grpc", "gateway"))
    watch_transport: str = _setting("grpc", "how the daemon's watches reach etcd's v3 API: "
                                            "grpc (one Watch stream carrying every watched "
                                            "prefix, on one connection: about a quarter of etcd's CPU a "
                                            "delivered event) or gateway (one HTTP stream "
                                            "a prefix from its JSON gateway); etcd's v2 "
                                            "API ignores it", choices=("grpc", "gateway"))
    lost_node_retention: float = _setting(3600.0, "seconds a lost node stays listed by "
                                                  "`elasticctl nodes`", min=0, max=30 * 86400)
    list_wait: float = _setting(0.3, "seconds `elasticctl nodes` waits for etcd to list the "
                                     "node records; past it (etcd slow or hung) it answers "
                                     "with the last list, and the list in flight serves the "
                                     "next call", min=0, max=60)
    record_recheck: float = _setting(1.0, "seconds a peer's node record read without a "
                                          "replication port (its daemon registers before "
                                          "its replication listener starts, and publishes "
                                          "the port at its next refresh) is used before it "
                                          "is read again; a node found with no record is "
                                          "read again after as long",
                                     min=0.05, max=3600)
    port_record_recheck: float = _setting(
        10.0, "seconds a peer's node record with a replication port is used before it is "
              "read again (no daemon watches the records' rewrites, and only the loss "
              "witnesses watch their deletes: a peer's daemon restarted with another port "
              "is found at most this late; a witness drops it at once)", min=0.05, max=3600)
    loss_witnesses: int = _setting(
        3, "daemons of the cluster that watch every node key's deletes and record each "
           "loss for `elasticctl nodes` (/v1/lost/<node>); the others watch none, so a "
           "node's loss reaches this many daemons, not every one (a job's own nodes see a "
           "member go by its join). Each daemon takes a free witness slot when one is "
           "(the first to start, or on a witness's loss)", min=1, max=64)
    witness_list_interval: float = _setting(
        10.0, "seconds between a loss witness's lists of the node records (what a lost row "
              "shows of the node) and its pruning of lost rows older than "
              "lost_node_retention", min=1, max=86400)
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
    gone_probe_timeout: float = _setting(
        0.5, "seconds the node deciding an open round waits for a late member's host to "
             "answer a connection to that member's daemon (the replication port its node "
             "record publishes), looking again every tenth of it: a refusal means the daemon "
             "is gone (killed, crashed) though its lease has not expired, and the round "
             "stops waiting for it at once instead of after rendezvous.rejoin_timeout; an "
             "accepted connection or no answer changes nothing (a host that is down answers "
             "nothing: its lease tells). 0: no probes", min=0, max=60)
    done_recheck: float = _setting(
        5.0, "seconds a node whose workers all exited 0 waits for the round's first member "
             "(the only node that watches every member's done mark) to end the job, before "
             "it reads the marks itself, again each period, and ends the job once every "
             "member's is there (the first member's end did not reach etcd, or its daemon "
             "stopped first). Each read lists the job's joins: at scale keep it well above "
             "the time the workers of all nodes take to exit", min=0.1, max=3600)
    round_stores: bool = _setting(
        True, "on a job across nodes, keep a round store process per job and node (forked "
              "from the job's worker template, else the job's Python; as its user) whose new "
              "TCPStore, listening from the moment the "
              "node joins a round, is its MASTER_PORT offer: ranks of other nodes never wait "
              "for rank 0 to bind (torch retries a refused connect 0.25-0.75 s later); the "
              "ranks get TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun. Off, or not a "
              "`python SCRIPT`/`-m MODULE` command: rank 0 hosts the store")
    round_store_timeout: float = _setting(
        30.0, "seconds the node's first join of a job waits for its round store process: "
              "for the worker template's imports to fork it from (past it, one is started "
              "with the job's Python) or its own torch import; and seconds it may take to "
              "open a new store at a join; past it the node stops using round stores for "
              "the job", min=0, exclusive_min=True, max=600)

