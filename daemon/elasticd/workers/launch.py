"""Starting one process of a job as the job's user: its uid, gid and groups, its own
session, dies with the daemon's thread, enters the job's cwd only once it is that user,
output appended to its log (workers/group.py says why each)."""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess

from .. import statedir
from .libc import LIBC
from .signals import kill_group
from .spec import GroupSpec

_PR_SET_PDEATHSIG = 1
# The umask workers start with, whatever the daemon's own (systemd gives it
# 0077, so its records and logs are private): a login's default, so a job's
# checkpoints and outputs get the modes its user expects.
WORKER_UMASK = 0o022
# The priority a job's processes start at, whatever the daemon's own (daemon.nice):
# a login's default. Raising a nice value needs no privilege, so the job's user sets it.
WORKER_NICE = 0
_prctl = LIBC.prctl


def _child_setup(cwd: bytes, cpus: tuple = ()):
    """What the child runs between fork and exec, after subprocess switched it to
    the job's uid/gid/groups (it does so before calling this): die with the
    thread that started it, back to WORKER_NICE from the daemon's priority, then
    enter the job's directory as the job's user.

    Popen's own ``cwd=`` would chdir while still root, before the switch, so
    a user could run in (and learn about) directories she cannot enter.
    Only syscall wrappers on a ready-made bytes path run here: the daemon is
    multi-threaded and this runs in a forked copy of it. ``cpus``: the CPUs the
    process (and all it starts) may run on (``--cpu-bind numa``), set before exec
    so even the interpreter's first threads inherit it.
    """
    def setup() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, WORKER_NICE)
        except OSError:  # a daemon started above it (nice 5, not root): stays there
            pass
        if cpus:
            os.sched_setaffinity(0, cpus)
        os.chdir(cwd)
    return setup


def cwd_unusable(cwd: str, uid: int) -> str:
    """The one message for a working directory a job cannot use: missing and not
    accessible read the same, so nobody learns which hidden paths exist."""
    return f"working directory {cwd[:200]} does not exist or is not accessible to uid {uid}"


class SpawnError(Exception):
    """A worker could not be started (bad command, cwd, user...)."""


def log_file_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank-{rank}.log")


def open_log(path: str):
    """A rank's log for appending: root's, 0600 (its user reads it through
    elasticctl), O_APPEND so the daemon's rotation can truncate it under a
    worker that keeps writing (logfiles.LogKeeper)."""
    return open(statedir.open_private(path), "ab", buffering=0)


def start_job_process(spec: GroupSpec, argv: list, env: dict, log_path: str,
                      pass_fds: tuple = (), pipes: bool = False) -> subprocess.Popen:
    """A process of the job that is no rank (the worker template, a job store, a round
    store server): the same start as a worker's (``start_process``), its output to
    ``log_path``; stdin /dev/null, or with ``pipes`` a pipe each way to the daemon
    (stdout then carries its answers, stderr still goes to ``log_path``). End one
    with pipes with ``end_helper``."""
    pipe = subprocess.PIPE if pipes else None
    return start_process(spec, argv, -1, env, as_user_kwargs(spec.uid, spec.gid), stdin=pipe,
                         stdout=pipe, log_path=log_path, pass_fds=pass_fds)


def start_process(spec: GroupSpec, argv: list, rank: int, env: dict, user_kwargs: dict,
                  stdin, stdout=None, log_path: str | None = None,
                  pass_fds: tuple = ()) -> subprocess.Popen:
    """Start one process of the job: its user, its own session (setsid: its own process
    group, no controlling terminal), dies with us.

    Its output goes to the rank's log, or ``log_path`` (stderr always; stdout
    unless given). It enters ``spec.cwd`` only once it is the job's user; a
    directory that user cannot enter fails the start (``cwd_unusable``)."""
    with open_log(log_path or log_file_path(spec.log_dir, rank)) as logf:
        try:
            return subprocess.Popen(
                argv, env=env,
                stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=logf if stdout is None else stdout,
                stderr=logf if stdout is not None else subprocess.STDOUT, close_fds=True,
                pass_fds=pass_fds,
                start_new_session=True,
                preexec_fn=_child_setup(os.fsencode(spec.cwd), spec.cpus),
                umask=WORKER_UMASK, **user_kwargs)
        except subprocess.SubprocessError:
            # The only step of _child_setup that can fail is the chdir.
            raise SpawnError(cwd_unusable(spec.cwd, spec.uid)) from None
        except FileNotFoundError:
            raise SpawnError(not_found(argv[0], env)) from None
        except PermissionError as exc:
            raise SpawnError(f"cannot run {argv[0]}: {exc.strerror}") from None
        except OSError as exc:
            raise SpawnError(f"cannot start {argv[0]}: {exc}") from None


def not_found(command: str, env: dict) -> str:
    """``command not found: python``, with a hint where the job's PATH has python3 (as
    Debian and Ubuntu do: no ``python`` unless a venv is active)."""
    text = f"command not found: {command}"
    if command == "python" and shutil.which("python3", path=env.get("PATH", os.defpath)):
        text += " (the job's PATH has python3: submit `-- python3 ...`)"
    return text


def end_helper(proc: subprocess.Popen) -> None:
    """End a job's helper process started by ``start_job_process(..., pipes=True)`` (a
    job store, a round store server): SIGKILL its group, reap it, close its pipes."""
    kill_group(proc.pid, signal.SIGKILL)
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe:
            try:
                pipe.close()
            except OSError:
                pass


def as_user_kwargs(uid: int, gid: int) -> dict:
    """Popen arguments that run the worker as uid/gid (only root can switch)."""
    if uid == os.geteuid() and gid == os.getegid():
        return {}
    if os.geteuid() != 0:
        raise SpawnError(f"this daemon runs as uid {os.geteuid()} and cannot start workers "
                         f"as uid {uid}")
    try:
        name = pwd.getpwuid(uid).pw_name
        groups = os.getgrouplist(name, gid)
    except KeyError:
        groups = [gid]
    return {"user": uid, "group": gid, "extra_groups": groups}


def can_enter(cwd: str, uid: int, gid: int, timeout: float) -> bool:
    """Whether uid/gid (with uid's groups) can enter ``cwd``: asked of the kernel by a
    shell that is that user and ``cd``s there (this process cannot switch: it has
    threads). A shell that does not answer within ``timeout`` counts as no."""
    try:
        kwargs = as_user_kwargs(uid, gid)
    except SpawnError:
        return False
    try:
        return subprocess.run(["/bin/sh", "-c", 'cd -- "$1"', "sh", cwd], env={},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, close_fds=True, timeout=timeout,
                              start_new_session=True, **kwargs).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
