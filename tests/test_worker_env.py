"""The worker contract has one home (elasticd/workers/env.py): code that runs in the
job's interpreter without elasticd on its path keeps literal copies of its names,
and those copies must equal the home's values. No daemon, no torch."""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys

from elasticd.hangs import beat_channel, timeouts
from elasticd.jobstore import address
from elasticd.workers import env, inprocess_reports, preload, rank_files
from elasticd.workers.contract import beats

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "daemon", "elasticd")


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_worker_site_copies_equal_the_contract():
    assert beats.ENV_VAR == env.HEARTBEAT_FILE
    assert beats.PRELOAD_ENV == env.PRELOAD_REPORT
    # Read, not imported: importing it would install its hooks in this process.
    with open(os.path.join(PKG, "worker_site", "sitecustomize.py")) as fh:
        site = {t.id: node.value.value for node in ast.parse(fh.read()).body
                if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name) and isinstance(node.value, ast.Constant)}
    assert site["MASTER_BIND_ENV"] == env.MASTER_BIND


def test_warmstart_copies_equal_the_contract():
    warmstart = _load(os.path.join(PKG, "workers", "warmstart.py"), "_h18b_warmstart_under_test")
    assert warmstart.WARM_PRELOAD_ENV == env.WARM_PRELOAD
    assert warmstart.LEARNED_PRELOAD_ENV == env.LEARNED_PRELOAD


def test_daemon_side_names_are_the_contracts():
    assert beat_channel.HEARTBEAT_ENV is env.HEARTBEAT_FILE
    assert timeouts.LIMITS_FILE_ENV is env.LIMITS_FILE
    assert (address.ADDR, address.PORT, address.SECRET) == (
        env.STORE_ADDR, env.STORE_PORT, env.STORE_SECRET)
    assert preload.ENV is env.PRELOAD_REPORT
    assert inprocess_reports.ENV is env.INPROCESS_REPORT
    assert env.INPROCESS_MAX_RESTARTS.startswith(env.INPROCESS_PREFIX)


def test_run_dir_file_names_are_unchanged():
    run = "/run/x"
    assert rank_files.heartbeat_file(run, 3) == "/run/x/heartbeat-rank3"
    assert rank_files.limits_file(run) == "/run/x/hang-limits.json"
    assert preload.report_path(run) == "/run/x/preload-report.txt"
    assert inprocess_reports.report_path(run, 2, 5) == "/run/x/inprocess-rank2-restart5.jsonl"
    assert env.ERROR_FILE_NAME.format(rank=1, restart=4) == "error-rank1-restart4.json"


def test_the_contract_imports_nothing():
    """The in-process library and worker-side code may import it: it stays stdlib-free."""
    code = ("import sys; before = set(sys.modules); import elasticd.workers.env; "
            "new = set(sys.modules) - before - {'elasticd', 'elasticd.workers', "
            "'elasticd.workers.env'}; assert not new, new")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env=dict(os.environ, PYTHONPATH=os.path.dirname(PKG)))
