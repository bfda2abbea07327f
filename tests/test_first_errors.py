"""Errors a person can act on (issue 30): what a new user's first failing job says.

Real daemons, real workers (from the worker template and cold), real files:

* a rank that fails without an error file shows the last lines of its output
  in ``status``: its last line is the cause, the lines the traceback, from the
  template path as from a cold start, and a forked rank's traceback begins at
  the job's own first frame (no ``warmstart.py``/``runpy`` frames);
* a job whose script cannot import a module fails as a crash loop after
  ``agent.crash_loop_limit`` attempts, that line its reason (it restarted 10
  times over ~2.5 minutes before);
* a host whose name does not resolve is named in the daemon's log and in
  ``elasticctl nodes`` at once;
* workers get TORCHELASTIC_SIGNALS_TO_HANDLE as under torchrun;
* the error file a worker writes is read with the one bounded decoder.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from elasticd.agent import failures
from elasticd.jobs.restartpolicy import CrashLoop
from elasticd.jobs.records import Failure
from elasticd.v1 import control_pb2 as pb
from elasticd.workers import env as envnames, hostname
from elasticd.workers.group import not_found

PY = sys.executable

RAISES = """\
import os
def helper():
    raise ValueError("bad value on rank %s" % os.environ["RANK"])
if os.environ["RANK"] == "1":
    helper()
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from daemons import DaemonProc, short_tmpdir
    d = DaemonProc(short_tmpdir(), extra_args=("--set", "agent.warm_spares=false")).start()
    yield d
    d.cleanup()


def _status(d, job_id: str) -> str:
    r = d.ctl("status", job_id)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("path", ["template", "cold"])
def test_a_rank_without_an_error_file_shows_its_last_lines(node, tmp_path, path):
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    # ``python -X utf8 SCRIPT`` is not a command the template takes: it starts cold.
    cmd = [PY, str(script)] if path == "template" else [PY, "-X", "utf8", str(script)]
    job_id = node.submit(*cmd, nproc=2, max_restarts=0, cwd=str(tmp_path))
    job = node.wait_job(job_id)
    assert job.state == pb.FAILED
    assert job.workers and {w.start_path for w in job.workers} == {path}
    f = job.last_failure
    assert f.rank == 1
    assert f.cause == "rank 1 exited with exit code 1: ValueError: bad value on rank 1", f.cause
    assert f"File \"{script}\", line 5, in <module>" in f.traceback, f.traceback
    assert "warmstart.py" not in f.traceback and "runpy" not in f.traceback, f.traceback
    assert f.traceback.startswith("Traceback (most recent call last):"), f.traceback
    shown = _status(node, job_id)
    assert "ValueError: bad value on rank 1" in shown.split("\n", 2)[1], shown
    # The log itself reads as a cold start's would.
    log = node.rank_log(job_id, 1)
    assert "warmstart.py" not in log and "<frozen runpy>" not in log, log


def test_a_script_that_cannot_import_fails_as_a_crash_loop_with_that_line(node, tmp_path):
    (tmp_path / "train.py").write_text("import torch_nowhere_h30\n")
    t0 = time.monotonic()
    job_id = node.submit(PY, "train.py", cwd=str(tmp_path))
    job = node.wait_job(job_id, timeout=120)
    took = time.monotonic() - t0
    assert job.state == pb.FAILED
    line = "ModuleNotFoundError: No module named 'torch_nowhere_h30'"
    assert job.reason.startswith(f"rank 0 exited with exit code 1: {line}; crash loop: "
                                 "it failed the same way in 3 attempts in a row"), job.reason
    assert "agent.crash_loop_limit 3" in job.reason
    assert job.restarts == 2, job.restarts  # three attempts, none more
    assert job.last_failure.cause.endswith(line)
    # Every event on the way named it, and `wait`/`events` say it too.
    restarts = [e for e in node.events(job_id) if e.to_state == pb.RESTARTING]
    assert len(restarts) == 2 and all(line in e.reason for e in restarts)
    waited = node.ctl("wait", job_id)
    assert waited.returncode == 1 and line in waited.stdout + waited.stderr
    print(f"broken import: submit -> FAILED in {took:.1f}s (it took ~144 s, 10 restarts)")


def test_a_crash_loop_is_the_same_failure_without_progress_in_a_row():
    loop = CrashLoop(limit=3)
    a = failures.signature(Failure(rank=0, exit_code=1, cause="rank 0 exited with exit "
                                   "code 1: ImportError: x"))
    same_other_rank = failures.signature(Failure(rank=1, exit_code=1, cause="rank 1 exited "
                                                 "with exit code 1: ImportError: x"))
    other = failures.signature(Failure(rank=0, exit_code=1, cause="rank 0 exited with exit "
                                       "code 1: OSError: y"))
    assert a == same_other_rank and a != other
    assert [loop.note(a, False), loop.note(same_other_rank, False)] == [False, False]
    assert loop.note(other, False) is False           # another way: counted anew
    assert [loop.note(other, False), loop.note(other, False)] == [False, True]
    assert loop.note(other, True) is False and loop.count == 0   # progress resets it
    assert CrashLoop(limit=0).note(a, False) is False   # 0: never
    # What the job record keeps goes on counting in a restarted daemon's agent.
    loop.note(a, False)
    again = CrashLoop.resumed(3, json.loads(json.dumps(loop.saved())))
    assert (again.signature, again.count) == (a, 1) and again.note(a, False) is False
    assert again.note(a, False) is True
    for kept in ([], None, [1, 2], ["1", 1, None, "k", "c"], [True, 1, None, "k", "c"],
                 [1 << 30, 1, None, "k", "c"], [1, 1.5, None, "k", "c"], "x"):
        assert CrashLoop.resumed(3, kept).count == 0, kept


