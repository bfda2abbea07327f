"""Which jobs a worker template serves: keyed on what shapes its imports, ready before
the submit (workers/template_key.py, template_pool.py, template_ahead.py, warmstart.py).

Real root daemons, two real unprivileged users made here (``h34_a``, ``h34_b``), real
elasticctl dropping to them. The preload is a module of the test's own
(``agent.warm_preload=h34flag``, beside the script: ``sys.path[0]``) that reads
``H34_FLAG`` at import, so a template is ready in a fraction of a second; the job's
script writes what its rank sees: the flag as the import that made its process saw it,
whether the preload was there before it ran, its environment and its parent.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from daemons import short_tmpdir
from test_local_trust import real_users
from test_template_pool import idle_templates, reused
from test_worker_template import NOGROUP, PY, _alive, events, state, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: real users are created and the daemon "
                                       "switches to them (CI runs as root)")

USERS = ("h34_a", "h34_b")
WORKERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "daemon", "elasticd", "workers")
FLAG_MODULE = "import os\nFLAG = os.environ.get('H34_FLAG')\n"
SLOW_MODULE = "import time\ntime.sleep(120)\n"
SCRIPT = textwrap.dedent("""\
    import json, os, sys
    PRE = "h34flag" in sys.modules
    FLAG = getattr(sys.modules.get("h34flag"), "FLAG", "cold")
    mode, out = sys.argv[1], sys.argv[2]
    seen = {"pre": PRE, "flag": FLAG, "ppid": os.getppid(), "uid": os.getuid(),
            "env": dict(os.environ)}
    with open(os.path.join(out, "%s-%s.json" % (mode, os.environ["RANK"])), "w") as fh:
        json.dump(seen, fh)
    """)


@pytest.fixture(scope="module")
def users():
    with real_users(USERS, "h34-home-") as made:
        yield tuple(made[name.split("_", 1)[1]] for name in USERS)


@pytest.fixture
def work(users):
    base = short_tmpdir("h34-")
    work = users[0].mkdir(os.path.join(base, "work"))
    for name, text in (("train.py", SCRIPT), ("h34flag.py", FLAG_MODULE),
                       ("h34slow.py", SLOW_MODULE)):
        with open(os.path.join(work, name), "w") as fh:
            fh.write(text)
    out = users[0].mkdir(os.path.join(work, "out"), 0o777)
    yield work, out
    shutil.rmtree(base, ignore_errors=True)


def start_node(daemon_factory, *settings: str, preload: str = "h34flag"):
    args = ["--set", f"daemon.socket_group={NOGROUP}", "--set", "agent.warm_spares=false",
            "--set", f"agent.warm_preload={preload}"]
    for s in settings:
        args += ["--set", s]
    return daemon_factory(slots=8, extra_args=tuple(args)).start()


def run(node, user, work, mode: str, *env: str) -> tuple[str, dict]:
    """``python train.py MODE OUT`` on 2 ranks as ``user`` with ``--env`` ``env``; its id
    and what rank 0 saw, once it SUCCEEDED."""
    cwd, out = work
    extra = [a for kv in env for a in ("--env", kv)]
    r = node.ctl("-o", "json", "submit", "--nproc-per-node", "2", *extra, "--", PY,
                 os.path.join(cwd, "train.py"), mode, out, cwd=cwd, user=user.creds)
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["id"]
    job = node.wait_job(job_id, timeout=120)
    assert state(job) == "SUCCEEDED", (node.rank_log(job_id, 0), node.rank_log(job_id, 1))
    with open(os.path.join(out, f"{mode}-0.json")) as fh:
        return job_id, json.load(fh)


def warm(node, user, work, *args: str) -> subprocess.CompletedProcess:
    cwd, _ = work
    return node.ctl("-o", "json", "template", "warm", *args, "--", PY,
                    os.path.join(cwd, "train.py"), cwd=cwd, user=user.creds)


# ---------------------------------------------------------------- what it read

def _reads(code: str, env: dict) -> str:
    """What warmstart records while ``code`` runs (as the preload's imports do)."""
    prog = textwrap.dedent(f"""\
        import json, os, sys
        sys.path.insert(0, {WORKERS!r})
        import warmstart
        plain = type(os.environ).__getitem__, type(os.environ).__iter__
        done = warmstart._record_env_reads()
        os.environ[warmstart.NVML_CUDA_CHECK_ENV] = "1"   # set by the template itself
        os.environ.get(warmstart.NVML_CUDA_CHECK_ENV)
        exec({code!r})
        got = done()
        os.environ.get("H34_AFTER")                           # a rank's own reads
        print(json.dumps({{"got": got, "restored": plain == (
            type(os.environ).__getitem__, type(os.environ).__iter__)}}))
        """)
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                       env=dict(os.environ, **env), timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["restored"]  # ranks run with os.environ as Python made it
    return got["got"]


def test_the_template_lists_the_variables_its_imports_read():
    code = ("import os\nos.environ.get('H34_A'); 'H34_B' in os.environ; os.getenv('H34_C')\n"
            "os.environ['H34_D']; os.environb.get(b'H34_E'); os.environ.setdefault('H34_F', "
            "'x')\n")
    assert _reads(code, {"H34_D": "d"}) == ["H34_A", "H34_B", "H34_C", "H34_D", "H34_E",
                                            "H34_F"]
    for walk in ("dict(os.environ)", "os.environ.copy()", "list(os.environ.items())",
                 "[k for k in os.environ]"):
        assert _reads(f"import os\n{walk}\n", {}) == "*", walk


# ---------------------------------------------------------------- sharing

def test_submits_differing_only_in_a_variable_no_import_reads_share_one_template(
        daemon_factory, users, work):
    node = start_node(daemon_factory, "agent.template_idle_per_user=4",
                      "agent.template_idle_max=8")
    a, b = users
    first, seen1 = run(node, a, work, "exp1", "RUN_NAME=exp1")
    (template,) = wait_for(lambda: idle_templates(node, a), 30, "the idle template")
    assert seen1["pre"] and seen1["ppid"] == template.pid
    for i, mode in enumerate(("exp2", "exp3"), 2):
        job_id, seen = run(node, a, work, mode, f"RUN_NAME={mode}")
        assert reused(node, job_id), events(node, job_id)
        assert seen["ppid"] == template.pid and seen["pre"] and seen["flag"] is None
        assert seen["env"]["RUN_NAME"] == mode and seen["env"]["ELASTICD_JOB_ID"] == job_id
    assert not reused(node, first)
    # A variable the preload read at import, PYTHONPATH, LD_LIBRARY_PATH, another user:
    # a template of its own each, whose import saw the job's own value.
    cwd, _ = work
    for mode, user, env in (("flag", a, "H34_FLAG=2"), ("pypath", a, f"PYTHONPATH={cwd}"),
                            ("ldpath", a, "LD_LIBRARY_PATH=/h34-none"),
                            ("userb", b, "RUN_NAME=exp4")):
        job_id, seen = run(node, user, work, mode, env)
        assert not reused(node, job_id), (mode, events(node, job_id))
        assert seen["pre"] and seen["ppid"] != template.pid and seen["uid"] == user.uid, mode
        assert seen["flag"] == ("2" if mode == "flag" else None), mode
    assert _alive(template)  # untouched, still idle for its own jobs
    # ... and the flag's own template serves the next job with that flag, whatever its name.
    flagged = [p.pid for p in idle_templates(node, a) if p.pid != template.pid]
    job_id, seen = run(node, a, work, "flag2", "H34_FLAG=2", "RUN_NAME=exp5")
    assert reused(node, job_id) and seen["flag"] == "2" and seen["ppid"] in flagged
    assert "not taken: a variable its imports read" in node.log()


# ---------------------------------------------------------------- ready before the submit

@pytest.mark.parametrize("how", ["SIGKILL", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_a_daemon_restart_keeps_the_next_submit_warm(daemon_factory, users, work, how):
    node = start_node(daemon_factory)
    a = users[0]
    run(node, a, work, "before", "RUN_NAME=exp1")
    (before,) = wait_for(lambda: idle_templates(node, a), 30, "the idle template")
    saved = os.path.join(node.state_dir, "idle-templates.json")
    assert os.stat(saved).st_mode & 0o777 == 0o600  # it holds environments: root's alone
    if how == "SIGKILL":
        node.kill()
    else:
        assert node.stop() == 0
    wait_for(lambda: not _alive(before), 30, "the template to end with the daemon")
    node.start()
    (again,) = wait_for(lambda: idle_templates(node, a), 30,
                        "the template started again before any submit")
    assert again.pid != before.pid and again.uids().real == a.uid
    job_id, seen = run(node, a, work, "after", "RUN_NAME=exp2")
    assert any("started again at the daemon's start" in r for r in reused(node, job_id))
    assert seen["pre"] and seen["ppid"] == again.pid and seen["env"]["RUN_NAME"] == "exp2"


def test_template_warm_makes_a_users_first_job_on_the_node_warm(daemon_factory, users, work):
    node = start_node(daemon_factory)
    a, b = users
    r = warm(node, b, work, "--nproc-per-node", "2")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["state"] in ("starting", "ready") and not got.get("already")
    (ahead,) = wait_for(lambda: idle_templates(node, b), 30, "the template started ahead")
    assert ahead.pid == got["pid"] and ahead.uids().real == b.uid
    again = json.loads(warm(node, b, work, "--nproc-per-node", "2").stdout)
    assert again["already"] and again["pid"] == ahead.pid  # asked twice: one template
    shown = wait_for(lambda: [t for t in json.loads(node.ctl(
        "-o", "json", "nodes", user=b.creds).stdout)["nodes"][0].get("idle_templates", [])
        if t["state"] == "ready"], 60, "the template ready in `nodes`")
    assert [(t["pid"], t["origin"]) for t in shown] == [(ahead.pid, "ahead")]
    assert not json.loads(node.ctl("-o", "json", "nodes", user=a.creds).stdout)[
        "nodes"][0].get("idle_templates")  # another user's: not shown, never served
    job_id, seen = run(node, b, work, "first", "RUN_NAME=exp1")
    assert any("started ahead" in r for r in reused(node, job_id))
    assert seen["pre"] and seen["ppid"] == ahead.pid and seen["uid"] == b.uid
    # Checked like a submission: not a command a template runs.
    bad = node.ctl("template", "warm", "--", "/bin/sh", "-c", "true", cwd=work[0],
                   user=b.creds)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr, bad.stderr


def test_templates_started_ahead_are_capped_per_user_and_dropped_after_the_idle_timeout(
        daemon_factory, users, work):
    # A preload that takes two minutes: every template here is still importing.
    # The idle timeout outlasts the two calls below however slow each elasticctl start
    # is (3 s did not, on a loaded machine).
    node = start_node(daemon_factory, "agent.template_idle_timeout=15",
                      "agent.template_idle_per_user=1", preload="h34slow")
    b = users[1]
    first = warm(node, b, work)
    assert first.returncode == 0, first.stderr
    pid = json.loads(first.stdout)["pid"]
    assert json.loads(warm(node, b, work).stdout)["already"]  # the same request
    other = warm(node, b, work, "--env", f"PYTHONPATH={work[0]}")
    assert other.returncode == 1 and "RESOURCE_EXHAUSTED" in other.stderr, other.stderr
    assert "agent.template_idle_per_user" in other.stderr
    wait_for(lambda: not idle_templates(node, b), 60, "the template to be dropped")
    assert "idle for" in node.log() and "agent.template_idle_timeout" in node.log()
    # The pool lets go of the template, then kills it and reaps it (WorkerTemplate.stop:
    # SIGKILL, then up to 5 s for its exit): gone within that, not at the same instant.
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, "the dropped template to exit")


def test_a_template_still_importing_never_holds_a_jobs_cancel(daemon_factory, users, work):
    # The preload takes two minutes and the ready timeout is longer: only a cancel ends
    # a wait for it. (Before: a job that found an idle template importing waited for its
    # imports before doing anything, deaf to a cancel; after a daemon's crash, a rejoining
    # node waited so for the template it restored, while its job ended elsewhere.)
    node = start_node(daemon_factory, "agent.template_ready_timeout=600",
                      "agent.template_idle_per_user=2", preload="h34slow")
    b = users[1]
    cwd, out = work

    def submit(*env: str) -> str:
        extra = [a for kv in env for a in ("--env", kv)]
        r = node.ctl("-o", "json", "submit", "--nproc-per-node", "2", *extra, "--", PY,
                     os.path.join(cwd, "train.py"), "x", out, cwd=cwd, user=b.creds)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["id"]

    def cancelled_at_once(job_id: str) -> None:
        t0 = time.monotonic()
        r = node.ctl("cancel", job_id, user=b.creds)
        assert r.returncode == 0, r.stderr
        assert state(node.wait_job(job_id, timeout=60)) == "CANCELLED"
        assert time.monotonic() - t0 < 30, "the cancel waited for the template's imports"

    # Importing under the job's very environment: taken at once, waited for in its round.
    ahead = json.loads(warm(node, b, work, "--nproc-per-node", "2", "--env",
                            "RUN_NAME=exp1").stdout)
    job_id = submit("RUN_NAME=exp1")
    (said,) = wait_for(lambda: reused(node, job_id), 30, "the importing template taken")
    assert f"pid {ahead['pid']}" in said and "still importing" in said
    node.wait_state(job_id, "RENDEZVOUS", timeout=30)
    cancelled_at_once(job_id)
    assert not os.listdir(out)  # no rank ever ran
    # Importing under another environment: waited for first (its reads decide), until
    # the cancel.
    other = json.loads(warm(node, b, work, "--nproc-per-node", "2", "--env",
                            "RUN_NAME=exp1").stdout)
    job_id = submit("RUN_NAME=exp2")
    wait_for(lambda: f"waiting for idle worker template pid {other['pid']}'s imports"
             in node.log(), 30, "the wait for the importing template")
    cancelled_at_once(job_id)
    assert not reused(node, job_id) and not os.listdir(out)
    assert _alive(psutil.Process(other["pid"]))  # back in the pool, still importing


def test_template_warm_takes_submits_options_and_command():
    from elasticctl import cli
    args = cli.parse_args(["template", "warm", "--nproc-per-node", "2", "--env", "A=b",
                           "-o", "json", "--", "python", "train.py", "--lr", "1"])
    assert (args.action, args.nproc_per_node, args.env, args.output) == \
        ("warm", 2, [("A", "b")], "json")
    assert args.cmd == ["python", "train.py", "--lr", "1"]
    assert cli.main(["template", "warm"]) == 2  # no command
