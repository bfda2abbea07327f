"""Worker templates kept between a user's jobs (workers/template_pool.py).

Real root daemon, two real unprivileged users made here (``h16p_a``,
``h16p_b``), real elasticctl dropping to them, real torch gloo workers. The
script is test_worker_template's: each rank writes what it sees of itself
(torch already imported or not, environment, cwd, ids, argv, ``sys.path[0]``,
its parent) before it imports torch; a cold start of the same job (``python
-X utf8 SCRIPT``, a command no template takes) is the reference.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import psutil
import pytest

from daemons import short_tmpdir
from elasticd.workers.group import GroupSpec
from elasticd.workers.round_place import RoundPlace
from elasticd.workers.template_key import (
    READ_NAMES_MAX, EnvReads, TemplateKey, key_from_record, key_to_record, template_env)
from test_local_trust import User, real_users
from test_worker_template import (
    NOGROUP, PY, SCRIPT, _alive, _neutral, events, seen, state, status, submit,
    wait_for)

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: real users are created and the daemon "
                                       "switches to them (CI runs as root)")

USERS = ("h16p_a", "h16p_b")


@pytest.fixture(scope="module")
def users():
    with real_users(USERS, "h16p-home-") as made:
        yield tuple(made[name.split("_", 1)[1]] for name in USERS)


@pytest.fixture
def work(users):
    base = short_tmpdir("h16p-")
    work = users[0].mkdir(os.path.join(base, "work"))
    with open(os.path.join(work, "train.py"), "w") as fh:
        fh.write(SCRIPT)
    out = users[0].mkdir(os.path.join(work, "out"), 0o777)
    yield work, out
    shutil.rmtree(base, ignore_errors=True)


def start_node(daemon_factory, *settings: str):
    args = ["--set", f"daemon.socket_group={NOGROUP}", "--set", "agent.warm_spares=false"]
    for s in settings:
        args += ["--set", s]
    return daemon_factory(slots=8, extra_args=tuple(args)).start()


def run_job(node, user: User, cwd: str, mode: str, out: str, env: tuple = (),
            cold: bool = False) -> str:
    """``python train.py MODE OUT`` (2 ranks; ``cold``: ``python -X utf8 ...``, which no
    template takes) submitted as ``user``; its id once it SUCCEEDED."""
    extra = [a for kv in env for a in ("--env", kv)]
    python = [PY, "-X", "utf8"] if cold else [PY]
    job_id = submit(node, user, "--nproc-per-node", "2", *extra, "--", *python,
                    os.path.join(cwd, "train.py"), mode, out, cwd=cwd)
    job = node.wait_job(job_id, timeout=240)
    assert state(job) == "SUCCEEDED", (node.rank_log(job_id, 0), node.rank_log(job_id, 1))
    return job_id


def idle_templates(node, user: User | None = None) -> list[psutil.Process]:
    """The daemon's live template processes (of ``user``)."""
    found = []
    for p in psutil.Process(node.proc.pid).children():
        try:
            if "--template" in " ".join(p.cmdline()) and _alive(p) and \
                    (user is None or p.uids().real == user.uid):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def reused(node, job_id: str) -> list[str]:
    return [e["reason"] for e in events(node, job_id)
            if e["kind"] == "template" and "reused from the pool" in e["reason"]]


# ---------------------------------------------------------------- the key

def _spec(**changes) -> GroupSpec:
    base = dict(job_id="j1", command=(PY, "-u", "train.py", "--lr", "1"), cwd="/w",
                env={"PATH": "/usr/bin", "PWD": "/w", "SHLVL": "1",
                     "ELASTICD_STORE_SECRET": "a" * 32}, uid=os.geteuid(), gid=os.getegid(),
                nproc=2, restart_count=0, max_restarts=0,
                place=RoundPlace(round=1, group_rank=0, group_world_size=1, world_size=2,
                                 rank_offset=0, master_addr="", master_port=0),
                log_dir="/l", run_dir="/r")
    base.update(changes)
    return GroupSpec(**base)


