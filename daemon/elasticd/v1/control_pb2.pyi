from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    PENDING: _ClassVar[JobState]
    RENDEZVOUS: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    RESTARTING: _ClassVar[JobState]
    SUCCEEDED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    CANCELLED: _ClassVar[JobState]
    REJECTED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
PENDING: JobState
RENDEZVOUS: JobState
RUNNING: JobState
RESTARTING: JobState
SUCCEEDED: JobState
FAILED: JobState
CANCELLED: JobState
REJECTED: JobState

class SubmitRequest(_message.Message):
    __slots__ = ("name", "command", "cwd", "env", "min_nodes", "max_nodes", "nproc_per_node", "max_restarts", "inprocess", "nodes", "max_restarts_per_window", "gpus_per_node", "cpu_bind", "spares")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    INPROCESS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_PER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    CPU_BIND_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    name: str
    command: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    env: _containers.ScalarMap[str, str]
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    inprocess: bool
    nodes: _containers.RepeatedScalarFieldContainer[str]
    max_restarts_per_window: int
    gpus_per_node: int
    cpu_bind: str
    spares: int
    def __init__(self, name: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., max_restarts: _Optional[int] = ..., inprocess: _Optional[bool] = ..., nodes: _Optional[_Iterable[str]] = ..., max_restarts_per_window: _Optional[int] = ..., gpus_per_node: _Optional[int] = ..., cpu_bind: _Optional[str] = ..., spares: _Optional[int] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class WarmTemplateRequest(_message.Message):
    __slots__ = ("command", "cwd", "env", "nproc_per_node")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    env: _containers.ScalarMap[str, str]
    nproc_per_node: int
    def __init__(self, command: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., nproc_per_node: _Optional[int] = ...) -> None: ...

class WarmTemplateResponse(_message.Message):
    __slots__ = ("pid", "key", "state", "already")
    PID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALREADY_FIELD_NUMBER: _ClassVar[int]
    pid: int
    key: str
    state: str
    already: bool
    def __init__(self, pid: _Optional[int] = ..., key: _Optional[str] = ..., state: _Optional[str] = ..., already: _Optional[bool] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("all_users", "page_token")
    ALL_USERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    all_users: bool
    page_token: str
    def __init__(self, all_users: _Optional[bool] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class WaitJobRequest(_message.Message):
    __slots__ = ("id", "timeout_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    timeout_seconds: float
    def __init__(self, id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("rank", "exit_code", "signal", "cause", "traceback", "time", "restart", "node_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    exit_code: int
    signal: int
    cause: str
    traceback: str
    time: float
    restart: int
    node_id: str
    def __init__(self, rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., cause: _Optional[str] = ..., traceback: _Optional[str] = ..., time: _Optional[float] = ..., restart: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("rank", "local_rank", "pid", "state", "exit_code", "node_id", "gpus", "gpu_uuids", "cpus", "start_path")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    START_PATH_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    pid: int
    state: str
    exit_code: int
    node_id: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    cpus: str
    start_path: str
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., exit_code: _Optional[int] = ..., node_id: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., cpus: _Optional[str] = ..., start_path: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "name", "state", "reason", "command", "cwd", "uid", "gid", "user", "min_nodes", "max_nodes", "nproc_per_node", "max_restarts", "restarts", "round", "created_at", "started_at", "finished_at", "exit_code", "last_failure", "workers", "node_id", "seconds_in_state", "inprocess", "restarts_by_layer", "restart_budget", "attempts", "rejected_reason", "hang_timeouts", "straggler", "max_restarts_per_window", "restart_window_seconds", "restarts_in_window", "last_restart_plan", "gpus_per_node", "cpu_bind", "spares", "spare_nodes", "template_state", "template_reason", "template_rss_bytes", "start_path", "start_seconds", "learned_preload", "snapshots")
    class SecondsInStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RestartsByLayerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RestartBudgetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_IN_STATE_FIELD_NUMBER: _ClassVar[int]
    INPROCESS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_BY_LAYER_FIELD_NUMBER: _ClassVar[int]
    RESTART_BUDGET_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REASON_FIELD_NUMBER: _ClassVar[int]
    HANG_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_PER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    RESTART_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_IN_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTART_PLAN_FIELD_NUMBER: _ClassVar[int]
    GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    CPU_BIND_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    SPARE_NODES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_STATE_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_REASON_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    START_PATH_FIELD_NUMBER: _ClassVar[int]
    START_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEARNED_PRELOAD_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: JobState
    reason: str
    command: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    uid: int
    gid: int
    user: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    restarts: int
    round: int
    created_at: float
    started_at: float
    finished_at: float
    exit_code: int
    last_failure: Failure
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    node_id: str
    seconds_in_state: _containers.ScalarMap[str, float]
    inprocess: bool
    restarts_by_layer: _containers.ScalarMap[str, int]
    restart_budget: _containers.ScalarMap[str, int]
    attempts: _containers.RepeatedCompositeFieldContainer[RestartAttempt]
    rejected_reason: str
    hang_timeouts: _containers.RepeatedCompositeFieldContainer[PhaseTimeout]
    straggler: Straggler
    max_restarts_per_window: int
    restart_window_seconds: float
    restarts_in_window: int
    last_restart_plan: RestartPlan
    gpus_per_node: int
    cpu_bind: str
    spares: int
    spare_nodes: _containers.RepeatedScalarFieldContainer[str]
    template_state: str
    template_reason: str
    template_rss_bytes: int
    start_path: str
    start_seconds: float
    learned_preload: _containers.RepeatedScalarFieldContainer[str]
    snapshots: _containers.RepeatedCompositeFieldContainer[NodeSnapshot]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., user: _Optional[str] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., max_restarts: _Optional[int] = ..., restarts: _Optional[int] = ..., round: _Optional[int] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., exit_code: _Optional[int] = ..., last_failure: _Optional[_Union[Failure, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., node_id: _Optional[str] = ..., seconds_in_state: _Optional[_Mapping[str, float]] = ..., inprocess: _Optional[bool] = ..., restarts_by_layer: _Optional[_Mapping[str, int]] = ..., restart_budget: _Optional[_Mapping[str, int]] = ..., attempts: _Optional[_Iterable[_Union[RestartAttempt, _Mapping]]] = ..., rejected_reason: _Optional[str] = ..., hang_timeouts: _Optional[_Iterable[_Union[PhaseTimeout, _Mapping]]] = ..., straggler: _Optional[_Union[Straggler, _Mapping]] = ..., max_restarts_per_window: _Optional[int] = ..., restart_window_seconds: _Optional[float] = ..., restarts_in_window: _Optional[int] = ..., last_restart_plan: _Optional[_Union[RestartPlan, _Mapping]] = ..., gpus_per_node: _Optional[int] = ..., cpu_bind: _Optional[str] = ..., spares: _Optional[int] = ..., spare_nodes: _Optional[_Iterable[str]] = ..., template_state: _Optional[str] = ..., template_reason: _Optional[str] = ..., template_rss_bytes: _Optional[int] = ..., start_path: _Optional[str] = ..., start_seconds: _Optional[float] = ..., learned_preload: _Optional[_Iterable[str]] = ..., snapshots: _Optional[_Iterable[_Union[NodeSnapshot, _Mapping]]] = ...) -> None: ...

class NodeSnapshot(_message.Message):
    __slots__ = ("node_id", "step", "saved_at", "age_seconds", "bytes", "ranks", "held_bytes", "budget_bytes", "replicas")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAVED_AT_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    saved_at: float
    age_seconds: float
    bytes: int
    ranks: int
    held_bytes: int
    budget_bytes: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., saved_at: _Optional[float] = ..., age_seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., ranks: _Optional[int] = ..., held_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class PhaseTimeout(_message.Message):
    __slots__ = ("phase", "soft_seconds", "hard_seconds", "learned", "longest_gap_seconds", "gaps")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SOFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEARNED_FIELD_NUMBER: _ClassVar[int]
    LONGEST_GAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    soft_seconds: float
    hard_seconds: float
    learned: bool
    longest_gap_seconds: float
    gaps: int
    def __init__(self, phase: _Optional[str] = ..., soft_seconds: _Optional[float] = ..., hard_seconds: _Optional[float] = ..., learned: _Optional[bool] = ..., longest_gap_seconds: _Optional[float] = ..., gaps: _Optional[int] = ...) -> None: ...

class Straggler(_message.Message):
    __slots__ = ("rank", "ratio", "step_seconds", "median_step_seconds", "ranks", "node_id", "nodes", "rank_node_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANK_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    ratio: float
    step_seconds: float
    median_step_seconds: float
    ranks: int
    node_id: str
    nodes: int
    rank_node_id: str
    def __init__(self, rank: _Optional[int] = ..., ratio: _Optional[float] = ..., step_seconds: _Optional[float] = ..., median_step_seconds: _Optional[float] = ..., ranks: _Optional[int] = ..., node_id: _Optional[str] = ..., nodes: _Optional[int] = ..., rank_node_id: _Optional[str] = ...) -> None: ...

class RestartPlan(_message.Message):
    __slots__ = ("rule", "delay_seconds", "no_progress_streak", "beats", "ran_seconds", "summary", "node_id", "time")
    RULE_FIELD_NUMBER: _ClassVar[int]
    DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_PROGRESS_STREAK_FIELD_NUMBER: _ClassVar[int]
    BEATS_FIELD_NUMBER: _ClassVar[int]
    RAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    rule: str
    delay_seconds: float
    no_progress_streak: int
    beats: int
    ran_seconds: float
    summary: str
    node_id: str
    time: float
    def __init__(self, rule: _Optional[str] = ..., delay_seconds: _Optional[float] = ..., no_progress_streak: _Optional[int] = ..., beats: _Optional[int] = ..., ran_seconds: _Optional[float] = ..., summary: _Optional[str] = ..., node_id: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...

class RestartAttempt(_message.Message):
    __slots__ = ("layer", "cause", "time", "duration_seconds", "outcome", "rank", "node_id")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    layer: str
    cause: str
    time: float
    duration_seconds: float
    outcome: str
    rank: int
    node_id: str
    def __init__(self, layer: _Optional[str] = ..., cause: _Optional[str] = ..., time: _Optional[float] = ..., duration_seconds: _Optional[float] = ..., outcome: _Optional[str] = ..., rank: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("id", "rank", "follow", "tail_lines")
    ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_LINES_FIELD_NUMBER: _ClassVar[int]
    id: str
    rank: int
    follow: bool
    tail_lines: int
    def __init__(self, id: _Optional[str] = ..., rank: _Optional[int] = ..., follow: _Optional[bool] = ..., tail_lines: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("rank", "text")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    text: str
    def __init__(self, rank: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("id", "follow", "after_seq")
    ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    id: str
    follow: bool
    after_seq: int
    def __init__(self, id: _Optional[str] = ..., follow: _Optional[bool] = ..., after_seq: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "job_id", "time", "kind", "from_state", "to_state", "reason", "node_id", "round", "rank", "restart", "layer", "duration_seconds", "rejected_reason", "restart_rule", "restart_delay_seconds", "start_path")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REASON_FIELD_NUMBER: _ClassVar[int]
    RESTART_RULE_FIELD_NUMBER: _ClassVar[int]
    RESTART_DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    START_PATH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    job_id: str
    time: float
    kind: str
    from_state: JobState
    to_state: JobState
    reason: str
    node_id: str
    round: int
    rank: int
    restart: int
    layer: str
    duration_seconds: float
    rejected_reason: str
    restart_rule: str
    restart_delay_seconds: float
    start_path: str
    def __init__(self, seq: _Optional[int] = ..., job_id: _Optional[str] = ..., time: _Optional[float] = ..., kind: _Optional[str] = ..., from_state: _Optional[_Union[JobState, str]] = ..., to_state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., node_id: _Optional[str] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., restart: _Optional[int] = ..., layer: _Optional[str] = ..., duration_seconds: _Optional[float] = ..., rejected_reason: _Optional[str] = ..., restart_rule: _Optional[str] = ..., restart_delay_seconds: _Optional[float] = ..., start_path: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Node(_message.Message):
    __slots__ = ("node_id", "state", "host", "address", "slots", "slots_free", "version", "started_at", "heartbeat_age_seconds", "jobs", "lost_at", "lease_ttl_seconds", "problems", "gpus", "gpus_free", "gpu_source", "gpu_health", "devices", "suspect", "quarantine", "spare_for", "idle_templates")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    LOST_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FREE_FIELD_NUMBER: _ClassVar[int]
    GPU_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GPU_HEALTH_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_FIELD_NUMBER: _ClassVar[int]
    SPARE_FOR_FIELD_NUMBER: _ClassVar[int]
    IDLE_TEMPLATES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: str
    host: str
    address: str
    slots: int
    slots_free: int
    version: str
    started_at: float
    heartbeat_age_seconds: float
    jobs: _containers.RepeatedScalarFieldContainer[str]
    lost_at: float
    lease_ttl_seconds: float
    problems: _containers.RepeatedScalarFieldContainer[str]
    gpus: int
    gpus_free: int
    gpu_source: str
    gpu_health: str
    devices: _containers.RepeatedCompositeFieldContainer[NodeGpu]
    suspect: str
    quarantine: _containers.RepeatedScalarFieldContainer[str]
    spare_for: _containers.RepeatedScalarFieldContainer[str]
    idle_templates: _containers.RepeatedCompositeFieldContainer[IdleTemplate]
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[str] = ..., host: _Optional[str] = ..., address: _Optional[str] = ..., slots: _Optional[int] = ..., slots_free: _Optional[int] = ..., version: _Optional[str] = ..., started_at: _Optional[float] = ..., heartbeat_age_seconds: _Optional[float] = ..., jobs: _Optional[_Iterable[str]] = ..., lost_at: _Optional[float] = ..., lease_ttl_seconds: _Optional[float] = ..., problems: _Optional[_Iterable[str]] = ..., gpus: _Optional[int] = ..., gpus_free: _Optional[int] = ..., gpu_source: _Optional[str] = ..., gpu_health: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[NodeGpu, _Mapping]]] = ..., suspect: _Optional[str] = ..., quarantine: _Optional[_Iterable[str]] = ..., spare_for: _Optional[_Iterable[str]] = ..., idle_templates: _Optional[_Iterable[_Union[IdleTemplate, _Mapping]]] = ...) -> None: ...

class IdleTemplate(_message.Message):
    __slots__ = ("uid", "pid", "key", "idle_seconds", "rss_bytes", "origin", "state")
    UID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    uid: int
    pid: int
    key: str
    idle_seconds: float
    rss_bytes: int
    origin: str
    state: str
    def __init__(self, uid: _Optional[int] = ..., pid: _Optional[int] = ..., key: _Optional[str] = ..., idle_seconds: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., origin: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class NodeGpu(_message.Message):
    __slots__ = ("index", "uuid", "memory_mib", "numa_node", "cpus", "job_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    memory_mib: int
    numa_node: int
    cpus: str
    job_id: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., memory_mib: _Optional[int] = ..., numa_node: _Optional[int] = ..., cpus: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class SetNodeStateRequest(_message.Message):
    __slots__ = ("node_id", "state")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: str
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "store", "store_health")
    NODES_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    STORE_HEALTH_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    store: str
    store_health: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., store: _Optional[str] = ..., store_health: _Optional[str] = ...) -> None: ...
