"""The worker contract: every environment variable and file name the daemon and its
workers share, in one place.

The daemon's modules import these names from here. Code that runs in the
job's interpreter without the daemon package on its path (worker_site/*.py,
loaded through PYTHONPATH) keeps literal copies; tests/test_worker_env.py
checks that they equal the values here. The record formats behind the
files are defined by the modules that read them (hangs/, workers/preload.py,
workers/inprocess_reports.py). Stdlib only, imports nothing: the in-process
library (elasticd.inprocess) and worker-side code may import it.
"""

# ---------------------------------------------------------------- what torchrun sets
# (workers/group.py sets them the way torchrun would; scripts and torch read them)
TORCHRUN_RANK = "RANK"
TORCHRUN_LOCAL_RANK = "LOCAL_RANK"
TORCHRUN_WORLD_SIZE = "WORLD_SIZE"
TORCHRUN_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
TORCHRUN_GROUP_RANK = "GROUP_RANK"
TORCHRUN_GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
TORCHRUN_ROLE_RANK = "ROLE_RANK"
TORCHRUN_ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
TORCHRUN_ROLE_NAME = "ROLE_NAME"
TORCHRUN_MASTER_ADDR = "MASTER_ADDR"
TORCHRUN_MASTER_PORT = "MASTER_PORT"
TORCHRUN_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHRUN_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHRUN_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHRUN_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"   # torch's @record writes the rank's error here
# The signals torchrun's agent handles and forwards (its --signals-to-handle); its workers
# inherit the variable, and a submitter's own value is kept, as torchrun's PET_ one is.
SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
SIGNALS_TO_HANDLE_DEFAULT = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

# ---------------------------------------------------------------- elasticd's own
JOB_ID = "ELASTICD_JOB_ID"
ROUND = "ELASTICD_ROUND"
NODE_ID = "ELASTICD_NODE_ID"
HEARTBEAT_FILE = "ELASTICD_HEARTBEAT_FILE"          # hangs/: where a rank beats
LIMITS_FILE = "ELASTICD_HANG_LIMITS_FILE"           # hangs/: the learned hang limits
PRELOAD_REPORT = "ELASTICD_PRELOAD_REPORT"          # workers/preload.py: what rank 0 imported
INPROCESS_REPORT = "ELASTICD_INPROCESS_REPORT"      # workers/inprocess_reports.py
INPROCESS_PREFIX = "ELASTICD_INPROCESS_"            # + a setting's name, upper case
INPROCESS_REPLACES = "ELASTICD_INPROCESS_REPLACES"  # a replaced rank: why
INPROCESS_MAX_RESTARTS = INPROCESS_PREFIX + "MAX_RESTARTS"
WARM_PRELOAD = "ELASTICD_WARM_PRELOAD"              # workers/template.py -> warmstart.py
LEARNED_PRELOAD = "ELASTICD_LEARNED_PRELOAD"
STORE_ADDR = "ELASTICD_STORE_ADDR"                  # jobstore/: the job's store
STORE_PORT = "ELASTICD_STORE_PORT"
STORE_SECRET = "ELASTICD_STORE_SECRET"
MASTER_BIND = "ELASTICD_MASTER_BIND"                # worker_site: rank 0's env:// store

# ---------------------------------------------------------------- files in the run dir
# (format strings: str.format(rank=..., restart=...))
ERROR_FILE_NAME = "error-rank{rank}-restart{restart}.json"
HEARTBEAT_FILE_NAME = "heartbeat-rank{rank}"
LIMITS_FILE_NAME = "hang-limits.json"
PRELOAD_REPORT_NAME = "preload-report.txt"
INPROCESS_REPORT_NAME = "inprocess-rank{rank}-restart{restart}.jsonl"

# ---------------------------------------------------------------- snapshots (elasticd.snapshot)
# The job's snapshot dir on this node: tmpfs, the job user's, 0700; created by the daemon
# before a group starts, removed when the job ends (workers/snapshot_format.py: its files).
SNAPSHOT_DIR = "ELASTICD_SNAPSHOT_DIR"
# Bytes this node's ranks of the job may hold in it, every slot together (a save that would
# pass it fails in the worker, naming the setting).
SNAPSHOT_BUDGET = "ELASTICD_SNAPSHOT_BUDGET_BYTES"
# The pin grid (snapshot.pin_every): a save of a step that is a multiple of it goes into the
# rank's pin slots (workers/snapshot_format.py); 0: no pin slots.
SNAPSHOT_PIN_EVERY = "ELASTICD_SNAPSHOT_PIN_EVERY"
# Seconds restore() waits for a replica to arrive where a rank holds no snapshot while
# another rank does (snapshot.restore_wait).
SNAPSHOT_RESTORE_WAIT = "ELASTICD_SNAPSHOT_RESTORE_WAIT"
