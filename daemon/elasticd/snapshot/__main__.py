"""``python -m elasticd.snapshot clean``: remove the snapshots a job kept in /dev/shm
without a daemon (plain torchrun); under the daemon it removes them itself."""
from __future__ import annotations

import argparse
import os
import stat
import sys

from .errors import SnapshotError
from ..workers import snapshot_format as fmt
from .region import SLOT_FILE, base_dir, check_own, run_id

HELP = """\
Without a daemon (plain torchrun, one node), elasticd.snapshot keeps each rank's
snapshots in /dev/shm/elasticd-snapshots-<uid>/<run id> (the run id is
$TORCHELASTIC_RUN_ID, "default" when unset): they outlive the worker processes,
so a restarted rank restores from them, and stay until the job's own cleanup
runs this command after the job ends:

    python -m elasticd.snapshot clean            # this run ($TORCHELASTIC_RUN_ID)
    python -m elasticd.snapshot clean my-run-7   # the run my-run-7
    python -m elasticd.snapshot clean --all      # every run of yours

Only your own private slot files (rank<N>.a, .b, .p0, .p1), the ranks' costs
files beside them (rank<N>.costs) and the dirs that held them are removed; nothing is followed through a symbolic link. Under the
elasticd daemon the job's snapshot dir is removed when the job ends.
"""


def _remove_run(base_fd: int, name: str, base: str) -> int:
    """Remove one run's dir under the open base dir; the number of files removed."""
    path = os.path.join(base, name)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 dir_fd=base_fd)
    removed = 0
    try:
        check_own(os.fstat(fd), f"snapshot dir {path}", stat.S_IFDIR)
        for entry in os.listdir(fd):
            st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            ours = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
            if ours and SLOT_FILE.fullmatch(entry):
                os.unlink(entry, dir_fd=fd)
                removed += 1
            elif ours and fmt.COSTS_FILE.fullmatch(entry.removesuffix(".tmp")):
                os.unlink(entry, dir_fd=fd)
            else:
                print(f"left {path}/{entry}: not a slot file of yours", file=sys.stderr)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=base_fd)
    except OSError as exc:
        print(f"left {path}: {exc.strerror}", file=sys.stderr)
    return removed


def clean(run: str | None, every: bool) -> int:
    base = base_dir()
    names = None if every else [run_id(run)]
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        print(f"nothing to remove: {base} does not exist")
        return 0
    try:
        check_own(os.fstat(base_fd), f"snapshot folder {base}", stat.S_IFDIR)
        names = sorted(os.listdir(base_fd)) if names is None else names
        total = 0
        for name in names:
            try:
                total += _remove_run(base_fd, name, base)
            except FileNotFoundError:
                print(f"nothing to remove: {os.path.join(base, name)} does not exist")
    finally:
        os.close(base_fd)
    try:
        os.rmdir(base)
    except OSError:
        pass  # other runs remain
    print(f"removed {total} slot file(s) from {base}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m elasticd.snapshot",
                                 description=HELP, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("clean", help="remove a run's snapshots from /dev/shm",
                       description=HELP, formatter_class=argparse.RawTextHelpFormatter)
    c.add_argument("run_id", nargs="?", help="the run id (default: $TORCHELASTIC_RUN_ID, "
                                             "else 'default')")
    c.add_argument("--all", action="store_true", help="every run of yours")
    args = ap.parse_args(argv)
    try:
        return clean(args.run_id, args.all)
    except SnapshotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
