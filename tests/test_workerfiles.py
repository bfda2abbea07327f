"""The one reader of files a job's user can write, and the spare's sys.path[0] rule.

No daemon here: real files, links and FIFOs; real cold interpreters to
compare the warm spare's ``entry_path`` with.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from elasticd.workers import warmstart, files as workerfiles
from elasticd.agent.failures import UNREADABLE, describe, read_error_file
from elasticd.workers.files import Problem

ME = os.geteuid()


def test_a_regular_file_of_the_user_is_read_up_to_the_limit(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    got = workerfiles.read(str(path), ME, 1000)
    assert got.ok and got.data == b"x" * 100 and got.size == 100 and got.mtime > 0
    assert workerfiles.read(str(path), ME, 10).problem is Problem.TOO_LARGE
    part = workerfiles.read(str(path), ME, 10, offset=95, whole=False)
    assert part.ok and part.data == b"x" * 5


def test_a_missing_file_is_missing(tmp_path):
    assert workerfiles.read(str(tmp_path / "nope"), ME, 10).problem is Problem.MISSING


def test_a_symlink_is_never_followed(tmp_path):
    target = tmp_path / "secret"
    target.write_text("secret")
    link = tmp_path / "link"
    os.symlink(target, link)
    got = workerfiles.read(str(link), ME, 1000)
    assert got.problem is Problem.NOT_REGULAR and got.data == b""
    assert workerfiles.regular_size(str(link)) is None


def test_a_fifo_neither_blocks_nor_is_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = []
    t = threading.Thread(target=lambda: result.append(workerfiles.read(str(fifo), ME, 1000)))
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert result[0].problem is Problem.NOT_REGULAR
    assert workerfiles.regular_size(str(fifo)) is None


def test_a_file_of_another_owner_is_refused(tmp_path):
    path = tmp_path / "f"
    path.write_text("{}")
    assert workerfiles.read(str(path), ME + 1, 1000).problem is Problem.WRONG_OWNER


def test_a_directory_is_not_a_regular_file(tmp_path):
    assert workerfiles.read(str(tmp_path), ME, 1000).problem is Problem.NOT_REGULAR


def test_an_error_file_that_is_a_link_is_an_unreadable_error_file(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"message": "TOPSECRET"}))
    link = tmp_path / "error.json"
    os.symlink(secret, link)
    report = read_error_file(str(link), ME)
    assert report.message == "" and report.problem is Problem.NOT_REGULAR

    class W:
        outcome, rank = 1, 3
    _, _, cause = describe(W(), report.message, report.problem)
    assert cause == f"rank 3 exited with exit code 1 ({UNREADABLE}: not a regular file)"


def test_an_error_file_over_the_cap_is_unreadable(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "m" * 5000}))
    assert read_error_file(str(path), ME, max_bytes=1024).problem is Problem.TOO_LARGE
    assert read_error_file(str(path), ME, max_bytes=1 << 20).message == "m" * 5000


# ---------------------------------------------------------------- sys.path[0] of a spare

def _cold_path0(args: list, cwd: str, env: dict | None = None) -> str:
    """sys.path[0] as CPython itself sets it for ``python ARGS`` in ``cwd``."""
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                         env=dict(os.environ, **(env or {})), timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entry(args: list, cwd: str) -> str | None:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return warmstart.entry_path(args)
    finally:
        os.chdir(old)


PRINT_PATH0 = "import json, sys; print(json.dumps(sys.path[0]))\n"


def test_entry_path_is_the_scripts_real_directory_as_cpython_has_it(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "train.py").write_text(PRINT_PATH0)
    elsewhere = tmp_path / "shared"
    elsewhere.mkdir()
    os.symlink(real / "train.py", elsewhere / "link.py")   # a link to the script
    os.symlink(real, tmp_path / "linkdir")                  # a link to its directory
    cases = [(["train.py"], str(real)), ([str(real / "train.py")], str(elsewhere)),
             (["link.py"], str(elsewhere)), (["-u", "../linkdir/train.py"], str(elsewhere))]
    for args, cwd in cases:
        assert _entry(args, cwd) == _cold_path0(args, cwd), (args, cwd)
        assert _entry(args, cwd) == str(real)


def test_entry_path_for_dash_m_is_the_cwd(tmp_path):
    (tmp_path / "mod_h14b.py").write_text(PRINT_PATH0)
    assert _entry(["-m", "mod_h14b"], str(tmp_path)) == _cold_path0(["-m", "mod_h14b"],
                                                                    str(tmp_path))


def test_safe_path_puts_nothing_first(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(PRINT_PATH0)
    out = subprocess.run([sys.executable, "-c",
                          "import json, sys; from elasticd.workers import warmstart; "
                          f"print(json.dumps(warmstart.entry_path([{str(script)!r}])))"],
                         env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) is None
    assert _cold_path0([str(script)], str(tmp_path), {"PYTHONSAFEPATH": "1"}) != str(tmp_path)


@pytest.mark.parametrize("args", [["missing.py"], []])
def test_a_spare_for_a_missing_script_imports_nothing(tmp_path, args):
    (tmp_path / "torch.py").write_text("raise SystemExit('planted torch imported')\n")
    out = subprocess.run([sys.executable, warmstart.__file__, *args], cwd=tmp_path,
                         input="", capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, ELASTICD_WARM_PRELOAD="torch"))
    assert out.returncode == 0 and "planted" not in out.stderr, out.stderr


def test_a_spare_imports_without_asking_the_cuda_driver_and_its_rank_gets_the_jobs_env(
        tmp_path):
    """torch.cuda.is_available() / device_count() at import (deepspeed and others do)
    start the CUDA driver unless PYTORCH_NVML_BASED_CUDA_CHECK=1, and every process forked
    after that fails CUDA ("Cannot re-initialize CUDA in forked subprocess"): the
    template's ranks are forked. A template or spare imports with it set; the rank then
    has the job's environment, with or without it, as the job gave it."""
    (tmp_path / "probe_h35.py").write_text(
        "import os\nopen(os.path.join(os.path.dirname(__file__), 'at_preload'), 'w').write("
        "os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK', '-'))\n")
    (tmp_path / "train.py").write_text(
        "import os, sys\nopen(sys.argv[1], 'w').write("
        "os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK', '-'))\n")
    for given, want in ((None, "-"), ("0", "0")):
        job_env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)}
        if given is not None:
            job_env["PYTORCH_NVML_BASED_CUDA_CHECK"] = given
        seen = tmp_path / f"in_rank_{given}"
        assignment = {"env": job_env, "cwd": str(tmp_path),
                      "args": ["train.py", str(seen)]}
        spare_env = dict(job_env, ELASTICD_WARM_PRELOAD="probe_h35")
        out = subprocess.run([sys.executable, warmstart.__file__, "train.py", str(seen)],
                             cwd=tmp_path, input=json.dumps(assignment) + "\n",
                             capture_output=True, text=True, timeout=60, env=spare_env)
        assert out.returncode == 0, out.stderr
        assert (tmp_path / "at_preload").read_text() == "1"
        assert seen.read_text() == want