def test_two_jobs_share_a_key_only_when_all_that_shapes_imports_is_equal():
    key = TemplateKey.of(_spec(), ["torch"])
    # What differs from one submit to the next, and no import reads: the same key.
    assert TemplateKey.of(_spec(job_id="j2", command=(PY, "-u", "train.py", "--lr", "2"),
                                env={"PATH": "/usr/bin", "PWD": "/elsewhere", "SHLVL": "3",
                                     "ELASTICD_STORE_SECRET": "b" * 32, "RUN_NAME": "exp2",
                                     "SEED": "7", "WANDB_RUN_ID": "x1"},
                                place=RoundPlace(round=7, group_rank=0, group_world_size=1,
                                                 world_size=2, rank_offset=0, master_addr="",
                                                 master_port=1234),
                                log_dir="/l2", run_dir="/r2"),
                          ["torch"]) == key
    env = dict(_spec().env)
    for other in (dict(uid=key.uid + 1), dict(gid=key.gid + 1), dict(cwd="/v"),
                  dict(cpus=(0,)), dict(nproc=1),  # OMP_NUM_THREADS=1 for several ranks
                  dict(command=(PY, "train.py")), dict(command=(PY, "-u", "other.py")),
                  dict(command=("/opt/py/bin/python3", "-u", "train.py")),
                  dict(env=dict(env, PYTHONPATH="/mine")),
                  dict(env=dict(env, LD_LIBRARY_PATH="/lib2")),
                  dict(env=dict(env, LD_PRELOAD="/lib2/x.so")),
                  dict(env=dict(env, TORCH_LOGS="+dynamo")),
                  dict(env=dict(env, OPENBLAS_NUM_THREADS="4")),
                  dict(env=dict(env, CUDA_VISIBLE_DEVICES="1")),
                  dict(env=dict(env, HOME="/h2")), dict(env=dict(env, LC_ALL="C"))):
        assert TemplateKey.of(_spec(**other), ["torch"]) != key, other
    # agent.template_key_env adds names and prefixes.
    run = _spec(env=dict(env, RUN_NAME="exp1"))
    assert TemplateKey.of(run, ["torch"], key_env=("RUN_NAME",)) != \
        TemplateKey.of(_spec(), ["torch"], key_env=("RUN_NAME",))
    assert TemplateKey.of(run, ["torch"], key_env=("RUN_*",)) != \
        TemplateKey.of(_spec(), ["torch"], key_env=("RUN_*",))
    assert TemplateKey.of(run, ["torch"], key_env=("WANDB_*",)) == key
    assert TemplateKey.of(_spec(), ["torch", "numpy"]) != key
    assert TemplateKey.of(_spec(), ["torch"], ["transformers"]) != key
    assert TemplateKey.of(_spec(command=("/bin/sh", "-c", "x")), ["torch"]) is None
    # Modules: sys.path[0] is the cwd whichever module runs.
    assert TemplateKey.of(_spec(command=(PY, "-m", "a.b")), []) == \
        TemplateKey.of(_spec(command=(PY, "-m", "c", "--x")), [])
    assert "PWD" not in dict(key.env) and "ELASTICD_STORE_SECRET" not in dict(key.env)
    assert dict(key.env)["PYTHONPATH"].endswith("worker_site")  # what every worker gets
    # The template imports under the job's environment less what differs per submit.
    made = template_env(run)
    assert made["RUN_NAME"] == "exp1" and made["PATH"] == "/usr/bin"
    assert not {"PWD", "SHLVL", "ELASTICD_STORE_SECRET"} & set(made)


def test_a_job_fits_a_template_only_if_what_its_imports_read_is_the_same():
    made = {"PATH": "/usr/bin", "RUN_NAME": "exp1", "MY_FLAG": "1"}
    reads = EnvReads.of_message(["MY_FLAG", "NOT_SET"])
    assert not reads.whole and reads.names == {"MY_FLAG", "NOT_SET"}
    assert reads.fit(made, dict(made, RUN_NAME="exp2"))          # no import read it
    assert not reads.fit(made, dict(made, MY_FLAG="2"))           # one did
    assert not reads.fit(made, {k: v for k, v in made.items() if k != "MY_FLAG"})
    assert not reads.fit(made, dict(made, NOT_SET=""))            # unset in the template
    # The whole environment walked, or a message the daemon cannot vouch for (the
    # user's code runs in the template): only the very same environment fits.
    for message in ("*", None, 7, ["ok", 3], ["bad-name"], ["x" * 300],
                    ["V%d" % i for i in range(READ_NAMES_MAX + 1)], {"MY_FLAG": 1}):
        whole = EnvReads.of_message(message)
        assert whole.whole, message
        assert whole.fit(made, dict(made)) and not whole.fit(made, dict(made, RUN_NAME="x"))


