"""One .deb of this tree for the whole test run, shared by the cases that need one.

packaging/build-deb.sh builds a whole venv into the package: a minute and more on
two busy cores. test_packaging and test_systemd_real each built their own; now the
first to ask builds it under a lock in the run's shared temp dir (pytest's basetemp,
above each xdist worker's own, retired with it), and the others take that one.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def built_deb(tmp_path_factory, timeout: float = 600) -> Path:
    """The path of this run's .deb, built now if no case of the run has built it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent            # popen-gwN's parent: the run's, shared by workers
    home = base / "built-deb"
    home.mkdir(exist_ok=True)
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
        made = home / "path"
        if made.exists():
            return Path(made.read_text())
        out = home / "out"
        out.mkdir(exist_ok=True)
        proc = subprocess.run(["bash", str(ROOT / "packaging" / "build-deb.sh"), str(out)],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"packaging/build-deb.sh exited {proc.returncode}:\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        path = Path(proc.stdout.strip().splitlines()[-1])
        made.write_text(str(path))
        return path
