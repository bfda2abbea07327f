"""Progress beats from a worker process to its elasticd daemon.

elasticd puts this file's directory first on every worker's PYTHONPATH, so a
training script can call it without elasticd being installed in its own
environment::

    from elasticd_heartbeat import heartbeat
    for batch in loader:
        ...
        heartbeat()      # once per unit of progress

Scripts that step a ``torch.optim`` optimizer need not call it: the
``sitecustomize`` next to this file makes every optimizer step beat.

A beat touches the file named by ``ELASTICD_HEARTBEAT_FILE`` (one per rank,
in the job's run directory); the daemon reads its modification time. The
first beat of a process writes the process id into the file, so the daemon
knows which process to ask for a stack dump; when that process exits, after
its non-daemon threads have ended, it writes ``<pid> exiting`` there, so the
daemon gives its interpreter shutdown the long allowance, not the hang limits. Beats are rate-limited to one
per ``MIN_INTERVAL`` seconds, so calling this on every step costs one clock
read. It never raises: a missing or unwritable file only means no beats.

Keep this module importable by any Python 3 and free of heavy imports: it is
loaded at start-up of every worker process, torch or not.
"""
import atexit
import os
import time

ENV_VAR = "ELASTICD_HEARTBEAT_FILE"
MIN_INTERVAL = 0.1  # seconds; at most ~10 file touches a second

_last = 0.0        # the latest beat written (monotonic)
_last_call = 0.0   # the latest call, written or not (monotonic): see last_beat()
_owner_pid = 0    # the process whose id the file holds (written by this process)
_path = None      # resolved lazily: a warm spare learns its identity after start
_exit_hooked = False


def heartbeat():
    """Tell the daemon this rank made progress. Cheap; safe to call anywhere."""
    global _last, _last_call, _owner_pid, _path, _exit_hooked
    now = _last_call = time.monotonic()
    if now - _last < MIN_INTERVAL:
        return
    _last = now
    if _path is None:
        _path = os.environ.get(ENV_VAR, "")
    if not _path:
        return
    pid = os.getpid()
    try:
        if _owner_pid != pid:
            # Written, not only touched: the daemon signals the process named here.
            _write("%d\n" % pid)
            _owner_pid = pid
            if not _exit_hooked:
                atexit.register(_at_exit)
                _exit_hooked = True
        else:
            os.utime(_path, None)
    except OSError:
        # The file vanished or cannot be written: write it afresh next time.
        _owner_pid = -1


def last_beat():
    """``time.monotonic()`` of the latest ``heartbeat()`` call in this process (0: none)."""
    return _last_call


def _write(text):
    fd = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _at_exit():
    """The training is over: tell the daemon the silence that follows is shutdown."""
    if _path and _owner_pid == os.getpid():
        try:
            _write("%d exiting\n" % _owner_pid)
        except OSError:
            pass


def _optimizer_step_hook(optimizer, args, kwargs):
    """``torch.optim`` global step post-hook: one beat per optimizer step."""
    heartbeat()
