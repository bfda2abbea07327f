"""Bootstrap of a warm spare worker: import the heavy modules, then wait.

The daemon starts this file by path with the job's own Python interpreter
(so it needs nothing of elasticd installed there), as the job's user, in
the job's directory and environment, as ``python workers/warmstart.py ARGS`` where
ARGS is what follows the interpreter in the job's command. It imports torch
ahead of need, then blocks on stdin for one JSON line: the worker's full
environment and its command line. It then becomes that worker exactly as
``python [-u] SCRIPT ARGS`` or ``python [-u] -m MODULE ARGS`` would, minus
the seconds of interpreter start and torch import. EOF on stdin means "not
needed": exit 0.

Before it imports anything, ``sys.path[0]`` is what the cold start of the
job's command would have (``entry_path``): the script's real directory, or
the working directory for ``-m``, or nothing under ``-P``/PYTHONSAFEPATH;
never the working directory for a script, where anyone who can write it
could plant a ``torch.py``.

Nothing here may print before the assignment arrives except import errors.

``python workers/warmstart.py --template FD ARGS`` is the job's worker template
(workers/template.py is its daemon side): the same start and preload, then
it serves requests on FD, a socketpair end only the daemon holds, and forks
one child per rank that becomes that rank (``_serve``, ``_become_rank``).
"""
import json
import os
import runpy
import sys
import time

TEMPLATE_FLAG = "--template"
# The worker contract (workers/env.py; runs without elasticd on the path, so copies,
# checked equal by tests/test_worker_env.py).
WARM_PRELOAD_ENV = "ELASTICD_WARM_PRELOAD"
LEARNED_PRELOAD_ENV = "ELASTICD_LEARNED_PRELOAD"


def entry_path(args: list) -> str | None:
    """``sys.path[0]`` of a cold ``python ARGS`` in the current directory, as CPython
    computes it: ``-m``: the working directory (getcwd, links resolved); a
    script: the directory of its realpath, or of the path as given when it
    cannot be resolved ("" when that has no directory). None when the cold
    start would not exist (no arguments) or prepend nothing (safe_path).
    """
    if getattr(sys.flags, "safe_path", False):
        return None
    args = list(args)
    while args and args[0] in ("-u", "-B"):
        args.pop(0)
    if not args:
        return None
    if args[0] == "-m":
        return os.getcwd()
    script = args[0]
    try:
        script = os.path.realpath(script, strict=True)
    except (OSError, TypeError):  # 3.10- has no strict: the script must exist anyway
        if not os.path.exists(script):
            return os.path.dirname(script)
        script = os.path.realpath(script)
    return os.path.dirname(script)


def _set_entry(args: list) -> bool:
    """Replace this file's directory at sys.path[0] by the job's entry; False when
    the job's script is not there (nothing may be imported from a guess)."""
    # Python put this file's directory first (unless safe_path put nothing): the
    # worker must not see elasticd's modules as top-level ones.
    ours = os.path.dirname(os.path.realpath(__file__))
    if sys.path and sys.path[0] == ours:
        del sys.path[0]
    entry = entry_path(args)
    if entry is not None:
        sys.path.insert(0, entry)
    rest = [a for a in args if a not in ("-u", "-B")]
    return bool(rest) and (rest[0] == "-m" or os.path.isfile(rest[0]))


def _preload() -> None:
    names = os.environ.get(WARM_PRELOAD_ENV, "torch,torch.distributed")
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            __import__(name)
        except Exception:  # the worker will import it itself and see the error
            pass


def _not_ours(filename: str) -> bool:
    """A frame of the job's code, not of this bootstrap or of runpy (which ran it)."""
    return filename != __file__ and os.path.basename(filename) not in ("runpy.py",
                                                                       "<frozen runpy>")


def _user_frames_only(hook):
    """``hook`` (sys.excepthook), shown the traceback from the job's first frame on, as a
    cold ``python SCRIPT`` prints it: the frames of this file and runpy that ran the
    job are left out (whole, when the job raised none of its own)."""
    def excepthook(kind, value, tb):
        head = tb
        while head is not None and not _not_ours(head.tb_frame.f_code.co_filename):
            head = head.tb_next
        if head is not None and isinstance(value, BaseException):
            value.__traceback__ = head  # what the default hook prints, whatever it is given
            tb = head
        hook(kind, value, tb)
    return excepthook


