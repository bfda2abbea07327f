"""One helper process of a job on this node (a round store server, a job store): ``JobHelper``.

A helper runs one of elasticd's own files (``jobstore/round_server.py``,
``jobstore/server.py``) as the job's user; it needs torch, which the daemon
never imports. It is forked from the job's worker template when that is
ready (workers/template.py ``fork_helper``: torch is imported there already,
so no second interpreter spends ~2.6 s of CPU and a torch-sized RSS on it),
else started with the job's Python (``start_job_process``, the spawn path of
the workers). Either way it speaks lines: it reads the daemon's on its
stdin and answers on its stdout (a pipe each way, or for a forked one a
socketpair), and exits when its stdin closes. A forked helper is one of the
template's children: ``stop`` it before the template goes back to the pool
(its exit is what the template reports).

Owned by the job's agent thread, as the template is; no locks.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time

from ..workers.forked import ForkedProcess
from ..workers.group import GroupSpec, base_env, end_helper, prepare_dirs, start_job_process
from ..workers.template import TemplateState, WorkerTemplate

_LINE_MAX = 200
_STOP_WAIT = 5.0   # seconds a forked helper's SIGKILL is waited for (its template reports it)


class JobHelper:
    def __init__(self) -> None:
        self._proc: subprocess.Popen | ForkedProcess | None = None
        self._chan: socket.socket | None = None   # a forked helper's stdin and stdout
        self._buf = b""
        self.template_pid = 0                     # the template it was forked from, or 0

    @property
    def running(self) -> bool:
        """Started and not seen to exit."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def started(self) -> bool:
        return self._proc is not None

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    def exit_code(self) -> int | None:
        """Its exit code once it exited (None while it runs or was never started)."""
        return self._proc.poll() if self._proc is not None else None

    def launch(self, template: WorkerTemplate | None, spec: GroupSpec, args: list,
               log_path: str, wait: float, stop=None) -> str | None:
        """Start it: forked from ``template`` once ready (one still importing is waited
        for up to ``wait`` seconds; a set ``stop``, a threading.Event, ends the wait),
        else spawned with the job's Python. "" when it was forked, else why not (it was
        spawned); None when ``stop`` ended the wait (nothing started). Raises
        SpawnError when it cannot be started at all."""
        if template is not None and template.state is TemplateState.STARTING:
            template.ready(wait, stop)
            if template.state is TemplateState.STARTING and stop is not None \
                    and stop.is_set():
                return None
        self.stop()
        prepare_dirs(spec)
        why = self._fork(template, spec, args, log_path) \
            if template is not None and template.ready(0) else "no worker template ready"
        if why:
            self._proc = start_job_process(spec, [spec.command[0], *args], base_env(spec),
                                           log_path, pipes=True)
        return why

    def _fork(self, template: WorkerTemplate, spec: GroupSpec, args: list,
              log_path: str) -> str:
        """``args`` (one of elasticd's files and its arguments) forked from the ready
        ``template``; "" when it was, else why not (nothing started)."""
        proc, chan, why = template.fork_helper(spec, args, base_env(spec), log_path)
        if proc is None:
            return why
        self._proc, self._chan, self.template_pid = proc, chan, template.pid
        return ""

    def send(self, data: bytes) -> bool:
        """Write ``data`` to its stdin; False when it is gone."""
        try:
            if self._chan is not None:
                self._chan.sendall(data)
            elif self._proc is not None:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()
            else:
                return False
        except (BrokenPipeError, OSError, ValueError):
            return False
        return True

    def read_line(self, timeout: float) -> str | None:
        """One line of its stdout within ``timeout`` seconds; None if none (or EOF);
        "<line too long>" for one over the helpers' line limit."""
        if self._proc is None:
            return None
        fd = self._chan.fileno() if self._chan is not None else self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
            if not ready:
                return None
            try:
                chunk = os.read(fd, 4096)
            except OSError:       # a forked helper's socket reset: it died with its template
                return None
            if not chunk:
                return None
            self._buf += chunk
            if len(self._buf) > _LINE_MAX:
                return "<line too long>"
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def wait_line(self, timeout: float, stop=None) -> str | None:
        """Its next line (``read_line``), waited for in slices up to ``timeout`` seconds:
        None when it did not come (it exited, the time ran out, or ``stop`` was set)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            line = self.read_line(max(0.0, min(0.1, left)))
            if line is not None or left <= 0 or self.exit_code() is not None \
                    or (stop is not None and stop.is_set()):
                return line

    def stop(self) -> None:
        """End it (its process group, SIGKILL) and wait for it: a spawned one is reaped
        here, a forked one by its template, which reports it."""
        proc, self._proc, self._buf, self.template_pid = self._proc, None, b"", 0
        chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()
        if isinstance(proc, ForkedProcess):
            proc.signal_group(signal.SIGKILL)
            try:
                proc.wait(timeout=_STOP_WAIT)   # gone, as a spawned one is once reaped
            except subprocess.TimeoutExpired:
                pass  # a template that says nothing more: it fails on its own (fork timeout)
        elif proc is not None:
            end_helper(proc)