def test_an_error_file_is_decoded_bounded_whatever_the_worker_wrote(tmp_path):
    path = str(tmp_path / "error.json")
    good = {"message": {"message": "RuntimeError: boom",
                        "extraInfo": {"py_callstack": "Traceback ...\nRuntimeError: boom\n",
                                      "timestamp": "1"}}}
    with open(path, "w") as fh:
        json.dump(good, fh)
    report = failures.read_error_file(path)
    assert (report.message, report.traceback) == ("RuntimeError: boom", good["message"][
        "extraInfo"]["py_callstack"])
    for hostile in ("[" * 50000, '{"message": ' * 200 + "1" + "}" * 200,
                    '{"message": {"message": 1e999}}', '{"message": ["x"]}',
                    '{"message": {"extraInfo": "x", "message": "m"}}', "\xff\xfe"):
        with open(path, "w", errors="surrogateescape") as fh:
            fh.write(hostile)
        report = failures.read_error_file(path)  # never raises
        assert report.problem is None
    assert report.message == ""
    with open(path, "w") as fh:
        json.dump({"message": "x" * 5000}, fh)
    assert failures.read_error_file(path, max_bytes=1024).problem is not None  # over the cap


def test_the_tail_of_a_log_is_the_rank_s_own_since_its_latest_start(tmp_path):
    log = tmp_path / "rank-3.log"
    log.write_text("==== elasticd: job j rank 3 starting (restart 0)\nold output\n"
                   "Traceback (most recent call last):\nOldError: before\n"
                   "==== elasticd: job j rank 3 starting (restart 1)\n"
                   + "".join(f"line {i}\n" for i in range(30)) + "KeyError: 'lr'\n\n")
    report = failures.stderr_tail(str(tmp_path), 3, lines=5)
    assert report.message == "KeyError: 'lr'"
    assert report.traceback == "line 26\nline 27\nline 28\nline 29\nKeyError: 'lr'\n"
    assert failures.stderr_tail(str(tmp_path), 3, lines=0).message == ""
    assert failures.stderr_tail(str(tmp_path), 4).message == ""   # no log: blank


def test_workers_get_the_signals_torchrun_hands_them(node, tmp_path):
    out = tmp_path / "signals"
    job_id = node.submit("/bin/sh", "-c", f'echo "$TORCHELASTIC_SIGNALS_TO_HANDLE" > {out}')
    assert node.wait_job(job_id).state == pb.SUCCEEDED
    assert out.read_text().strip() == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default
    job_id = node.submit("/bin/sh", "-c", f'echo "$TORCHELASTIC_SIGNALS_TO_HANDLE" > {out}',
                         env={envnames.SIGNALS_TO_HANDLE: "SIGTERM,SIGUSR1"})
    assert node.wait_job(job_id).state == pb.SUCCEEDED
    assert out.read_text().strip() == "SIGTERM,SIGUSR1"


def test_python_not_found_says_python3_is_there(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(PY)
    said = not_found("python", {"PATH": str(bin_dir)})
    assert said == ("command not found: python (the job's PATH has python3: submit "
                    "`-- python3 ...`)")
    assert not_found("python", {"PATH": str(tmp_path)}) == "command not found: python"


# ---------------------------------------------------------------- a name that does not resolve

UNRESOLVED = "h30-no-such-host"


def _in_own_uts(argv: list) -> list:
    """argv run in a UTS namespace of its own whose hostname resolves nowhere."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {UNRESOLVED} && exec "$@"', "sh", *argv]


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(_in_own_uts(["true"]), capture_output=True).returncode == 0


needs_uts = pytest.mark.skipif(not _unshare_works(),
                               reason="needs root and unshare --uts (a hostname of its own)")


def test_a_name_that_does_not_resolve_is_named_in_a_second():
    assert hostname.problem("localhost") == ""
    t0 = time.monotonic()
    said = hostname.problem(UNRESOLVED + ".invalid")
    assert time.monotonic() - t0 < 1.5
    assert said.startswith(f"this host's name '{UNRESOLVED}.invalid' does not resolve ("), said
    assert "/etc/hosts" in said


@needs_uts
def test_the_daemon_names_a_hostname_that_does_not_resolve(daemon_factory):
    d = daemon_factory()
    d.wrap = _in_own_uts([])
    d.start()
    nodes = d.ctl("nodes")
    assert nodes.returncode == 0, nodes.stderr
    assert f"this host's name '{UNRESOLVED}' does not resolve" in nodes.stdout, nodes.stdout
    assert f"this host's name '{UNRESOLVED}' does not resolve" in d.log()


@needs_uts
def test_the_suite_stops_at_once_on_a_hostname_that_does_not_resolve():
    from daemons import REPO
    t0 = time.monotonic()
    proc = subprocess.run(_in_own_uts([PY, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                                       "tests/test_values.py"]),
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={k: v for k, v in os.environ.items()
                               if k != "ELASTICD_TEST_PREFLIGHT"})
    took = time.monotonic() - t0
    assert proc.returncode == 4, proc.stdout + proc.stderr
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "cannot run here" in line]
    assert len(said) == 1 and f"'{UNRESOLVED}' does not resolve" in said[0], said
    assert took < 30, took  # the interpreter's start and pytest's plugins, then one look
