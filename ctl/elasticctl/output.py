"""The one printer: every command's result as a table or as JSON.

JSON shapes (the scripting contract, see DESIGN.md "Command line"):
``submit``/``status``/``cancel``/``wait`` print the job object; ``list`` prints
``{"jobs": [...]}``; ``nodes`` prints ``{"nodes": [...], "store": ...,
"store_health": ...}``; ``drain``/``uncordon`` print the node object;
``events`` and ``logs`` print one JSON object per line.
Field names are the proto's; enums are their names as plain strings; a job
that never failed has ``"last_failure": null``.
"""
from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from typing import Any, Iterable, TextIO

from google.protobuf.json_format import MessageToDict

from elasticd.jobs.restartpolicy import window_text
from elasticd.v1 import control_pb2

FORMATS = ("table", "json")
TRACEBACK_LINES = 10
_UNSPECIFIED = control_pb2.JobState.Name(control_pb2.JOB_STATE_UNSPECIFIED)
# REJECTED: a spec from etcd the node refused; it never runs there.
TERMINAL = frozenset({control_pb2.SUCCEEDED, control_pb2.FAILED, control_pb2.CANCELLED,
                      control_pb2.REJECTED})


# ---------------------------------------------------------------- plain data

def to_dict(msg: Any) -> dict[str, Any]:
    """A message as JSON-ready data, every field present, proto field names."""
    return MessageToDict(msg, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True,
                         unquote_int64_if_possible=True)


def job_dict(job: control_pb2.Job) -> dict[str, Any]:
    d = to_dict(job)
    d["last_failure"] = d.get("last_failure") if job.HasField("last_failure") else None
    return d


def event_dict(ev: control_pb2.Event) -> dict[str, Any]:
    d = to_dict(ev)
    for key in ("from_state", "to_state"):
        if d.get(key) == _UNSPECIFIED:
            d[key] = None
    return d


def state_name(state: int) -> str:
    return control_pb2.JobState.Name(state) if state in control_pb2.JobState.values() else str(state)


# ---------------------------------------------------------------- text pieces

def fmt_time(ts: float, now: float | None = None) -> str:
    """``2024-05-01 12:00:01 (3m ago)``; ``-`` for 0 (never)."""
    if not ts:
        return "-"
    now = time.time() if now is None else now
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    return f"{stamp} ({fmt_age(now - ts)} ago)" if now >= ts else stamp


def fmt_age(seconds: float) -> str:
    """``45s``, ``3m12s``, ``2h05m``, ``3d04h``."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_bytes(n: int) -> str:
    """``512 B``, ``3.0 KiB``, ``1.5 GiB``."""
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def snapshot_lines(job: control_pb2.Job) -> list[str]:
    """The job's in-memory snapshots, one row per node that reported them."""
    rows = [[s.node_id or "-"] + ([s.step, fmt_age(s.age_seconds), fmt_bytes(s.bytes)]
                                  if s.step >= 0 else ["none", "-", "-"])
            + [fmt_bytes(s.held_bytes),
               fmt_bytes(s.budget_bytes) if s.budget_bytes >= 0 else "-",
               ", ".join(s.replicas) or "none"] for s in job.snapshots]
    return ["snapshots:"] + ["  " + r for r in table(
        rows, ["NODE", "STEP", "AGE", "SIZE", "HELD", "BUDGET", "REPLICAS"]).splitlines()]


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def describe_failure(f: control_pb2.Failure) -> str:
    """``rank 2 exit code 3 (cause)`` or ``rank 2 killed by signal SIGKILL (cause)``."""
    parts = [f"rank {f.rank}"] if f.rank >= 0 else []
    parts.append(f"killed by signal {signal_name(f.signal)}" if f.signal > 0
                 else f"exit code {f.exit_code}")
    text = " ".join(parts)
    return f"{text} ({f.cause})" if f.cause else text


def restarts_text(job: control_pb2.Job) -> str:
    """``1/3`` (used/allowed over the job's life), or ``1`` with no lifetime limit."""
    return f"{job.restarts}/{job.max_restarts}" if job.max_restarts >= 0 else str(job.restarts)


