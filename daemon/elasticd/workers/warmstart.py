"""Bootstrap of a warm spare worker: import the heavy modules, then wait.

The daemon starts this file by path with the job's own Python interpreter (so it
needs nothing of elasticd installed there, and stays one file), as the job's user, in
the job's directory and environment, as ``python workers/warmstart.py ARGS`` where ARGS
is what follows the interpreter in the job's command. It imports torch ahead of need,
then blocks on stdin for one JSON line: the worker's full environment and its command
line. It then becomes that worker exactly as ``python [-u] SCRIPT ARGS`` or ``python
[-u] -m MODULE ARGS`` would, minus the seconds of interpreter start and torch import.
EOF on stdin means "not needed": exit 0.

Before it imports anything, ``sys.path[0]`` is what the cold start of the job's command
would have (``entry_path``): the script's real directory, or the working directory for
``-m``, or nothing under ``-P``/PYTHONSAFEPATH; never the working directory for a
script, where anyone who can write it could plant a ``torch.py``.

Nothing here may print before the assignment arrives except import errors.

``python workers/warmstart.py --template FD ARGS`` is the job's worker template
(workers/template.py is its daemon side): the same start and preload, then it serves
requests on FD, a socketpair end only the daemon holds, and forks one child per rank
that becomes that rank (``_serve``, ``_become_rank``).
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
# torch.cuda.is_available() and device_count() (which some modules call at import) start the
# CUDA driver unless this is 1, and no process forked after that can use CUDA: the template
# forks its ranks. Set while a template or spare imports; the rank gets the job's own
# environment back (_become).
NVML_CUDA_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
# OpenBLAS (under numpy, which torch imports when it is there) starts one thread per CPU as
# it loads, unless one of these says otherwise, and a process with threads is unsafe to
# fork: with one rank per node (OMP_NUM_THREADS is set only for several) a job would get
# cold starts wherever numpy is installed. The template imports with the first at 1; each
# rank it forks sizes the pool as its cold start would have (_restore_blas_threads).
BLAS_THREADS_ENVS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
_BLAS_SET_THREADS = ("openblas_set_num_threads", "openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads64_")
_blas_pinned = False


def entry_path(args: list) -> str | None:
    """``sys.path[0]`` of a cold ``python ARGS`` in the current directory, as CPython computes
    it: ``-m``: the working directory (getcwd, links resolved); a script: the directory of
    its realpath, or of the path as given when it cannot be resolved ("" when that has no
    directory). None when the cold start would not exist (no arguments) or prepend nothing
    (safe_path)."""
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
    os.environ[NVML_CUDA_CHECK_ENV] = "1"  # before anything is imported (see above)
    names = os.environ.get(WARM_PRELOAD_ENV, "torch,torch.distributed")
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            __import__(name)
        except Exception:  # the worker will import it itself and see the error
            pass


def _pin_blas_threads() -> None:
    """Before the template imports: OpenBLAS starts no threads unless the job says so."""
    global _blas_pinned
    if not any(name in os.environ for name in BLAS_THREADS_ENVS):
        os.environ[BLAS_THREADS_ENVS[0]] = "1"
        _blas_pinned = True


def blas_threads_wanted(env, cpus: int) -> int:
    """The pool OpenBLAS sizes as it loads: its variables in its order, else the CPUs."""
    for name in BLAS_THREADS_ENVS:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return cpus


def _restore_blas_threads() -> None:
    """In a rank forked from a template that pinned OpenBLAS: the pool of a cold start."""
    if not _blas_pinned:
        return
    wanted = blas_threads_wanted(os.environ, len(os.sched_getaffinity(0)))
    if wanted <= 1:
        return
    import ctypes
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh
                     if "openblas" in line.rsplit("/", 1)[-1] and ".so" in line}
    except OSError:
        return
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # loaded already: the same library, not a second copy
        except OSError:
            continue
        for symbol in _BLAS_SET_THREADS:
            setter = getattr(lib, symbol, None)
            if setter is not None:
                setter(ctypes.c_int(wanted))
                break


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


def _become(assignment: dict, boot_args: list, keep_stdin: bool = False) -> None:
    sys.excepthook = _user_frames_only(sys.excepthook)
    os.environ.clear()
    os.environ.update(assignment["env"])
    _restore_blas_threads()
    os.chdir(assignment["cwd"])
    if not keep_stdin:
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
# Requests, daemon -> template: a 4-byte big-endian length, then that many bytes of JSON.
# A "fork" request carries the rank's log as one SCM_RIGHTS descriptor sent with its
# length header; one with "helper" set (a process of the job that is no rank, running one
# of elasticd's own files: the round store server, the job store) carries a second, a
# socket that becomes the child's stdin and stdout (its log then takes stderr only).
# Replies and news, template -> daemon: one JSON object per line:
# {"ready": ..., "env_read": [NAME, ...] or "*"} once after the preload
# (_record_env_reads), {"id": N, "pid": P} or {"id": N, "refused": WHY} per fork
# request, and {"exit": PID, "status": WAITSTATUS} for each child the template reaped.

_REQUEST_MAX = 64 << 20


# Which variables the preload read (workers/template_key.py, EnvReads: the daemon keys the
# template on their values): names read through os.environ/os.environb while it imports ([],
# get, in, setdefault, os.getenv: all go through __getitem__), or "*" when an import walked
# the whole environment (iteration, copy(), items()) or read too many to list. The names
# this file sets itself are left out: the job's value is in its key.
READ_NAMES_MAX = 2048


def _record_env_reads():
    """Record reads of os.environ from now; the returned function ends it and gives the
    ready message's ``env_read``."""
    cls = type(os.environ)
    getitem, iterate = cls.__getitem__, cls.__iter__
    names, walked = set(), []

    def reading(self, key):
        if isinstance(key, (str, bytes)):
            names.add(key.decode("utf-8", "replace") if isinstance(key, bytes) else key)
        return getitem(self, key)

    def walking(self):
        walked.append(True)
        return iterate(self)

    cls.__getitem__, cls.__iter__ = reading, walking

    def done():
        cls.__getitem__, cls.__iter__ = getitem, iterate
        own = {NVML_CUDA_CHECK_ENV, WARM_PRELOAD_ENV, LEARNED_PRELOAD_ENV}
        if _blas_pinned:
            own.add(BLAS_THREADS_ENVS[0])
        listed = sorted(n for n in names - own if (n[:1].isalpha() or n[:1] == "_")
                        and n.isascii() and n.replace("_", "a").isalnum() and len(n) <= 256)
        return "*" if walked or len(listed) > READ_NAMES_MAX else listed
    return done


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
    head, fds, _, _ = socket.recv_fds(sock, 4, 2)  # the log, and a helper's channel
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