def test_a_saved_key_reads_back_equal_and_a_bad_one_is_refused():
    spec = _spec(cpus=(0, 1), env=dict(_spec().env, RUN_NAME="exp1"))
    key, env = TemplateKey.of(spec, ["torch"], ["numpy"]), template_env(spec)
    rec = key_to_record(key, env)
    assert key_from_record(json.loads(json.dumps(rec))) == (key, env)
    # The key's variables are agent.template_key_env's at the next start.
    again, _ = key_from_record(rec, ("RUN_*",))
    assert dict(again.env)["RUN_NAME"] == "exp1" and "RUN_NAME" not in dict(key.env)
    for bad in (None, [], dict(rec, uid=-1), dict(rec, uid="0"), dict(rec, cwd=""),
                dict(rec, env=[["A"]]), dict(rec, env={"A": "b"}), dict(rec, flags=["-c"]),
                dict(rec, groups=["x"]), dict(rec, preload="torch")):
        with pytest.raises(ValueError):
            key_from_record(bad)


# ---------------------------------------------------------------- sharing

def test_a_second_job_of_the_same_user_forks_from_the_first_ones_template(
        daemon_factory, users, work):
    node = start_node(daemon_factory)
    a = users[0]
    cwd, out = work
    first = run_job(node, a, cwd, "same", out)
    (template,) = wait_for(lambda: idle_templates(node, a), 30, "the idle template")
    assert seen(out, "same", 0)["ppid"] == template.pid
    assert status(node, first)["template_state"] == "pooled"
    assert any("kept idle" in e["reason"] for e in events(node, first)
               if e["kind"] == "template")
    r = node.ctl("-o", "json", "nodes")
    assert r.returncode == 0, r.stderr
    (shown,) = json.loads(r.stdout)["nodes"][0]["idle_templates"]
    assert shown["pid"] == template.pid and int(shown["uid"]) == a.uid
    assert int(shown["rss_bytes"]) > 0
    assert f"uid {a.uid}  pid {template.pid}" in node.ctl("nodes").stdout

    second = run_job(node, a, cwd, "second", out)
    cold = run_job(node, a, cwd, "cold", out, cold=True)
    assert reused(node, second) and not reused(node, first)
    assert status(node, second)["template_state"] == "pooled"  # handed back again
    assert [e["start_path"] for e in events(node, second) if e["kind"] == "start"] == \
        ["template"]
    script = os.path.join(cwd, "train.py")
    for rank in (0, 1):
        f, c = seen(out, "second", rank), seen(out, "cold", rank)
        assert f["pre"] is True and c["pre"] is False
        assert f["ppid"] == template.pid  # the first job's template forked it
        assert f["env"]["TORCHELASTIC_RUN_ID"] == f["env"]["ELASTICD_JOB_ID"] == second
        assert _neutral(f["env"], second) == _neutral(c["env"], cold)
        assert f["argv"] == [script, "second", out]
        for key in ("name", "path0", "cwd", "uid", "gid", "groups", "umask", "stdin",
                    "sigs", "blocked"):
            assert f[key] == c[key], (key, f[key], c[key])
        assert f["uid"] == a.uid and f["cwd"] == cwd == f["path0"]
    assert [p.pid for p in idle_templates(node, a)] == [template.pid]  # back in the pool


@pytest.mark.slow  # three cold jobs (70 s on 2 busy cores): the default suite's budget
def test_another_user_or_another_environment_gets_a_template_of_its_own(
        daemon_factory, users, work):
    node = start_node(daemon_factory)
    a, b = users
    cwd, out = work
    run_job(node, a, cwd, "same", out)
    (template,) = wait_for(lambda: idle_templates(node, a), 30, "the idle template")
    other_user = run_job(node, b, cwd, "userb", out)
    other_path = run_job(node, a, cwd, "pathed", out, env=(f"PYTHONPATH={cwd}",))
    for job_id, mode in ((other_user, "userb"), (other_path, "pathed")):
        assert not reused(node, job_id)
        r = seen(out, mode, 0)
        assert r["pre"] is True and r["ppid"] != template.pid  # a template of its own
    assert seen(out, "userb", 0)["uid"] == b.uid
    assert cwd in seen(out, "pathed", 0)["env"]["PYTHONPATH"].split(":")
    assert _alive(template)  # untouched, still idle for its own key
    assert len(idle_templates(node, a)) == 2 and len(idle_templates(node, b)) == 1
    # `nodes` shows a user their own idle templates only; root every user's.
    def shown(who=None) -> list[int]:
        r = node.ctl("-o", "json", "nodes", user=who.creds if who else None)
        assert r.returncode == 0, r.stderr
        return sorted(int(t["uid"]) for t in json.loads(r.stdout)["nodes"][0]
                      .get("idle_templates", []))
    assert shown(a) == [a.uid, a.uid] and shown(b) == [b.uid]
    assert shown() == sorted([a.uid, a.uid, b.uid])
    assert f"uid {a.uid}" not in node.ctl("nodes", user=b.creds).stdout


