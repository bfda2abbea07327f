"""The job's worker template on this node: one pre-imported process that forks ranks.

The template is ``python [-u|-B] workers/warmstart.py --template FD ARGS`` started
through the same spawn path as the workers (workers.start_job_process: the
job's user, its groups, its directory, the job's environment less what
differs per submit, workers/template_key.template_env), on the pool's
spawner thread, so that its PDEATHSIG is tied to a thread that lives as long
as the daemon (workers/template_pool.py); its ``sys.path`` is a cold start's (see
warmstart.entry_path). It imports ``agent.warm_preload`` once and then
waits on FD, one end of a socketpair that only this daemon holds. Each rank
is a child it forks on request (warmstart._serve / _become_rank). Its ready
message names the variables its imports read (``EnvReads``, parsed and
bounded here: the template runs the user's code): the pool gives it only to
jobs in whose environment they are the same.

Exit statuses: the ranks are the template's children, so the template
reaps them and reports each raw wait status on the channel; the daemon
keeps a ``ForkedProcess`` (workers/forked.py) per rank with the ``Popen`` interface the agent
uses (``pid``, ``poll``, ``returncode``, ``wait``), so a forked rank's exit
code or signal is exactly what a cold worker's would be. No orphans: every
rank has PDEATHSIG=SIGKILL on the template, the template has it on the
pool's spawner thread, and the template exits when the daemon's end of the channel
closes; a rank whose template died unreported is SIGKILLed (its group) and
reads as killed by SIGKILL.

Owned by one thread at a time (every call comes from it); no locks: the
agent thread of the job it serves, or, while it idles between a user's
jobs, the pool's thread (workers/template_pool.py hands it over).
The daemon never imports torch: it only reads the template's messages.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import select
import signal
import socket
import subprocess
import time

from typing import Callable

from . import env as envnames, group as workers
from .template_key import EnvReads, TemplateKey, entry_part
from .forked import ForkedProcess, pin_child
from .signals import kill_group
from .. import statedir
from .. import values
from ..logsetup import ctx

log = logging.getLogger("elasticd.workers.template")

_MESSAGE_MAX = 1 << 20  # a template line longer than this is a broken template (the
                        # ready message lists up to READ_NAMES_MAX names of <= 256 bytes)
_UNCLAIMED_MAX = 64     # exit statuses kept for pids whose fork reply has not come


class TemplateState(enum.Enum):
    OFF = "off"              # not wanted, or the command is not python SCRIPT / -m MODULE
    STARTING = "starting"    # importing the preload
    READY = "ready"          # waiting for fork requests
    FAILED = "failed"        # could not be made, or died: ranks start cold
    STOPPED = "stopped"      # ended with its job
    POOLED = "pooled"        # its job's record only: handed to the pool when the job ended


class StartPath(enum.Enum):
    """How one rank's process came to be."""
    TEMPLATE = "template"
    SPARE = "spare"
    COLD = "cold"