def _serve(fd: int, env_read="*"):
    """Serve the daemon until it asks for a rank; returns (request, log fd, template
    pid, the helper's channel fd or -1) in the forked child, exits in the template when
    the daemon hangs up."""
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
                 "modules": len(sys.modules), "env_read": env_read})
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
        helper = bool(request.get("helper"))
        chan_fd = fds[1] if helper and len(fds) > 1 else -1
        why = _fork_unsafe() or ("" if log_fd >= 0 else "no log descriptor came with it") \
            or ("" if chan_fd >= 0 or not helper else "no channel came with the helper")
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
            _close([wake_r, wake_w, sock.detach()] + fds[2 if helper else 1:])
            return request, log_fd, template_pid, chan_fd
        _close(fds)
        _send(sock, {"id": request.get("id"), "pid": pid})


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _become_rank(request: dict, log_fd: int, template_pid: int, boot_args: list,
                 chan_fd: int = -1) -> None:
    """In the forked child: become the rank as a cold start would be, then run it (a
    helper: its stdin and stdout the channel ``chan_fd``, its stderr the log)."""
    import ctypes
    import ctypes.util
    import signal
    os.setsid()  # its own session and process group, as the daemon's workers
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the template
    if os.getppid() != template_pid:  # the template died before that took effect
        os._exit(1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if chan_fd >= 0:  # a helper; a rank's stdin is /dev/null (_become)
        os.dup2(chan_fd, 0)
        os.dup2(chan_fd, 1)
        os.close(chan_fd)
    else:
        os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    beats = sys.modules.get("elasticd_heartbeat")
    if beats is not None and hasattr(beats, "become_new_process"):
        beats.become_new_process()  # the template imported it: this is a rank of its own
    _become(request, boot_args, keep_stdin=chan_fd >= 0)


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
        _pin_blas_threads()
        recorded = _record_env_reads()
        _preload()
        _preload_learned()
        env_read = recorded()
    else:
        sys.stderr.write("elasticd worker template: the job's script is not there\n")
        sys.exit(2)
    request, log_fd, template_pid, chan_fd = _serve(fd, env_read)
    _become_rank(request, log_fd, template_pid, boot_args, chan_fd)


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
