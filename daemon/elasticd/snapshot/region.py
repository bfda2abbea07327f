"""The job's snapshot dir on this node: where it is, that it is the caller's own, its
slot files opened without following links, its byte budget and free space.

Under the daemon the dir is ``$ELASTICD_SNAPSHOT_DIR`` (made by the daemon as the
job's user, 0700, on tmpfs). Without one (plain torchrun, one node) it is
``/dev/shm/elasticd-snapshots-<uid>/<run id>``, made here 0700. Either way the
dir and every file in it must belong to the caller's uid with no access for
group or others, and nothing is followed through a symbolic link: anything else
is refused with NotOwned, never used.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat

from ..workers import env as wenv
from ..workers import snapshot_format as fmt
from .errors import NoSpace, NotOwned, OverBudget, SnapshotError

SHM = "/dev/shm"
BASE_NAME = "elasticd-snapshots-{uid}"
DEFAULT_RUN_ID = "default"
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SLOT_FILE = fmt.SLOT_FILE
REPLICAS = "replicas"          # <dir>/replicas/<node>/: peers' replicas the daemon keeps
MAX_REPLICA_DIRS = 64          # entries of replicas/ looked at
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a planted FIFO must not block the open; fstat then refuses it.
FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
MAX_PIN_EVERY = 1 << 30         # snapshot.pin_every's bound
MAX_RESTORE_WAIT = 3600.0      # snapshot.restore_wait's bound
BUDGET_HINT = ("the daemon's settings snapshot.job_budget and snapshot.node_budget in "
               "elasticd.toml set it")


def run_id(value: str | None = None) -> str:
    """The run id naming the default dir: ``value``, else $TORCHELASTIC_RUN_ID, else
    "default"; SnapshotError for one that is not a plain name."""
    rid = value if value is not None else os.environ.get(wenv.TORCHRUN_RUN_ID) or DEFAULT_RUN_ID
    if not RUN_ID.fullmatch(rid):
        raise SnapshotError(f"run id {rid!r} is not a plain name (letters, digits, '.', '_', "
                            f"'-', at most 128, not starting with '.' or '-')")
    return rid


def base_dir(uid: int | None = None) -> str:
    """The caller's folder of default dirs in /dev/shm (one per run id)."""
    return os.path.join(SHM, BASE_NAME.format(uid=os.geteuid() if uid is None else uid))


def where() -> tuple[str, bool]:
    """(the snapshot dir, whether the daemon made it)."""
    given = os.environ.get(wenv.SNAPSHOT_DIR)
    if given:
        if not os.path.isabs(given):
            raise SnapshotError(f"${wenv.SNAPSHOT_DIR} must be an absolute path, not {given!r}")
        return given, True
    return os.path.join(base_dir(), run_id()), False


def budget() -> int | None:
    """$ELASTICD_SNAPSHOT_BUDGET_BYTES as a number of bytes; None when not set."""
    raw = os.environ.get(wenv.SNAPSHOT_BUDGET)
    if raw is None or raw == "":
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 20:
        raise SnapshotError(f"${wenv.SNAPSHOT_BUDGET} must be a whole number of bytes, "
                            f"not {raw[:40]!r}")
    return int(raw)


def pin_every() -> int:
    """$ELASTICD_SNAPSHOT_PIN_EVERY (snapshot.pin_every): the pin grid in steps; 0 (no pin
    slots) when not set."""
    raw = os.environ.get(wenv.SNAPSHOT_PIN_EVERY)
    if raw is None or raw == "":
        return 0
    if not raw.isascii() or not raw.isdigit() or len(raw) > 10 or int(raw) > MAX_PIN_EVERY:
        raise SnapshotError(f"${wenv.SNAPSHOT_PIN_EVERY} must be a whole number of steps up "
                            f"to {MAX_PIN_EVERY}, not {raw[:40]!r}")
    return int(raw)


def restore_wait() -> float:
    """$ELASTICD_SNAPSHOT_RESTORE_WAIT (snapshot.restore_wait) in seconds; 0 when not set."""
    raw = os.environ.get(wenv.SNAPSHOT_RESTORE_WAIT)
    if raw is None or raw == "":
        return 0.0
    try:
        got = float(raw) if raw.isascii() and len(raw) <= 32 else -1.0
    except ValueError:
        got = -1.0
    if not 0 <= got <= MAX_RESTORE_WAIT:     # NaN fails this too
        raise SnapshotError(f"${wenv.SNAPSHOT_RESTORE_WAIT} must be seconds from 0 to "
                            f"{MAX_RESTORE_WAIT:g}, not {raw[:40]!r}")
    return got


def check_own(st: os.stat_result, what: str, kind: int) -> None:
    """NotOwned unless ``st`` is of ``kind`` (stat.S_IFDIR / S_IFREG), the caller's, and
    private (no group or other bits)."""
    if stat.S_IFMT(st.st_mode) != kind:
        raise NotOwned(f"{what} is not a {'directory' if kind == stat.S_IFDIR else 'regular file'}"
                       f" ({stat.filemode(st.st_mode)}): refused")
    if st.st_uid != os.geteuid():
        raise NotOwned(f"{what} belongs to uid {st.st_uid}, not to this process's uid "
                       f"{os.geteuid()}: refused")
    if st.st_mode & 0o077:
        raise NotOwned(f"{what} is {stat.filemode(st.st_mode)}: group or others may use it; "
                       f"a snapshot region must be private to its user (0700 dir, 0600 files)")