def budget_text(job: control_pb2.Job) -> str:
    """``41 in total, 2 in the last hour of 10 allowed`` (+ the lifetime limit, if any)."""
    total = (f"{job.restarts}/{job.max_restarts} used/allowed in total" if job.max_restarts >= 0
             else f"{job.restarts} in total (no lifetime limit)")
    if job.max_restarts_per_window < 0 or not job.restart_window_seconds:
        return f"{total}, no budget over a window"
    return (f"{total}, {job.restarts_in_window} in the last "
            f"{window_text(job.restart_window_seconds)} of {job.max_restarts_per_window} allowed")


LAYER_NAMES = {"inprocess": "in-process", "process": "process", "rendezvous": "rendezvous"}
ATTEMPT_LINES = 8


def layers_text(job: control_pb2.Job) -> str:
    """``in-process 2 (up to 8 per process attempt), process 1/3, rendezvous 0 (...)``."""
    used, budget = dict(job.restarts_by_layer), dict(job.restart_budget)
    parts = []
    if job.inprocess:
        cap = budget.get("inprocess", 0)
        parts.append(f"in-process {used.get('inprocess', 0)}"
                     + (f" (up to {cap} per process attempt)" if cap else " (off)"))
    process = used.get('process', 0)
    parts.append(f"process {process}/{job.max_restarts}" if job.max_restarts >= 0
                 else f"process {process}")
    parts.append(f"rendezvous {used.get('rendezvous', 0)} (shares the process budget)")
    return ", ".join(parts)


def attempt_line(a: control_pb2.RestartAttempt) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(a.time)) if a.time else "-"
    if a.outcome == "recovered":
        result = f"recovered in {a.duration_seconds:.2f}s"
    else:
        result = {"fell_back": "fell back", "pending": "recovering"}.get(a.outcome, a.outcome)
    where = [f"rank {a.rank}"] if a.rank >= 0 else []
    where += [f"node {a.node_id}"] if a.node_id else []
    return (f"{stamp}  {LAYER_NAMES.get(a.layer, a.layer):<10}  {result:<20}  "
            f"{_short(a.cause, 100)}" + (f"  [{', '.join(where)}]" if where else ""))


def nodes_text(job: control_pb2.Job) -> str:
    lo = job.min_nodes or 1
    hi = job.max_nodes or lo
    return str(lo) if lo == hi else f"{lo}:{hi}"


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns, two spaces apart."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def job_summary(job: control_pb2.Job) -> str:
    """One line for `wait`: ``abc123 FAILED: rank 0 exit code 3 (...)``."""
    line = f"{job.id} {state_name(job.state)}"
    if job.state == control_pb2.SUCCEEDED:
        return line
    if job.HasField("last_failure"):
        return f"{line}: last failure: {describe_failure(job.last_failure)}"
    return f"{line}: {job.reason}" if job.reason else line


