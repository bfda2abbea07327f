"""Progress beats from a worker process to its elasticd daemon: the worker contract.

elasticd puts this file's directory first on every worker's PYTHONPATH, so a
training script can call it without elasticd being installed in its own
environment::

    from elasticd_heartbeat import heartbeat, elasticd_section
    for batch in loader:
        ...
        heartbeat()                      # once per unit of progress (a step)
    with elasticd_section("data"):       # a phase the script knows is long
        rebuild_the_dataset()

Most scripts need neither: the ``sitecustomize`` next to this file beats on
every ``torch.optim`` optimizer step (phase ``train``), on module forward
passes (phase ``forward``: evaluation loops beat too), and marks
``torch.save`` / ``torch.load`` / ``torch.distributed.checkpoint`` save and
load as phase ``checkpoint`` (a beat on entry and one at exit).

The channel (this module defines it; the daemon parses it with
``parse_record`` below, loaded from this very file): one file per rank,
named by ``ELASTICD_HEARTBEAT_FILE``, holding one record of ``RECORD_BYTES``
bytes, rewritten in place (never truncated, so a reader never sees it empty)::

    <pid> <phase> <steps> <busy_us>            (space-padded, then a newline)

* ``pid``: the process that beats (the daemon asks it for a stack dump);
* ``phase``: ``train``, ``forward``, ``checkpoint``, ``section:<name>``
  (name: letters, digits, ``_ . -``, at most ``NAME_MAX``), ``wait``
  (``keepalive()``: waiting on other ranks, e.g. at an in-process restart's
  barrier: alive, not progressing), ``barrier`` (inside
  ``torch.distributed.barrier``: waiting for every rank, e.g. for the one
  that writes a checkpoint), or ``exiting``
  (written at exit, after the non-daemon threads ended: the silence that
  follows is interpreter shutdown);
* ``steps``: optimizer steps plus ``heartbeat()`` calls of this process;
* ``busy_us``: microseconds of its own work summed over those steps: from
  the end of one step to the end of the last forward pass before the next
  (the whole step when there was no forward pass). Time spent waiting for
  slower ranks in a collective falls after the forward pass, so the rank
  with the most work per step is the straggler even when every rank steps
  at the same pace.

Only the rank's own process writes: a child it forks or spawns (DataLoader
workers, which may call torch.load) inherits this module or its
environment, but never writes. A beat is a new record; every write also sets the file's mtime to a value
above the previous one, so the daemon's cheap ``lstat`` sees each write,
even two within one tick of a coarse filesystem clock. Writes in the same
phase are rate-limited to one per ``MIN_INTERVAL`` seconds (a call in
between costs one clock read); a change of phase is written at once. It
never raises: a missing or unwritable file only means no beats.

Keep this module importable by any Python 3 and free of heavy imports: it is
loaded at start-up of every worker process, torch or not.
"""
import atexit
import functools
import os
import sys
import time

# The worker contract (elasticd/workers/env.py): copies, as this file runs without
# elasticd on the path; tests/test_worker_env.py checks them equal.
ENV_VAR = "ELASTICD_HEARTBEAT_FILE"
MIN_INTERVAL = 0.1  # seconds; at most ~10 same-phase writes a second
RECORD_BYTES = 96
NAME_MAX = 32

TRAIN = "train"
FORWARD = "forward"
CHECKPOINT = "checkpoint"
SECTION_PREFIX = "section:"
EXITING = "exiting"
WAIT = "wait"
BARRIER = "barrier"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

_mono = time.monotonic
_last = 0.0         # the latest record written (monotonic)
_last_call = 0.0    # the latest beat, written or not (monotonic): see last_beat()
_written_phase = None
_written_ns = 0     # mtime (ns) given to the latest write
_owner_pid = 0      # the process that wrote the file (a forked child must write afresh)
_path = None        # resolved lazily: a warm spare learns its identity after start
_exit_hooked = False
_steps = 0
_busy_us = 0
_step_end = 0.0     # monotonic end of the latest step (0: none yet)
_forward_end = 0.0  # monotonic end of the latest forward pass
_steady = TRAIN     # what the rank does between bracketed phases: train or forward
_stack = []         # bracketed phases entered and not yet left, innermost last
_import_pid = os.getpid()  # the rank's own process; a forked child (a DataLoader worker)
                           # inherits this value and must not speak for the rank