class WorkerTemplate:
    """One job's template on this node; see the module docstring."""

    def __init__(self, job_id: str, node_id: str = "", ready_timeout: float = 120.0,
                 fork_timeout: float = 10.0):
        self.job_id = job_id      # the job it serves now (a pooled one: the last it served)
        self._node_id = node_id
        self._ready_timeout = ready_timeout
        self._fork_timeout = fork_timeout
        self.state = TemplateState.OFF
        self.reason = ""
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._buf = b""
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._ranks: dict[int, ForkedProcess] = {}
        self._statuses: dict[int, int] = {}   # pid -> wait status, for ranks not yet claimed
        self._boot_args: list | None = None
        self.started_at = 0.0
        self.ready_seconds = 0.0
        self.was_ready = False    # it served ranks before (then a death may be revived)
        self._unsafe = False      # it refused as unsafe to fork: a new one would too
        self.key: TemplateKey | None = None   # what it was made of (template_key.py)
        self.env: dict = {}       # the environment it imports under (template_env)
        self.env_reads: EnvReads | None = None  # what its imports read of it, once ready
        self.uid = -1             # the user it runs as (set at start)
        self.log_job = job_id     # whose logs/JOB/template.log has its output

    def where(self) -> str:
        return ctx(job=self.job_id, node=self._node_id)

    @property
    def fork_timeout(self) -> float:
        return self._fork_timeout

    # -- life --------------------------------------------------------------
    def start(self, spec: workers.GroupSpec, key: "TemplateKey | None", env: dict,
              spawn: Callable | None = None) -> None:
        """Start the template for ``spec``'s job; does not wait for it (see ``ready``).
        ``key`` and ``env`` (workers/template_key.py: the job's ``template_env``) are
        all it is made of besides the job's command and log: its environment is
        ``env`` plus the preload lists (the learned modules are imported after the
        preload if a probe child could, workers/preload.py). ``spawn``: how its
        process is started, ``workers.start_job_process`` or a stand-in with its
        signature (the pool's spawner thread, so that its PDEATHSIG is tied to a
        thread that lives as long as the daemon, not to the job's agent)."""
        args = workers.warm_args(spec.command)
        if args is None or key is None:
            self._fail("the command is not `python SCRIPT` or `python -m MODULE`",
                       TemplateState.OFF)
            return
        self.key, self.env, self.env_reads = key, dict(env), None
        self.uid = spec.uid
        flags = []
        while args and args[0] in ("-u", "-B"):
            flags.append(args.pop(0))
        # Only the entry, not the job's own arguments: the template (and its
        # /proc/PID/cmdline, which its ranks show) names no job's; each rank gets its
        # job's argv at fork (warmstart._become).
        args = args[:2] if args[0] == "-m" else args[:1]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Any job with an equal key, in whose environment what its imports read is the
        # same, may use it (template_pool.py).
        env = dict(env, **{envnames.WARM_PRELOAD: ",".join(key.preload),
                           envnames.LEARNED_PRELOAD: ",".join(key.learned)})
        try:
            statedir.private_dir(spec.log_dir)  # its log; the ranks' run dir is the group's
            self._proc = (spawn or workers.start_job_process)(
                spec, [spec.command[0], *flags, workers.WARMSTART, "--template",
                       str(theirs.fileno()), *args],
                env, log_path=template_log_path(spec.log_dir), pass_fds=(theirs.fileno(),))
        except workers.SpawnError as exc:
            ours.close()
            self._fail(f"cannot start it: {exc}")
            return
        finally:
            theirs.close()
        self._sock = ours
        self._sock.setblocking(False)
        self._buf, self._replies = b"", {}
        self._boot_args = [*flags, *args]
        self.state, self.reason = TemplateState.STARTING, ""
        self.started_at = time.monotonic()
        log.info("%s: worker template starting, pid %d (key %s)", self.where(),
                 self._proc.pid, key.digest)

    def fits(self, job_env: dict) -> bool:
        """Whether it is ready and a job with ``job_env`` (its ``template_env``) would
        have read, importing, what it read (template_key.EnvReads)."""
        return self.ready(0) and self.env_reads is not None \
            and self.env_reads.fit(self.env, job_env)

    def revivable(self) -> bool:
        """Whether it died after serving ranks (not: could not be made, or unsafe), so
        that a new one is worth its start (once per round: the agent's rule)."""
        return self.state is TemplateState.FAILED and self.was_ready and not self._unsafe

    def ready(self, timeout: float | None = None, stop=None) -> bool:
        """Whether the template can fork ranks, waiting for it up to ``timeout`` (default:
        what is left of its ready timeout) while it is still importing; a set ``stop``
        event (threading.Event: cancel, shutdown) ends the wait early."""
        if self.state is TemplateState.STARTING:
            left = self._ready_timeout - (time.monotonic() - self.started_at)
            deadline = time.monotonic() + max(0.0, left if timeout is None else
                                              min(timeout, left))
            while self.state is TemplateState.STARTING:
                if stop is not None and stop.is_set():
                    break
                self.pump(max(0.0, min(0.5, deadline - time.monotonic())))
                if self.state is TemplateState.STARTING and time.monotonic() >= deadline:
                    if time.monotonic() - self.started_at >= self._ready_timeout:
                        self._fail(f"not ready after {self._ready_timeout:g} s "
                                   "(agent.template_ready_timeout)")
                    break
        if self.state is TemplateState.READY:
            self.pump(0)
        return self.state is TemplateState.READY

    def stop(self) -> None:
        """End the template (its ranks die with it): the job is over here."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            kill_group(self._proc.pid, signal.SIGKILL)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("%s: worker template pid %d did not die", self.where(),
                          self._proc.pid)
        self._orphan_ranks()
        if self.state in (TemplateState.STARTING, TemplateState.READY):
            self.state = TemplateState.STOPPED

    def settle(self, timeout: float) -> bool:
        """Whether it is ready and none of the ranks it forked is left, reading their
        exits for up to ``timeout`` (a stopped group's ranks report as they go):
        only such a template may serve another job (template_pool.py)."""
        deadline = time.monotonic() + timeout
        while self.ready(0) and self._ranks and time.monotonic() < deadline:
            self.pump(min(0.1, max(0.0, deadline - time.monotonic())))
        if self.ready(0) and not self._ranks:
            self._statuses.clear()
            return True
        return False

    @property
    def boot_args(self) -> list:
        """What follows the interpreter in its command: the flags and the entry."""
        return list(self._boot_args or [])

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    def rss_bytes(self) -> int:
        """The template's resident memory (0 when it is not running)."""
        if self.state not in (TemplateState.STARTING, TemplateState.READY) or not self.pid:
            return 0
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    # -- forking -----------------------------------------------------------
    def fork(self, spec: workers.GroupSpec, rank: int, env: dict, args: list) \
            -> tuple[ForkedProcess | None, str]:
        """A rank forked from the template, or (None, why not) for a cold start."""
        if not self.ready(0):
            return None, self._unready()
        if entry_part(args) != entry_part(self._boot_args):
            return None, "the command differs from the template's"
        with workers.open_log(workers.log_file_path(spec.log_dir, rank)) as logf:
            return self._fork({"env": env, "cwd": spec.cwd, "args": args}, [logf.fileno()])

    def fork_helper(self, spec: workers.GroupSpec, args: list, env: dict, log_path: str) \
            -> tuple[ForkedProcess | None, socket.socket | None, str]:
        """A process of the job that is no rank, forked from the template: ``args``
        (what follows the interpreter: one of elasticd's own files, not the job's
        entry) run as a rank would be, its stdin and stdout the returned socket,
        its stderr ``log_path``. (None, None, why not) when it cannot be forked.
        It counts among the template's children: end it before ``settle``."""
        if not self.ready(0):
            return None, None, self._unready()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with workers.open_log(log_path) as logf:
                proc, why = self._fork({"env": env, "cwd": spec.cwd, "args": args,
                                        "helper": True}, [logf.fileno(), theirs.fileno()])
        finally:
            theirs.close()
        if proc is None:
            ours.close()
            return None, None, why
        return proc, ours, ""

    def _unready(self) -> str:
        """Why it forks nothing now: its state, and the reason when there is one."""
        return f"worker template {self.state.value}" + (f": {self.reason}" if self.reason
                                                         else "")

    def _fork(self, request: dict, fds: list) -> tuple[ForkedProcess | None, str]:
        """Send one fork request with ``fds`` and wait for its reply."""
        self._next_id += 1
        rid = self._next_id
        body = json.dumps({"op": "fork", "id": rid, **request}).encode()
        try:
            self._sock.setblocking(True)
            self._sock.settimeout(self._fork_timeout)
            try:
                socket.send_fds(self._sock, [len(body).to_bytes(4, "big")], fds)
                self._sock.sendall(body)
            finally:
                self._sock.setblocking(False)
        except OSError as exc:
            self._fail(f"its channel broke: {exc}")
            return None, f"worker template {self.reason}"
        deadline = time.monotonic() + self._fork_timeout
        while rid not in self._replies and self.state is TemplateState.READY:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"no answer to a fork request in {self._fork_timeout:g} s")
                break
            self.pump(min(left, 0.5))
        reply = self._replies.pop(rid, None)
        if reply is None:
            return None, f"worker template {self.state.value}: {self.reason}"
        if "refused" in reply:
            why = str(reply["refused"])[:300]
            self._unsafe = True
            self._fail(f"unsafe to fork: {why}")
            return None, f"worker template unsafe to fork: {why}"
        pid = reply.get("pid")
        if type(pid) is not int or not 1 < pid < 1 << 31 or pid in self._ranks:
            self._fail("a malformed fork reply")
            return None, "worker template sent a malformed reply"
        pidfd, wrong = pin_child(pid, self.pid, self.uid)
        if wrong:  # its user's code answered for it: never signal what it names
            self._unsafe = True
            self._fail(f"its fork reply named a process not its own: {wrong}")
            return None, "worker template named a process not its own"
        proc = ForkedProcess(self, pid, pidfd)
        self._ranks[pid] = proc
        if pid in self._statuses:
            proc.exited(os.waitstatus_to_exitcode(self._statuses.pop(pid)))
        return proc, ""

    # -- the channel -------------------------------------------------------
    def news_fd(self) -> int | None:
        """The channel's fd: readable when the template says something (a rank's exit)."""
        return self._sock.fileno() if self._sock is not None else None

    def pump(self, timeout: float, check: bool = True) -> None:
        """Read what the template said (waiting up to ``timeout`` for something)."""
        if self._sock is None:
            return
        try:
            readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        except (OSError, ValueError):
            readable = []
        if not readable:
            if check:
                self._check_alive()
            return
        while self._sock is not None:
            try:
                data = self._sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._fail(f"its channel broke: {exc}")
                return
            if not data:
                self._gone()
                return
            self._buf += data
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                self._message(line)
            if len(self._buf) > _MESSAGE_MAX:
                self._fail("it sent an overlong message")
                return

    def _message(self, line: bytes) -> None:
        try:  # the template runs the job's user's imports: its lines are untrusted
            msg = values.decode(line, max_bytes=_MESSAGE_MAX, want=None)
        except values.BadValue as bad:
            self._fail(f"it sent a malformed message ({bad.why.value})")
            return
        if not isinstance(msg, dict):
            return
        if "exit" in msg:
            pid, status = msg.get("exit"), msg.get("status")
            if type(pid) is int and type(status) is int and 0 < pid < 1 << 31 \
                    and 0 <= status < 1 << 16:
                proc = self._ranks.pop(pid, None)
                if proc is not None:
                    proc.exited(os.waitstatus_to_exitcode(status))
                else:
                    self._statuses[pid] = status  # its fork reply is still to come
                    while len(self._statuses) > _UNCLAIMED_MAX:  # (a template that lies)
                        del self._statuses[next(iter(self._statuses))]
        elif "ready" in msg and self.state is TemplateState.STARTING:
            if msg.get("unsafe"):
                self._unsafe = True
                self._fail(f"unsafe to fork: {str(msg['unsafe'])[:300]}")
                return
            self.state, self.was_ready = TemplateState.READY, True
            self.ready_seconds = time.monotonic() - self.started_at
            self.env_reads = EnvReads.of_message(msg.get("env_read"))
            log.info("%s: worker template ready in %.2f s (pid %d, %d modules; its imports "
                     "read %s)", self.where(), self.ready_seconds, self.pid,
                     msg["modules"] if type(msg.get("modules")) is int else 0,
                     self.env_reads.describe())
        elif msg.get("id") == self._next_id and type(msg["id"]) is int:  # the one asked
            self._replies[msg["id"]] = msg

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None \
                and self.state in (TemplateState.STARTING, TemplateState.READY):
            self.pump(0.05, check=False)  # its last words first (exit statuses)
            if self.state in (TemplateState.STARTING, TemplateState.READY):
                self._gone()

    def _gone(self) -> None:
        """Its end of the channel closed: it exited (or is about to)."""
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:  # it closed the channel and lives on
                kill_group(self._proc.pid, signal.SIGKILL)
        what = workers.describe_exit(code)[2] if code is not None else "closed its channel"
        whose = "" if self.log_job == self.job_id else f" of job {self.log_job}"
        self._fail(f"it exited ({what}); see template.log{whose}")

    def _fail(self, reason: str, state: TemplateState = TemplateState.FAILED) -> None:
        if state is TemplateState.FAILED:
            log.warning("%s: worker template unusable: %s; ranks start cold", self.where(),
                        reason)
        self.state, self.reason = state, reason
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None and self._proc.poll() is None:
            kill_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._orphan_ranks()

    def _orphan_ranks(self) -> None:
        """The ranks of a template that is gone died with it (PDEATHSIG); make sure,
        and let them read as killed by SIGKILL."""
        for proc in self._ranks.values():
            proc.signal_group(signal.SIGKILL)
            proc.exited(-signal.SIGKILL)
        self._ranks.clear()
        self._statuses.clear()


def template_log_path(log_dir: str) -> str:
    return os.path.join(log_dir, "template.log")
