"""A Debian tree booted under a real systemd, for tests of the .deb and its unit.

``cached_tree()`` makes (once, then reuses) a minimal Debian tree with
debootstrap: systemd, dbus, python3 and what the .deb depends on.
``BootedTree`` boots it: the tree is mounted as the lower layer of an overlay
(so every boot starts from the same clean tree and leaves it untouched), then

    unshare --fork --pid --mount --uts --cgroup  (in a cgroup of its own)
      mount overlay, proc, sysfs, cgroup2, /dev, tmpfs /run and /tmp
      chroot TREE /lib/systemd/systemd --system

so systemd is PID 1 of its own PID namespace and root of its own cgroup
tree, and runs the .deb's unit for real. ``run()`` drives it with
``nsenter -t PID -m -p -u chroot TREE ...``. Teardown SIGKILLs that PID 1
(the kernel then kills everything in its PID namespace, the mount namespace
and its mounts go with the last process), removes the cgroups and the
overlay's upper layer, and checks that nothing is left: no process, no
mount, no cgroup.

Nothing here is specific to elasticd except the package list. Needs root,
util-linux's unshare/nsenter, overlayfs, a cgroup2 hierarchy (pure or the
``unified`` one of a hybrid host) and debootstrap (installed with apt-get
if missing); ``why_not()`` says what is missing.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

SUITE = "bookworm"
VARIANT = "minbase"
# systemd as init, dbus for systemctl, python3.11 and adduser for the .deb
# (its Depends:). The .deb bundles its own virtualenv, so nothing else.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "adduser")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Bump when the tree's preparation below changes: the cache key includes it.
TREE_FORMAT = 1
CACHE_DIR = Path(os.environ.get("ELASTICD_TEST_TREE_CACHE", "/var/cache/elasticd-test"))
# Units that would take over this machine's console or ttys: never started.
MASKED_UNITS = ("getty.target", "console-getty.service", "getty@tty1.service",
                "serial-getty@ttyS0.service")
HOSTNAME = "elasticd-test"
# Each boot's overlay layers live in WORK_PARENT/WORK_PREFIX..., its cgroup has the same name.
WORK_PARENT, WORK_PREFIX = "/var/tmp", "elasticd-systemd-"
# A clean environment for everything run inside the tree.
TREE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8", "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", "TERM": "dumb"}


class TreeUnavailable(Exception):
    """This machine cannot build or boot the tree; the message says why."""


def _run(cmd, timeout=120, check=True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def why_not() -> str | None:
    """Why a tree cannot be booted here, or None."""
    if os.geteuid() != 0:
        return "booting a tree under systemd needs root (namespaces, mounts, cgroups)"
    for tool in ("unshare", "nsenter", "chroot", "dpkg"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian packages util-linux, coreutils, dpkg)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "needs overlayfs (kernel module overlay)"
    if _cgroup2_root() is None:
        return "needs a cgroup2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified"
    if _host_codename() != SUITE:
        return (f"the .deb bundles this machine's Python, so the tree must be its Debian "
                f"release; this machine is not Debian {SUITE}")
    return None


def _host_codename() -> str:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return ""
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    if fields.get("ID") != "debian":
        return ""
    return fields.get("VERSION_CODENAME", "").strip('"')


def _cgroup2_root() -> Path | None:
    for path in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if (Path(path) / "cgroup.procs").exists() and (Path(path) / "cgroup.controllers").exists():
            return Path(path)
    return None


def mirror() -> str:
    """The Debian mirror this machine's apt uses for SUITE (deb822 or one-line sources)."""
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        for stanza in Path(path).read_text().split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.split()
            if "deb" in fields.get("types", []) and SUITE in fields.get("suites", []):
                return fields.get("uris", [DEFAULT_MIRROR])[0]
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            m = re.match(r"\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
            if m and m.group(2) == SUITE:
                return m.group(1)
    return DEFAULT_MIRROR


def ensure_debootstrap() -> str:
    """The debootstrap executable, installed with apt-get if it is missing."""
    found = shutil.which("debootstrap")
    if found:
        return found
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    proc = _run(["apt-get", "install", "-y", "--no-install-recommends", "debootstrap"],
                timeout=600, check=False, env=env)
    if proc.returncode != 0:  # a machine that never ran apt-get update
        _run(["apt-get", "update"], timeout=600, check=False, env=env)
        proc = _run(["apt-get", "install", "-y", "--no-install-recommends", "debootstrap"],
                    timeout=600, check=False, env=env)
    found = shutil.which("debootstrap")
    if not found:
        raise TreeUnavailable(f"cannot install debootstrap with apt-get:\n{proc.stderr[-2000:]}")
    return found


def cache_key(mirror_url: str, packages: tuple = PACKAGES) -> str:
    spec = {"suite": SUITE, "variant": VARIANT, "packages": sorted(packages),
            "mirror": mirror_url, "format": TREE_FORMAT, "masked": sorted(MASKED_UNITS)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def cached_tree(packages: tuple = PACKAGES, kind: str = "") -> tuple[Path, float | None]:
    """(the tree, seconds it took to build or None when it came from the cache).

    Built once per package list and mirror under CACHE_DIR, by one process at a
    time (a lock file); a half-built tree is never used, and trees of older
    package lists of the same ``kind`` are deleted when a new one is made
    (``kind`` names a tree of other packages, e.g. "bare": a minimal Debian
    without python3, kept beside the default one).
    """
    url = mirror()
    key = cache_key(url, packages)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    stem = f"{SUITE}.{kind}" if kind else SUITE
    tree = CACHE_DIR / f"{stem}-{key}"
    with open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (tree / ".complete").exists():
            return tree, None
        debootstrap = ensure_debootstrap()
        for old in CACHE_DIR.glob(f"{stem}-*"):
            shutil.rmtree(old, ignore_errors=True)
        t0 = time.monotonic()
        partial = CACHE_DIR / f".partial-{key}"
        shutil.rmtree(partial, ignore_errors=True)
        proc = _run([debootstrap, f"--variant={VARIANT}", f"--include={','.join(packages)}",
                     SUITE, partial, url], timeout=1200, check=False)
        if proc.returncode != 0:
            log = (partial / "debootstrap" / "debootstrap.log")
            detail = log.read_text()[-3000:] if log.exists() else proc.stderr[-3000:]
            shutil.rmtree(partial, ignore_errors=True)
            raise TreeUnavailable(f"debootstrap {SUITE} from {url} failed:\n{detail}")
        _prepare(partial)
        (partial / ".complete").write_text(json.dumps({"mirror": url, "packages": packages}))
        partial.rename(tree)
        return tree, time.monotonic() - t0


def _prepare(tree: Path) -> None:
    """What every boot needs and debootstrap does not do."""
    for unit in MASKED_UNITS:
        link = tree / "etc/systemd/system" / unit
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    (tree / "etc/hostname").write_text(HOSTNAME + "\n")
    # Drop downloaded .debs: the tree is only ever used as an overlay's lower layer.
    for deb in (tree / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()


# Runs in the new namespaces, as their PID 1 until it execs systemd.
_BOOT_SCRIPT = r"""
set -e
lower=$1 upper=$2 work=$3 root=$4
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$root"
mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"
mount -t cgroup2 cgroup2 "$root/sys/fs/cgroup"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$root/run"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$root/tmp"
hostname "$5"
shift 5
exec chroot "$root" "$@"
"""
# PID 1 of a tree: its systemd, or (``BootedTree(init=False)``: a tree without systemd, as a
# minimal container has it) a process that only waits to be killed.
SYSTEMD_INIT = ("/lib/systemd/systemd", "--system")
NO_INIT = ("sleep", "infinity")


class BootedTree:
    """A tree booted under its own systemd (or, ``init=False``, under a PID 1 that only
    waits: no services, as in a minimal container); a context manager that always tears
    it down."""

    def __init__(self, tree: Path, init: bool = True):
        self.tree = Path(tree)
        self.init = SYSTEMD_INIT if init else NO_INIT
        self.workdir: Path | None = None
        self.root: Path | None = None
        self.cgroup: Path | None = None
        self.unshare: subprocess.Popen | None = None
        self.pid: int | None = None           # systemd, as this machine sees it
        self.boot_seconds: float | None = None
        self._pidns: str | None = None
        self._console = None

    # -- boot ------------------------------------------------------------------
    def __enter__(self) -> "BootedTree":
        try:
            self.boot()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def boot(self, timeout: float = 120.0) -> None:
        _reap_stale()
        self.workdir = Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=WORK_PARENT))
        for name in ("upper", "work", "root"):
            (self.workdir / name).mkdir()
        self.root = self.workdir / "root"
        self.cgroup = _cgroup2_root() / self.workdir.name
        self.cgroup.mkdir()
        t0 = time.monotonic()
        self._console = open(self.workdir / "console.log", "wb")
        # The shell joins the cgroup before unshare, so the new cgroup namespace
        # is rooted there and systemd's cgroups are made under it.
        self.unshare = subprocess.Popen(
            # If this test process dies without a teardown, the kernel still
            # brings the tree down: unshare gets SIGKILL when we die, its
            # child (the tree's PID 1) when it does, and the rest with PID 1.
            ["setpriv", "--pdeathsig", "KILL",
             "sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh",
             str(self.cgroup), "unshare", "--fork", "--kill-child=SIGKILL", "--pid", "--mount",
             "--uts", "--cgroup", "--propagation", "private",
             "sh", "-c", _BOOT_SCRIPT, "boot", str(self.tree),
             str(self.workdir / "upper"), str(self.workdir / "work"), str(self.root), HOSTNAME,
             *self.init],
            env={**TREE_ENV, "container": "elasticd-test"}, stdin=subprocess.DEVNULL,
            stdout=self._console, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + timeout
        while self.pid is None:
            self.pid = self._systemd_pid()
            if self.unshare.poll() is not None:
                raise AssertionError(f"the tree did not boot (exit {self.unshare.returncode}):\n"
                                     f"{self.console()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no systemd in the tree after {timeout}s:\n{self.console()}")
            time.sleep(0.02)
        self._pidns = os.readlink(f"/proc/{self.pid}/ns/pid")
        state = "" if self.init == SYSTEMD_INIT else "running"
        while state not in ("running", "degraded"):
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if time.monotonic() > deadline:
                raise AssertionError(f"systemd in the tree is {state!r} after {timeout}s:\n"
                                     + self.run("systemctl", "--failed", "--no-pager",
                                                check=False).stdout + self.console())
            time.sleep(0.05)
        self.boot_seconds = time.monotonic() - t0

    def _systemd_pid(self) -> int | None:
        """The unshare's child once it is the tree's init (it was sh until the exec)."""
        comm = os.path.basename(self.init[0])
        try:
            children = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children")
            for pid in children.read_text().split():
                if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                    return int(pid)
        except OSError:
            pass
        return None

    def console(self) -> str:
        try:
            return (self.workdir / "console.log").read_text(errors="replace")[-4000:]
        except (OSError, TypeError):
            return ""

    # -- inside ------------------------------------------------------------------
    def command(self, *argv, user: str | None = None, cwd: str = "/") -> list[str]:
        """argv that runs ``argv`` in the tree (as ``user``, with its groups, if given)."""
        inner = [str(a) for a in argv]
        if user is not None:
            # setpriv keeps the environment; give the user's own HOME and USER.
            inner = ["sh", "-c", 'exec setpriv --reuid="$0" --regid="$(id -g "$0")" '
                     '--init-groups env HOME="/home/$0" USER="$0" LOGNAME="$0" "$@"',
                     user, *inner]
        return ["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "--", "chroot", str(self.root),
                "sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", cwd, *inner]

    def run(self, *argv, user: str | None = None, cwd: str = "/", check: bool = True,
            timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess:
        # A session of its own: a `kill 0` in the tree must never reach the test runner.
        proc = subprocess.run(self.command(*argv, user=user, cwd=cwd), capture_output=True,
                              text=True, timeout=timeout, env=TREE_ENV, input=input,
                              start_new_session=True)
        if check and proc.returncode != 0:
            raise AssertionError(f"in the tree: {' '.join(map(str, argv))} exited "
                                 f"{proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file in the booted tree (its parent directories made as needed)."""
        if isinstance(data, str):
            data = data.encode()
        proc = subprocess.run(
            self.command("sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"',
                         "sh", path, f"{mode:o}"),
            input=data, capture_output=True, timeout=120, env=TREE_ENV, start_new_session=True)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")

    def read(self, path: str) -> str:
        return self.run("cat", path).stdout

    def exists(self, path: str) -> bool:
        return self.run("test", "-e", path, check=False).returncode == 0

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *[f"--property={p}" for p in props]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    # -- teardown ------------------------------------------------------------------
    def teardown(self) -> None:
        """Kill everything the boot made and check nothing is left; raise if something is."""
        problems = []
        if self.unshare is not None:
            if self.pid is not None:
                try:
                    os.kill(self.pid, signal.SIGKILL)  # PID 1 gone: its namespace dies
                except ProcessLookupError:
                    pass
            if self.unshare.poll() is None:
                try:
                    self.unshare.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.unshare.pid, signal.SIGKILL)
                    self.unshare.wait(30)
        if self._console is not None:
            self._console.close()
            self._console = None
        if self._pidns is not None:
            deadline = time.monotonic() + 30
            while (left := _processes_in_pidns(self._pidns)) and time.monotonic() < deadline:
                time.sleep(0.1)
            if left:
                problems.append(f"processes left in the tree's PID namespace: {left}")
        if self.cgroup is not None and self.cgroup.exists():
            problems += _remove_cgroup(self.cgroup)
        if self.workdir is not None:
            with open("/proc/self/mountinfo") as fh:
                mounts = [line for line in fh if str(self.workdir) in line]
            if mounts:
                problems.append("mounts left:\n" + "".join(mounts))
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)
        self.unshare = None
        self.pid = None
        self._pidns = None
        if problems:
            raise AssertionError("tearing down the booted tree left:\n" + "\n".join(problems))


def _reap_stale(min_age: float = 60.0) -> None:
    """Remove what boots of killed test runs left: empty cgroups and their work dirs.

    A cgroup with a process in it belongs to a tree still running (another
    test run's), and a young one may be one about to get its first process:
    both are left alone.
    """
    root = _cgroup2_root()
    for cgroup in root.glob(WORK_PREFIX + "*") if root else ():
        try:
            if time.time() - cgroup.stat().st_mtime < min_age or _cgroup_has_processes(cgroup):
                continue
        except OSError:
            continue
        if _remove_cgroup(cgroup):
            continue
        workdir = Path(WORK_PARENT) / cgroup.name
        with open("/proc/self/mountinfo") as fh:
            if not any(str(workdir) in line for line in fh):
                shutil.rmtree(workdir, ignore_errors=True)


def _cgroup_has_processes(top: Path) -> bool:
    for dirpath, _dirs, _files in os.walk(top):
        try:
            if Path(dirpath, "cgroup.procs").read_text().strip():
                return True
        except OSError:
            pass
    return False


def _processes_in_pidns(ns: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _remove_cgroup(top: Path) -> list[str]:
    """rmdir a cgroup and those under it, deepest first; what could not be removed."""
    problems = []
    deadline = time.monotonic() + 30
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
        while True:
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError as exc:  # EBUSY while the last processes are reaped
                if time.monotonic() > deadline:
                    procs = Path(dirpath, "cgroup.procs").read_text().split()
                    problems.append(f"cgroup {dirpath} not removed ({exc}); processes {procs}")
                    break
                time.sleep(0.05)
    return problems