def job_detail(job: control_pb2.Job, now: float | None = None) -> str:
    """The table form of `status`."""
    now = time.time() if now is None else now
    state = state_name(job.state)
    lines = [f"job:          {job.id}" + (f" ({job.name})" if job.name else ""),
             f"state:        {state}" + (f" — {job.reason}" if job.reason else "")]
    if job.state in TERMINAL:
        lines.append(f"exit code:    {job.exit_code}")
    lines += [
        f"restarts:     {budget_text(job)}",
        f"  by layer:   {layers_text(job)}",
        f"nodes:        {nodes_text(job)} x {job.nproc_per_node or 1} ranks/node, round {job.round}"
        + (f", submitted on {job.node_id}" if job.node_id else ""),
        f"user:         {job.user or '?'} (uid {job.uid})",
        f"command:      {shlex.join(job.command)}",
        f"cwd:          {job.cwd}",
        f"created:      {fmt_time(job.created_at, now)}",
        f"started:      {fmt_time(job.started_at, now)}",
        f"finished:     {fmt_time(job.finished_at, now)}",
    ]
    if job.seconds_in_state:
        spent = ", ".join(f"{k} {fmt_age(v)}" for k, v in job.seconds_in_state.items())
        lines.append(f"time spent:   {spent}")
    if job.HasField("last_restart_plan"):
        p = job.last_restart_plan
        lines.append(f"  last wait:  {p.summary}" + (f" (node {p.node_id})" if p.node_id else ""))
    if job.HasField("last_failure"):
        f = job.last_failure
        where = [f"restart {f.restart}"] + ([f"node {f.node_id}"] if f.node_id else [])
        if f.time:
            where.append(fmt_time(f.time, now))
        lines.append(f"last failure: {describe_failure(f)}; {', '.join(where)}")
        tb = f.traceback.rstrip("\n").splitlines()
        if tb:
            lines.append("traceback:" + (f" (last {TRACEBACK_LINES} of {len(tb)} lines)"
                                         if len(tb) > TRACEBACK_LINES else ""))
            lines += ["    " + t for t in tb[-TRACEBACK_LINES:]]
    else:
        lines.append("last failure: none")
    if job.attempts:
        shown = job.attempts[-ATTEMPT_LINES:]
        lines.append("recovery:     " + (f"the latest {len(shown)} of {len(job.attempts)}, "
                                         if len(shown) < len(job.attempts) else "")
                     + "oldest first")
        lines += ["    " + attempt_line(a) for a in shown]
    if job.hang_timeouts:
        rows = [[p.phase, f"{p.hard_seconds:g}s", f"{p.soft_seconds:g}s",
                 "learned" if p.learned else "fixed (not learned yet)",
                 f"{p.longest_gap_seconds:.2f}s", p.gaps] for p in job.hang_timeouts]
        lines += ["hang timeouts:"] + ["  " + r for r in table(
            rows, ["PHASE", "KILL AFTER", "DUMP AFTER", "SOURCE", "LONGEST GAP",
                   "GAPS"]).splitlines()]
    if job.HasField("straggler"):
        st = job.straggler
        lines.append(f"straggler:    rank {st.rank}: {st.ratio:.2f}x the median rank's work per "
                     f"step ({st.step_seconds:.3f}s vs {st.median_step_seconds:.3f}s, "
                     f"{st.ranks} ranks"
                     + (f" on {st.nodes} nodes; rank {st.rank} runs on node {st.rank_node_id}"
                        if st.nodes > 1 and st.rank_node_id else
                        f" on node {st.node_id}" if st.node_id else "")
                     + ")")
    if job.spares or job.spare_nodes:
        lines.append(f"spares:       {job.spares} wanted; standing by: "
                     + (", ".join(job.spare_nodes) or "none"))
    if job.gpus_per_node >= 0 or job.cpu_bind == "numa":
        lines.append("gpus:         " + (f"{job.gpus_per_node} per node" if job.gpus_per_node
                                         >= 0 else "one per local rank on nodes with GPUs")
                     + (", CPUs bound to their NUMA node" if job.cpu_bind == "numa" else ""))
    if job.template_state:
        rss = job.template_rss_bytes
        lines.append(f"template:     {job.template_state}"
                     + (f", {rss / (1 << 20):.0f} MiB resident" if rss else "")
                     + (f" — {job.template_reason}" if job.template_reason else ""))
    if job.start_path:
        lines.append(f"last start:   {job.start_path}, {job.start_seconds:.3f}s to start "
                     "this node's ranks")
    if job.snapshots:
        lines += snapshot_lines(job)
    if job.workers:
        bound = any(w.gpus or w.cpus for w in job.workers)
        rows = [[w.rank, w.local_rank, w.node_id or "-", w.pid or "-", w.state,
                 w.exit_code if w.state in ("failed", "succeeded") else "-"]
                + ([",".join(map(str, w.gpus)) or "-", w.cpus or "-"] if bound else [])
                for w in sorted(job.workers, key=lambda w: w.rank)]
        lines += ["workers:"] + ["  " + r for r in table(
            rows, ["RANK", "LOCAL", "NODE", "PID", "STATE", "EXIT"]
            + (["GPUS", "CPUS"] if bound else [])).splitlines()]
    return "\n".join(lines)