def _open_dir(path: str, what: str, dir_fd: int | None = None) -> int:
    try:
        fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        raise NotOwned(f"{what} {path} is not uid {os.geteuid()}'s (it may not even open "
                       f"it): another user's, refused") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotOwned(f"{what} {path} is a symbolic link or not a directory: refused") \
                from None
        raise
    try:
        check_own(os.fstat(fd), f"{what} {path}", stat.S_IFDIR)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_private_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


class Region:
    """The snapshot dir, open: every file below is reached through its descriptor."""

    def __init__(self, path: str, fd: int, by_daemon: bool):
        self.path, self.fd, self.by_daemon = path, fd, by_daemon
        st = os.fstat(fd)
        self.key = (st.st_dev, st.st_ino)

    @classmethod
    def open(cls, create: bool) -> "Region | None":
        """The caller's snapshot dir, checked; None when it does not exist and ``create``
        is false. Without a daemon, ``create`` makes it (and its folder) 0700."""
        path, by_daemon = where()
        try:
            if not by_daemon and create:
                _make_private_dir(base_dir())
                _open_and_close(base_dir(), "snapshot folder")
                _make_private_dir(path)
            elif not by_daemon:
                _open_and_close(base_dir(), "snapshot folder")
            return cls(path, _open_dir(path, "snapshot dir"), by_daemon)
        except FileNotFoundError:
            if create and by_daemon:
                raise SnapshotError(f"${wenv.SNAPSHOT_DIR} names {path}, which does not exist "
                                    f"(the daemon makes it when the job's group starts)") from None
            return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open_slot(self, name: str, writable: bool) -> int | None:
        """A slot file's descriptor, checked (the caller's, 0600, regular, not a link);
        None when it does not exist and not ``writable`` (then it is made 0600)."""
        flags = FILE_FLAGS | (os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY)
        try:
            fd = os.open(name, flags, 0o600, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotOwned(f"slot file {self.path}/{name} is a symbolic link: refused") \
                    from None
            raise
        try:
            check_own(os.fstat(fd), f"slot file {self.path}/{name}", stat.S_IFREG)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def replicas(self) -> "list[Region]":
        """The dirs of replicas the daemon received from peers (``replicas/<node>/``),
        each open and checked as the dir itself is (the caller's, private, not a link);
        one that is not is skipped, never followed. The caller closes them."""
        try:
            top = _open_dir(REPLICAS, f"replicas dir of {self.path}:", dir_fd=self.fd)
        except (NotOwned, OSError):
            return []
        out = []
        try:
            for name in sorted(os.listdir(top))[:MAX_REPLICA_DIRS]:
                try:
                    fd = _open_dir(name, f"replica dir of {self.path}:", dir_fd=top)
                except (NotOwned, OSError):
                    continue
                out.append(Region(os.path.join(self.path, REPLICAS, name), fd, self.by_daemon))
        except OSError:
            pass
        finally:
            os.close(top)
        return out

    def stat_slot(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def slot_files(self) -> dict[str, int]:
        """Every slot file in the dir (every rank's): name -> size in bytes."""
        out = {}
        for name in os.listdir(self.fd):
            if SLOT_FILE.fullmatch(name):
                st = self.stat_slot(name)
                if st is not None and stat.S_ISREG(st.st_mode):
                    out[name] = st.st_size
        return out

    @contextlib.contextmanager
    def locked(self):
        """The dir's lock: one rank of this node at a time checks and grows its slots."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    @staticmethod
    def budget() -> int | None:
        return budget()

    def check_room(self, name: str, want: int) -> None:
        """OverBudget / NoSpace unless slot ``name`` may grow to ``want`` bytes: the dir's
        total against the budget, the growth against the filesystem's free space."""
        files = self.slot_files()
        have = files.get(name, 0)
        grow = max(0, want - have)
        total = sum(files.values()) - have + max(want, have)
        limit = budget()
        if limit is not None and total > limit:
            raise OverBudget(
                f"saving {want} bytes into {self.path}/{name} would make this node's snapshots "
                f"of the job {total} bytes, over its budget of {limit} bytes "
                f"(${wenv.SNAPSHOT_BUDGET}; {BUDGET_HINT}): save less state, or raise "
                f"snapshot.job_budget / snapshot.node_budget")
        vfs = os.statvfs(self.fd)
        free = vfs.f_bavail * vfs.f_frsize
        if grow > free:
            raise NoSpace(f"saving {want} bytes into {self.path}/{name} needs {grow} more bytes; "
                          f"its filesystem has {free} bytes free")


def _open_and_close(path: str, what: str) -> None:
    os.close(_open_dir(path, what))


def slot_names(rank: int, slots: tuple = fmt.ALL_SLOTS) -> tuple:
    """The names of the rank's slot files (all four, or the pair ``slots``)."""
    return tuple(fmt.slot_name(rank, s) for s in slots)