# ---------------------------------------------------------------- the record

def format_record(pid, phase, steps, busy_us):
    """The bytes of one record (always ``RECORD_BYTES`` long)."""
    text = "%d %s %d %d" % (pid, phase, steps, busy_us)
    return (text[:RECORD_BYTES - 1].ljust(RECORD_BYTES - 1) + "\n").encode("ascii")


def valid_phase(phase):
    if phase in (TRAIN, FORWARD, CHECKPOINT, EXITING, WAIT, BARRIER):
        return True
    name = phase[len(SECTION_PREFIX):] if phase.startswith(SECTION_PREFIX) else ""
    return 0 < len(name) <= NAME_MAX and all(c in _NAME_CHARS for c in name)


def parse_record(data):
    """``(pid, phase, steps, busy_us)`` from a record's bytes, or None if malformed.

    The reader is the daemon and the writer an untrusted process: every field
    is checked. Older single-field records (``<pid>``) read as phase train.
    """
    try:
        words = data[:RECORD_BYTES].decode("ascii").split()
    except (UnicodeDecodeError, AttributeError):
        return None
    if not 1 <= len(words) <= 4 or not all(len(w) <= 20 for w in words):
        return None
    phase = words[1] if len(words) > 1 else TRAIN
    numbers = [words[0]] + words[2:]
    if not all(w.isdigit() and w.isascii() for w in numbers) or not valid_phase(phase):
        return None
    pid = int(words[0])
    steps = int(words[2]) if len(words) > 2 else 0
    busy = int(words[3]) if len(words) > 3 else 0
    if not 0 < pid < 1 << 31:
        return None
    return pid, phase, steps, busy


def section_phase(name):
    """The phase of ``elasticd_section(name)``: the name cleaned to what the contract allows."""
    clean = "".join(c if c in _NAME_CHARS else "_" for c in str(name))[:NAME_MAX]
    return SECTION_PREFIX + (clean or "unnamed")


# ---------------------------------------------------------------- beating

def heartbeat():
    """Tell the daemon this rank made a step of progress. Cheap; safe to call anywhere."""
    _step()


def keepalive():
    """Say this rank is alive but waiting (on other ranks, between restarts): phase wait."""
    global _last_call
    now = _last_call = _mono()
    if now - _last >= MIN_INTERVAL or _written_phase != WAIT:
        _write_record(now, WAIT)


def current_phase():
    return _stack[-1] if _stack else _steady


def steps():
    """Steps (optimizer steps and ``heartbeat()`` calls) of this process so far."""
    return _steps


def last_beat():
    """``time.monotonic()`` of the latest beat in this process (0: none)."""
    return _last_call


def _step():
    """One unit of progress: count it and its own work time, then beat."""
    global _steps, _busy_us, _step_end, _last_call, _steady
    now = _last_call = _mono()
    if _step_end:
        end = _forward_end if _forward_end > _step_end else now
        _busy_us += int((end - _step_end) * 1e6)
    _steps += 1
    _step_end = now
    if _steps == 1:
        _report_imports()
    if not _stack:
        _steady = TRAIN
    if now - _last >= MIN_INTERVAL or _written_phase != current_phase():
        _write_current(now)


def forward_hook(module, args, output):
    """torch's global module forward hook: called after every module's forward."""
    global _forward_end, _last_call
    now = _forward_end = _last_call = _mono()
    if now - _last >= MIN_INTERVAL:
        _forward_beat(now)


def _forward_beat(now):
    global _steady
    if not _stack and _step_end < now - MIN_INTERVAL * 2:
        _steady = FORWARD  # forward passes with no step between them: evaluation
    _write_current(now)


def optimizer_step_hook(optimizer, args, kwargs):
    """``torch.optim`` global step post-hook: one step per optimizer step."""
    _step()


def _enter(phase):
    global _last_call
    _stack.append(phase)
    _last_call = _mono()
    _write_current(_last_call)