def jobs_table(jobs: Iterable[control_pb2.Job], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [[j.id, j.name or "-", state_name(j.state), nodes_text(j), j.nproc_per_node or 1,
             restarts_text(j), fmt_age(now - j.created_at) if j.created_at else "-",
             j.user or str(j.uid), _short(shlex.join(j.command), 40)] for j in jobs]
    return table(rows, ["ID", "NAME", "STATE", "NODES", "NPROC", "RESTARTS", "AGE", "USER",
                        "COMMAND"])


def nodes_table(resp: control_pb2.ListNodesResponse) -> str:
    rows = [[n.node_id, n.state, n.host or "-", n.address or "-", f"{n.slots_free}/{n.slots}",
             f"{n.gpus_free}/{n.gpus}" if n.gpus else "-",
             n.version or "-", _heartbeat(n), _jobs_cell(n)]
            for n in resp.nodes]
    text = table(rows, ["NODE", "STATE", "HOST", "ADDRESS", "FREE/SLOTS", "FREE/GPUS",
                        "VERSION", "HEARTBEAT", "JOBS"])
    for n in resp.nodes:
        if n.devices:
            text += f"\nGPUs of {n.node_id} ({n.gpu_source}, health " \
                    f"{n.gpu_health or 'not checked yet'}):"
            text += "".join(f"\n  {g.index}  {g.uuid}  {g.memory_mib} MiB  numa "
                            f"{g.numa_node if g.numa_node >= 0 else '-'}  cpus {g.cpus or '-'}  "
                            f"{'job ' + g.job_id if g.job_id else 'free'}" for g in n.devices)
    store = resp.store or "?"
    text += f"\nstore: {store} ({resp.store_health or 'unknown'})"
    for n in resp.nodes:
        text += "".join(f"\nproblem on {n.node_id}: {p}" for p in n.problems)
        if n.suspect and not any(n.suspect in p for p in n.problems):
            text += f"\nsuspect: {n.node_id}: {n.suspect}"
        text += "".join(f"\nquarantined: {n.node_id}: {r}" for r in n.quarantine)
        if n.quarantine:
            text += f"\n  (`elasticctl uncordon {n.node_id}` takes it back)"
    for n in resp.nodes:
        if n.idle_templates:
            rss = sum(t.rss_bytes for t in n.idle_templates)
            text += (f"\nidle worker templates on {n.node_id}: {len(n.idle_templates)}, "
                     f"{rss / (1 << 20):.0f} MiB resident")
            text += "".join(f"\n  uid {t.uid}  pid {t.pid}  key {t.key}  idle "
                            f"{t.idle_seconds:.0f}s  {t.rss_bytes / (1 << 20):.0f} MiB"
                            + (f"  {t.origin}" if t.origin not in ("", "job") else "")
                            + (f"  {t.state}" if t.state == "starting" else "")
                            for t in n.idle_templates)
    return text


def _jobs_cell(n: control_pb2.Node) -> str:
    """The node's jobs, those it stands by for as a spare node marked ``(spare)``."""
    spare = set(n.spare_for)
    jobs = list(n.jobs) + [j for j in n.spare_for if j not in set(n.jobs)]
    return ",".join(j + " (spare)" if j in spare else j for j in jobs) or "-"


def _heartbeat(n: control_pb2.Node) -> str:
    if n.state == "lost":
        return f"lost {fmt_age(n.heartbeat_age_seconds)} ago"
    if n.heartbeat_age_seconds < 0:  # a peer: alive, so refreshed within its lease TTL
        return f"<{n.lease_ttl_seconds:g}s" if n.lease_ttl_seconds else "live"
    return f"{n.heartbeat_age_seconds:.1f}s"


def event_line(ev: control_pb2.Event) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ev.time)) if ev.time else "-"
    if ev.kind == "state" and ev.from_state == control_pb2.JOB_STATE_UNSPECIFIED:
        what = state_name(ev.to_state)  # the job's first event: it has no state before
    elif ev.kind == "state":
        what = f"{state_name(ev.from_state)} -> {state_name(ev.to_state)}"
    else:
        what = ev.kind + (f" rank {ev.rank}" if ev.rank >= 0 and ev.kind in (
            "worker_exit", "replace", "hang", "straggler") else "")
        if ev.layer:
            what += f" ({LAYER_NAMES.get(ev.layer, ev.layer)}" + (
                f", {ev.duration_seconds:.2f}s)" if ev.duration_seconds else ")")
    ctx = [f"node {ev.node_id}"] if ev.node_id else []
    ctx += [f"round {ev.round}", f"restart {ev.restart}"]
    reason = f": {ev.reason}" if ev.reason else ""
    return f"{stamp}  {ev.job_id}  {what}{reason}  [{', '.join(ctx)}]"


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------- the printer

