"""Spawning, watching and stopping one job's local worker processes.

Each worker is started as the submitting user (uid, gid and groups switched
before it enters the job's cwd, so it never runs where that user could not
go), in a session of its own (so its own process group, and no controlling
terminal: nothing it runs can reach the terminal of whoever started the
daemon), stdin /dev/null, with PR_SET_PDEATHSIG=SIGKILL (so it dies
with the thread that started it even if the daemon is SIGKILLed), with the
torchrun environment, and with stdout/stderr appended to its per-rank log
file. Stopping is SIGTERM to each
process group, a grace period, then SIGKILL to whatever is left.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from . import inprocess_reports, preload, env as envnames, files as workerfiles
from .forked import ForkedProcess
from .snapshot_dirs import ensure_job_dir
from .rank_files import rank_env, site_env
from .launch import (  # noqa: F401 (the worker group's public names, from here as before)
    WORKER_UMASK, SpawnError, as_user_kwargs, can_enter, cwd_unusable, end_helper,
    log_file_path, not_found, open_log, start_job_process, start_process)
from .signals import signal_rank_group
from .spec import GroupSpec
from .. import statedir
from ..logsetup import ctx

log = logging.getLogger("elasticd.workers.group")


def base_env(spec: GroupSpec) -> dict[str, str]:
    """What every worker of the job shares: the submitter's env and our defaults."""
    env = dict(spec.env)
    # torchrun pins one OpenMP thread per worker when several share a node.
    if spec.nproc > 1 and "OMP_NUM_THREADS" not in spec.env:
        env["OMP_NUM_THREADS"] = "1"
    # Logs are followed live; a block-buffered stdout would hide them.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(site_env(env))  # hang detection: sitecustomize on the path
    return env


def worker_env(spec: GroupSpec, local_rank: int) -> dict[str, str]:
    """The worker's environment: the submitter's, plus what torchrun sets."""
    place = spec.place
    rank = place.rank_offset + local_rank
    env = base_env(spec)
    env.update({
        envnames.TORCHRUN_RANK: str(rank),
        envnames.TORCHRUN_LOCAL_RANK: str(local_rank),
        envnames.TORCHRUN_WORLD_SIZE: str(place.world_size),
        envnames.TORCHRUN_LOCAL_WORLD_SIZE: str(spec.nproc),
        envnames.TORCHRUN_GROUP_RANK: str(place.group_rank),
        envnames.TORCHRUN_GROUP_WORLD_SIZE: str(place.group_world_size),
        envnames.TORCHRUN_ROLE_RANK: str(rank),
        envnames.TORCHRUN_ROLE_WORLD_SIZE: str(place.world_size),
        envnames.TORCHRUN_ROLE_NAME: "default",
        envnames.TORCHRUN_MASTER_ADDR: place.master_addr,
        envnames.TORCHRUN_MASTER_PORT: str(place.master_port),
        envnames.TORCHRUN_RESTART_COUNT: str(spec.restart_count),
        envnames.TORCHRUN_MAX_RESTARTS: str(spec.max_restarts),
        envnames.TORCHRUN_RUN_ID: spec.job_id,
        envnames.TORCHRUN_USE_AGENT_STORE: "False",
        envnames.ERROR_FILE: error_file_path(spec, rank),
        envnames.SIGNALS_TO_HANDLE: spec.env.get(envnames.SIGNALS_TO_HANDLE,
                                                 envnames.SIGNALS_TO_HANDLE_DEFAULT),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": spec.env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                        "1"),
        envnames.JOB_ID: spec.job_id,
        envnames.ROUND: str(place.round),
        envnames.NODE_ID: spec.node_id,
    })
    if spec.snapshot is not None:  # its snapshots: over whatever the submitter's env said
        env[envnames.SNAPSHOT_DIR] = spec.snapshot.dir
        env[envnames.SNAPSHOT_BUDGET] = str(spec.snapshot.budget_bytes)
        env[envnames.SNAPSHOT_PIN_EVERY] = str(spec.snapshot.pin_every)
        env[envnames.SNAPSHOT_RESTORE_WAIT] = repr(float(spec.snapshot.restore_wait))
    if _loopback(place.master_addr):  # one node: rank 0's store listens there alone
        env[envnames.MASTER_BIND] = place.master_addr
    env.update(rank_env(spec.run_dir, rank))  # hang detection: where it beats
    env.update(spec.device_env)  # its GPUs: over whatever the submitter's shell had
    if local_rank == 0:  # learned preload: what it imported by its first step
        env[preload.ENV] = preload.report_path(spec.run_dir)
    env.update(spec.extra_env)
    if envnames.STORE_ADDR in spec.extra_env:  # in-process restart: where it reports
        env[inprocess_reports.ENV] = inprocess_reports.report_path(spec.run_dir, rank,
                                                                   spec.restart_count)
    return env


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def error_file_path(spec: GroupSpec, rank: int) -> str:
    return os.path.join(spec.run_dir, envnames.ERROR_FILE_NAME.format(
        rank=rank, restart=spec.restart_count))