@pytest.mark.slow
def test_a_user_holds_at_most_template_idle_per_user_idle_templates(
        daemon_factory, users, work):
    node = start_node(daemon_factory, "agent.template_idle_per_user=1")
    a, b = users
    cwd, out = work
    run_job(node, a, cwd, "one", out)
    (first,) = wait_for(lambda: idle_templates(node, a), 30, "the idle template")
    run_job(node, b, cwd, "two", out)
    run_job(node, a, cwd, "three", out, env=(f"PYTHONPATH={cwd}",))  # another key
    wait_for(lambda: not _alive(first), 30, "the user's longest idle template to end")
    assert len(idle_templates(node, a)) == 1 and len(idle_templates(node, b)) == 1


# ---------------------------------------------------------------- ends

@pytest.mark.slow
def test_an_idle_template_ends_after_the_idle_timeout(daemon_factory, users, work):
    node = start_node(daemon_factory, "agent.template_idle_timeout=3")
    a = users[0]
    cwd, out = work
    run_job(node, a, cwd, "same", out)
    (template,) = wait_for(lambda: idle_templates(node, a), 30, "the idle template")
    wait_for(lambda: not _alive(template), 60, "the idle template to end")
    assert "idle for" in node.log() and "agent.template_idle_timeout" in node.log()


@pytest.mark.slow
def test_no_template_outlives_its_job_when_the_idle_timeout_is_0(daemon_factory, users,
                                                                 work):
    node = start_node(daemon_factory, "agent.template_idle_timeout=0")
    cwd, out = work
    job_id = run_job(node, users[0], cwd, "same", out)
    wait_for(lambda: not idle_templates(node), 30, "the template to end with its job")
    # The pool stops the process, then the job's record says so (ci85 read it between).
    wait_for(lambda: status(node, job_id)["template_state"] == "stopped", 10,
             "the job's record to say its template stopped")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_no_idle_template_outlives_the_daemon(daemon_factory, users, work, how):
    node = start_node(daemon_factory)
    cwd, out = work
    run_job(node, users[0], cwd, "same", out)
    (template,) = wait_for(lambda: idle_templates(node, users[0]), 30, "the idle template")
    if how == "SIGKILL":
        node.kill()  # no chance to clean up: PDEATHSIG, and its channel closes
    else:
        assert node.stop() == 0  # a clean stop ends the pool's templates
    wait_for(lambda: not _alive(template), 30, "the idle template to die with the daemon")


@pytest.mark.parametrize("content", [b"\x00garbage{", b'{"version": 1, "templates": 7}',
                                     json.dumps({"version": 1, "templates": [
                                         {"key": {"uid": 0}, "boot": ["-c", "x"],
                                          "log_job": "../../etc"}]}).encode()])
def test_a_bad_saved_template_file_is_skipped_and_removed(daemon_factory, content):
    node = daemon_factory(slots=2)
    os.makedirs(node.state_dir, mode=0o700)
    saved = os.path.join(node.state_dir, "idle-templates.json")
    with open(saved, "wb") as fh:
        fh.write(content)
    os.chmod(saved, 0o600)
    node.start()  # serves before it resumes: the file is read just after
    wait_for(lambda: not os.path.exists(saved), 30, "the saved file to be read")
    wait_for(lambda: "not restored" in node.log() or "template skipped" in node.log(), 30,
             "the log line saying why nothing was restored")
    assert not idle_templates(node) and node.proc.poll() is None


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_saved_template_file_that_is_no_regular_file_neither_blocks_nor_is_followed(
        daemon_factory, tmp_path, kind):
    """Read through workers/files.read: a FIFO would block a plain open at start-up,
    and a link could point anywhere; each is refused, removed, and the daemon serves."""
    node = daemon_factory(slots=2)
    os.makedirs(node.state_dir, mode=0o700)
    saved = os.path.join(node.state_dir, "idle-templates.json")
    if kind == "fifo":
        os.mkfifo(saved, 0o600)
    else:
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps({"version": 1, "templates": []}))
        os.symlink(target, saved)
    node.start()
    wait_for(lambda: not os.path.lexists(saved), 30, "the saved file to be removed")
    wait_for(lambda: "not restored" in node.log(), 30, "the log line saying why")
    assert "not a regular file" in node.log()
    assert not idle_templates(node) and node.proc.poll() is None
    if kind == "symlink":
        assert os.path.exists(target)  # the link went, not what it named