def _become(assignment: dict, boot_args: list) -> None:
    sys.excepthook = _user_frames_only(sys.excepthook)
    os.environ.clear()
    os.environ.update(assignment["env"])
    os.chdir(assignment["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # workers get /dev/null on stdin, as when spawned directly
    os.close(devnull)
    args = list(assignment["args"])  # what follows the interpreter on the command line
    if args != boot_args:  # not the command this spare was started for: its entry
        if sys.path and sys.path[0] == entry_path(boot_args):
            del sys.path[0]
        _set_entry(args)
    while args and args[0] in ("-u", "-B"):
        args.pop(0)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        runpy.run_path(os.path.abspath(args[0]), run_name="__main__")  # __file__ as cold


# ------------------------------------------------------------ the worker template
#
# Requests, daemon -> template: a 4-byte big-endian length, then that many
# bytes of JSON. A "fork" request carries the rank's log as one SCM_RIGHTS
# descriptor sent with its length header. Replies and news, template ->
# daemon: one JSON object per line: {"ready": ...} once after the preload,
# {"id": N, "pid": P} or {"id": N, "refused": WHY} per fork request, and
# {"exit": PID, "status": WAITSTATUS} for each child the template reaped.

_REQUEST_MAX = 64 << 20


def _fork_unsafe() -> str:
    """Why forking now would not give the rank a sane process, or ""."""
    import threading
    if threading.active_count() != 1:
        return "the template runs %d Python threads" % threading.active_count()
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        tasks = 1
    if tasks != 1:
        return "the template runs %d native threads" % tasks
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return "the template initialised CUDA"
    except Exception:
        return "the template cannot tell whether CUDA is initialised"
    return ""


def _send(sock, message: dict) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _read_request(sock):
    """(request dict, received fds) or (None, []) at EOF."""
    import socket
    head, fds, _, _ = socket.recv_fds(sock, 4, 1)
    while head and len(head) < 4:
        more = sock.recv(4 - len(head))
        if not more:
            return None, fds
        head += more
    if len(head) < 4:
        return None, fds
    size = int.from_bytes(head, "big")
    if size > _REQUEST_MAX:
        return None, fds
    body = bytearray()
    while len(body) < size:
        chunk = sock.recv(min(size - len(body), 1 << 20))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(bytes(body)), fds


def _reap(sock) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "status": status})


def _serve(fd: int):
    """Serve the daemon until it asks for a rank; returns (request, log fd) in the
    forked child, exits in the template when the daemon hangs up."""
    import select
    import signal
    import socket
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    old_chld = signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    unsafe = _fork_unsafe()
    _send(sock, {"ready": True, "pid": os.getpid(), "unsafe": unsafe,
                 "modules": len(sys.modules)})
    while True:
        try:
            readable, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock not in readable:
            continue
        request, fds = _read_request(sock)
        if request is None:  # the daemon hung up: the job ended (the ranks die with us)
            os._exit(0)
        log_fd = fds[0] if fds else -1
        why = _fork_unsafe() or ("" if log_fd >= 0 else "no log descriptor came with it")
        if why:
            _send(sock, {"id": request.get("id"), "refused": why})
            _close(fds)
            continue
        template_pid = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # The rank: nothing of the template's service may stay with it.
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, old_chld)
            _close([wake_r, wake_w, sock.detach()] + fds[1:])
            return request, log_fd, template_pid
        _close(fds)
        _send(sock, {"id": request.get("id"), "pid": pid})


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _become_rank(request: dict, log_fd: int, template_pid: int, boot_args: list) -> None:
    """In the forked child: become the rank as a cold start would be, then run it."""
    import ctypes
    import ctypes.util
    import signal
    os.setsid()  # its own session and process group, as the daemon's workers
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the template
    if os.getppid() != template_pid:  # the template died before that took effect
        os._exit(1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    beats = sys.modules.get("elasticd_heartbeat")
    if beats is not None and hasattr(beats, "_become_new_process"):
        beats._become_new_process()  # the template imported it: this is a rank of its own
    _become(request, boot_args)


def _preload_learned(timeout: float = 60.0) -> None:
    """Import the modules the daemon learned this job uses (workers/preload.py), only those a
    throw-away child imported without error and without starting a thread or CUDA."""
    import select
    names = [n for n in os.environ.get(LEARNED_PRELOAD_ENV, "").split(",") if n]
    if not names:
        return
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe
        os.close(rfd)
        ok = []
        for name in names:
            try:
                __import__(name)
            except BaseException:
                continue
            if _fork_unsafe():
                break  # this one started something: it and the rest stay out
            ok.append(name)
        os.write(wfd, ",".join(ok).encode())
        os._exit(0)
    os.close(wfd)
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([rfd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(rfd, 65536) if readable else b""
        if not chunk:
            break
        data += chunk
    os.close(rfd)
    try:
        os.kill(pid, 9)
    except OSError:
        pass
    os.waitpid(pid, 0)
    good = [n for n in data.decode(errors="replace").split(",") if n in names]
    for name in good:
        try:
            __import__(name)
        except BaseException:
            pass
    skipped = [n for n in names if n not in good]
    sys.stderr.write("elasticd worker template: preloaded %s%s\n" % (
        ", ".join(good) or "nothing learned",
        ("; skipped " + ", ".join(skipped)) if skipped else ""))


def template_main(fd: int, boot_args: list) -> None:
    if _set_entry(boot_args):
        _preload()
        _preload_learned()
    else:
        sys.stderr.write("elasticd worker template: the job's script is not there\n")
        sys.exit(2)
    request, log_fd, template_pid = _serve(fd)
    _become_rank(request, log_fd, template_pid, boot_args)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == TEMPLATE_FLAG:
        template_main(int(sys.argv[2]), sys.argv[3:])
        return
    boot_args = sys.argv[1:]
    if _set_entry(boot_args):  # sys.path[0] first: nothing imported before it is right
        _preload()
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    _become(json.loads(line), boot_args)


if __name__ == "__main__":
    main()