@dataclass
class Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    error_file: str
    returncode: int | None = None
    stopped_by_us: bool = False
    # The worker wrote its error file (torch's @record does so just before the
    # exception unwinds the process): it has failed, even while still exiting.
    reported_error: bool = False
    # How its process came to be (worker_template.StartPath value), and why not
    # from the template when it was not ("" when it was, or none was wanted).
    start_path: str = "cold"
    cold_reason: str = ""
    # A pidfd of a process not forked from the template (exit_fds), -1: none to be had.
    pidfd: int | None = None

    @property
    def outcome(self) -> int | None:
        """The return code to decide on: a reported error counts as exit 1 at once."""
        if self.reported_error and (self.returncode is None or self.stopped_by_us):
            return 1
        return self.returncode

    @property
    def pid(self) -> int:
        return self.proc.pid


class WorkerGroup:
    """One attempt's local workers. Owned by the job's agent thread. Each rank is forked
    from the job's worker template, else handed to a warm spare (workers/spares.py),
    else started cold."""

    def __init__(self, spec: GroupSpec, template=None):
        self.spec = spec
        self.workers: list[Worker] = []
        self.template = template  # worker_template.WorkerTemplate, or None
        self.start_seconds = 0.0  # how long start() took, all ranks

    def start(self, spares: "SparePool | None" = None) -> None:
        spec = self.spec
        user_kwargs = as_user_kwargs(spec.uid, spec.gid)
        prepare_dirs(spec)
        began = time.monotonic()
        try:
            for local_rank in range(spec.nproc):
                self.workers.append(self._spawn(local_rank, user_kwargs, spares))
        except BaseException:
            self.stop(grace=0)
            raise
        self.start_seconds = time.monotonic() - began

    def replace(self, old: Worker, spares: "SparePool | None", extra_env: dict,
                why: str) -> Worker:
        """Start a new process for ``old``'s rank, in its place; the rest keep running."""
        index = self.workers.index(old)
        signal_rank_group(old.proc, signal.SIGKILL)  # what the dead rank left in its group
        new = self._spawn(old.local_rank, as_user_kwargs(self.spec.uid, self.spec.gid), spares,
                          extra_env=extra_env, what=f"replacing pid {old.pid} ({why})")
        self.workers[index] = new
        _drop_pidfd(old)
        return new

    def _spawn(self, local_rank: int, user_kwargs: dict, spares: "SparePool | None",
               extra_env: dict | None = None, what: str = "starting") -> Worker:
        spec = self.spec
        rank = spec.place.rank_offset + local_rank
        env = worker_env(spec, local_rank)
        env.update(extra_env or {})
        err = env[envnames.ERROR_FILE]
        try:
            os.unlink(err)
        except FileNotFoundError:
            pass
        proc, path, cold_reason = None, "cold", ""
        args = warm_args(spec.command)
        if self.template is not None and args is not None:
            _mark_log(spec, rank, f"{what} from the worker template")
            proc, cold_reason = self.template.fork(spec, rank, env, args)
            path = "template"
        spare = None
        if proc is None:
            spare = spares.take(local_rank, rank) if spares is not None else None
            how = "from a warm spare" if spare is not None else ""
            _mark_log(spec, rank, f"{what} {how}".strip() +
                      (f" (no worker template: {cold_reason})" if cold_reason else ""))
            if spare is not None:
                proc, path = spares.hand_over(spare, env, spec.cwd, args, spec.cpus), "spare"
        if proc is None:
            proc, path = start_process(spec, list(spec.command), rank, env, user_kwargs,
                                       stdin=None), "cold"
        log.info("%s: worker started pid %d (%s)%s",
                 ctx(job=spec.job_id, node=spec.node_id, round=spec.place.round, rank=rank),
                 proc.pid, {"template": "forked from the worker template",
                            "spare": "from a warm spare", "cold": "cold"}[path],
                 f"; no template: {cold_reason}" if cold_reason and path != "template" else "")
        return Worker(rank=rank, local_rank=local_rank, proc=proc, error_file=err,
                      start_path=path, cold_reason="" if path == "template" else cold_reason)

    def exit_fds(self) -> list[int]:
        """What becomes readable when a live worker ends (for the agent's wait between
        two looks): a forked rank's pidfd or its template's channel, and a pidfd of each
        other process (opened once, closed once it is reaped)."""
        fds = []
        for w in self.workers:
            if w.returncode is not None:
                continue
            if isinstance(w.proc, ForkedProcess):
                fd = w.proc.exit_fd()
            else:
                if w.pidfd is None:
                    try:
                        w.pidfd = os.pidfd_open(w.proc.pid)
                    except OSError:     # gone, or no pidfds here: the interval it is
                        w.pidfd = -1
                fd = w.pidfd if w.pidfd >= 0 else None
            if fd is not None:
                fds.append(fd)
        return fds

    def poll(self) -> list[Worker]:
        """Refresh each worker's return code and error report; returns the workers."""
        for w in self.workers:
            if w.returncode is None:
                w.returncode = w.proc.poll()
                if w.returncode is not None:
                    _drop_pidfd(w)
            if w.returncode is None and not w.reported_error:
                # lstat only: a link or FIFO there is never followed nor opened here.
                w.reported_error = (workerfiles.regular_size(w.error_file) or 0) > 0
        return self.workers

    def stop(self, grace: float) -> None:
        """SIGTERM every worker's process group, wait ``grace``, then SIGKILL."""
        live = [w for w in self.workers if w.proc.poll() is None]
        for w in live:
            w.stopped_by_us = True
            signal_rank_group(w.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while live and time.monotonic() < deadline:
            live = [w for w in live if w.proc.poll() is None]
            if live:  # until one ends (its pidfd, its template's word), 20 ms at most
                _wait_readable(self.exit_fds(), min(0.02, max(0.0, deadline - time.monotonic())))
        for w in self.workers:
            # Killed by SIGKILL before we sent one: someone else (the OOM killer, a
            # peer) did it, and that is a failure of its own, not our stop.
            if w.stopped_by_us and w.proc.returncode == -signal.SIGKILL:
                w.stopped_by_us = False
        # SIGKILL the groups even of exited leaders: children they left behind.
        for w in self.workers:
            signal_rank_group(w.proc, signal.SIGKILL)
        for w in self.workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("%s: worker pid %d did not die after SIGKILL",
                          ctx(job=self.spec.job_id, rank=w.rank), w.pid)
            if w.returncode is None:
                w.returncode = w.proc.returncode
            _drop_pidfd(w)


def _wait_readable(fds: list[int], timeout: float) -> None:
    try:
        select.select(fds, [], [], timeout)
    except (OSError, ValueError):   # an fd closed meanwhile: a plain wait this time
        time.sleep(timeout)


def _drop_pidfd(w: Worker) -> None:
    if w.pidfd is not None and w.pidfd >= 0:
        os.close(w.pidfd)
    w.pidfd = None


def _mark_log(spec: GroupSpec, rank: int, what: str) -> None:
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")
    with open_log(log_file_path(spec.log_dir, rank)) as logf:
        logf.write((f"==== elasticd: job {spec.job_id} rank {rank} {what} "
                    f"(restart {spec.restart_count}, round {spec.place.round}) at {stamp} ====\n"
                    ).encode())


WARMSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warmstart.py")
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?\Z")


def warm_args(command) -> list | None:
    """The arguments after the interpreter, if a warm spare can run this command.

    Only ``python [-u|-B]... SCRIPT ARGS`` and ``python [-u|-B]... -m MODULE
    ARGS``: anything else (other interpreter flags, -c, non-Python programs)
    is always started cold.
    """
    if not command or not _PYTHON.match(os.path.basename(command[0])):
        return None
    args = list(command[1:])
    i = 0
    while i < len(args) and args[i] in ("-u", "-B"):
        i += 1
    if i >= len(args):
        return None
    if args[i] == "-m":
        return args if i + 1 < len(args) else None
    return None if args[i].startswith("-") else args


def prepare_dirs(spec: GroupSpec) -> None:
    """The job's log dir, a run dir its user can write error files into, and its
    snapshot dir (kept as it is when there: it outlives every restart)."""
    statedir.private_dir(spec.log_dir)
    _ensure_run_dir(spec.run_dir, spec.uid, spec.gid)
    if spec.snapshot is not None:
        try:
            ensure_job_dir(os.path.dirname(spec.snapshot.dir), spec.job_id, spec.uid, spec.gid)
        except OSError as exc:
            raise SpawnError(f"cannot prepare the job's snapshot dir: {exc}") from None


def _ensure_run_dir(path: str, uid: int, gid: int) -> None:
    """A directory the worker's user can write its error files into."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, uid, gid)


def describe_exit(returncode: int) -> tuple[int, int, str]:
    """(exit_code, signal, text) for a Popen return code."""
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return -1, sig, f"killed by {name}"
    return returncode, 0, f"exit code {returncode}"