def _leave(phase):
    global _last_call
    for i in range(len(_stack) - 1, -1, -1):
        if _stack[i] == phase:
            del _stack[i]
            break
    _last_call = _mono()
    _write_current(_last_call)


class elasticd_section(object):
    """``with elasticd_section("data"): ...``: a named phase the daemon times on its own.

    The first time a job is inside a section, the daemon allows it the fixed
    upper bound (``agent.hang_hard_timeout``); afterwards the timeout it
    learned from that section's earlier runs. Sections nest.
    """

    def __init__(self, name):
        self.phase = section_phase(name)

    def __enter__(self):
        _enter(self.phase)
        return self

    def __exit__(self, *exc):
        _leave(self.phase)
        return False


def in_phase(phase, fn):
    """Wrap ``fn`` so that its run is ``phase`` (a beat on entry, one at exit)."""
    if getattr(fn, "__elasticd_phase__", None) == phase:
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        _enter(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            _leave(phase)
    wrapped.__elasticd_phase__ = phase
    return wrapped


# ---------------------------------------------------------------- the file

def _write_current(now):
    _write_record(now, current_phase())


def _write_record(now, phase):
    global _last, _owner_pid, _path, _exit_hooked, _written_phase, _written_ns
    _last = now
    pid = os.getpid()
    if pid != _import_pid:
        return  # a forked child (DataLoader worker, ...): only the rank's process beats
    if _path is None:
        _path = "" if _spawned_child() else os.environ.get(ENV_VAR, "")
    if not _path:
        return
    try:
        fd = os.open(_path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            os.write(fd, format_record(pid, phase, _steps, _busy_us))
            # Each write a later mtime than the last, even within one coarse clock tick.
            _written_ns = max(time.time_ns(), _written_ns + 1)
            if os.utime in getattr(os, "supports_fd", ()):
                os.utime(fd, ns=(_written_ns, _written_ns))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return  # the file vanished or cannot be written: try afresh next time
    _written_phase = phase
    if _owner_pid != pid:
        _owner_pid = pid
        if not _exit_hooked:
            atexit.register(_at_exit)
            _exit_hooked = True


PRELOAD_ENV = "ELASTICD_PRELOAD_REPORT"
PRELOAD_MAX = 64


def _report_imports():
    """At the rank's first step: the top-level non-stdlib modules it imported, one a
    line, into ``ELASTICD_PRELOAD_REPORT`` (the daemon's learned preload, workers/preload.py)."""
    path = os.environ.get(PRELOAD_ENV, "")
    std = getattr(sys, "stdlib_module_names", None)
    if not path or std is None or os.getpid() != _import_pid or _spawned_child():
        return
    try:
        skip = set(std) | set(sys.builtin_module_names) | {
            "sitecustomize", "usercustomize", "elasticd_heartbeat"}
        names = []
        for name in sorted({n.split(".")[0] for n in list(sys.modules)}):
            if name in skip or name.startswith("_") or name in names:
                continue
            if getattr(sys.modules.get(name), "__file__", None):
                names.append(name)
        data = ("\n".join(names[:PRELOAD_MAX]) + "\n").encode("ascii", "replace")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                     | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except Exception:
        pass


def become_new_process():
    """Called by elasticd's worker template in a child it forked to be a rank:
    this process speaks for the rank now, with nothing of the template's state."""
    global _last, _last_call, _written_phase, _written_ns, _owner_pid, _path, _steps
    global _busy_us, _step_end, _forward_end, _steady, _import_pid
    _last = _last_call = _step_end = _forward_end = 0.0
    _written_phase, _written_ns, _owner_pid, _path = None, 0, 0, None
    _steps = _busy_us = 0
    _steady = TRAIN
    del _stack[:]
    _import_pid = os.getpid()


def _spawned_child():
    """A process a rank started with multiprocessing (spawn or forkserver): not the rank."""
    mp = sys.modules.get("multiprocessing")
    try:
        return mp is not None and mp.parent_process() is not None
    except Exception:
        return False


def _at_exit():
    """The training is over: tell the daemon the silence that follows is shutdown."""
    if _path and _owner_pid == os.getpid():
        _write_record(_mono(), EXITING)