class Printer:
    """Writes each command's result to ``out`` in the chosen format."""

    def __init__(self, fmt: str = "table", out: TextIO | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown output format {fmt!r}")
        self.fmt = fmt
        self.out = out if out is not None else sys.stdout
        self._midline: set[int] = set()  # ranks whose last log text ended mid-line

    @property
    def json(self) -> bool:
        return self.fmt == "json"

    def _emit(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _json(self, data: Any, lines: bool = False) -> None:
        self._emit(json.dumps(data, sort_keys=False) if lines else json.dumps(data, indent=2))

    def submitted(self, job: control_pb2.Job) -> None:
        self._json(job_dict(job)) if self.json else self._emit(job.id)

    def job(self, job: control_pb2.Job) -> None:
        self._json(job_dict(job)) if self.json else self._emit(job_detail(job))

    def finished(self, job: control_pb2.Job) -> None:
        """The result of `wait`."""
        self._json(job_dict(job)) if self.json else self._emit(job_summary(job))

    def cancelled(self, job: control_pb2.Job) -> None:
        if self.json:
            self._json(job_dict(job))
        elif job.state in TERMINAL:
            self._emit(f"{job.id} {state_name(job.state)}" + (f": {job.reason}" if job.reason else ""))
        else:
            self._emit(f"{job.id} cancelling (now {state_name(job.state)})")

    def jobs(self, jobs: list[control_pb2.Job]) -> None:
        if self.json:
            self._json({"jobs": [job_dict(j) for j in jobs]})
        else:
            self._emit(jobs_table(jobs) if jobs else "no jobs")

    def nodes(self, resp: control_pb2.ListNodesResponse) -> None:
        self._json(to_dict(resp)) if self.json else self._emit(nodes_table(resp))

    def warmed(self, resp: control_pb2.WarmTemplateResponse) -> None:
        """The result of `template warm`."""
        self._json(to_dict(resp)) if self.json else self._emit(
            f"worker template pid {resp.pid} (key {resp.key}) " +
            ("is there already for that job" if resp.already else
             "ended at once (over this node's limits for idle templates)"
             if resp.state == "stopped" else "starting") +
            f": {resp.state}; `elasticctl nodes` shows it")

    def node_state(self, node: control_pb2.Node) -> None:
        """The result of `drain` / `uncordon`: the node as it now is."""
        self._json(to_dict(node)) if self.json else self._emit(f"{node.node_id} {node.state}")

    def event(self, ev: control_pb2.Event) -> None:
        self._json(event_dict(ev), lines=True) if self.json else self._emit(event_line(ev))

    def log(self, rank: int, text: str, prefix: bool) -> None:
        """Log text as it came; ``[rank R] `` before each line when ``prefix``."""
        if self.json:
            self._json({"rank": rank, "text": text}, lines=True)
            return
        if prefix and text:
            lines = text.splitlines(keepends=True)
            head = "" if rank in self._midline else f"[rank {rank}] "
            text = head + lines[0] + "".join(f"[rank {rank}] {line}" for line in lines[1:])
            (self._midline.discard if text.endswith("\n") else self._midline.add)(rank)
        self.out.write(text)
        self.out.flush()
