"""Retention (issue 29, item 7): which finished jobs a node retires (jobs/retention.py,
pure), and the pass that does it (jobs/retirer.py) on a real registry, real log files
and a real run dir with a planted link; the daemon-level case with real users on a
small tmpfs is in test_retention_disk.py."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest

from elasticd import config, statedir
from elasticd.cluster.eventlog import EVENTS, EventLog
from elasticd.trust.sealed import SealedRecords
from elasticd.jobs.jobevent import JobEvent
from elasticd.jobs.registry import JobRecord, JobRegistry
from elasticd.jobs.retention import Budget, Finished, Plan, Scope, Why, decide
from elasticd.jobs.retirer import Retirer
from elasticd.jobs.states import JobState
from elasticd.store import MemoryStore, StoreUnavailable
from elasticd.workers.logrotate import LogKeeper

DAY = 86400.0
MiB = 1 << 20
NOW = 1_000_000_000.0
ROOMY = Budget(max_age=14 * DAY, max_jobs=1000, log_bytes=10 * 1024 * MiB,
               record_bytes=256 * MiB)


def job(name: str, days_ago: float, logs: int = 0, spec: int = 0) -> Finished:
    return Finished(name, NOW - days_ago * DAY, logs, spec)


def picked(plan: Plan) -> list[tuple[str, Scope, Why]]:
    return [(r.job_id, r.scope, r.why) for r in plan.retire]


# -- the decision, no I/O ----------------------------------------------------------

def test_nothing_is_retired_within_the_budget():
    plan = decide([job("a", 1, 5 * MiB, 100), job("b", 13, 1 * MiB, 100)], NOW, ROOMY)
    assert plan.retire == () and plan.sentence() == ""


def test_jobs_past_the_age_go_whole_oldest_first():
    plan = decide([job("new", 1), job("old", 20, 3 * MiB), job("older", 30)], NOW, ROOMY)
    assert picked(plan) == [("older", Scope.WHOLE, Why.AGE), ("old", Scope.WHOLE, Why.AGE)]
    assert plan.freed_log_bytes == 3 * MiB
    assert "retention.max_age" in plan.sentence()


def test_beyond_the_count_the_oldest_go_whole_and_ties_go_by_id():
    budget = Budget(14 * DAY, 2, 10 * 1024 * MiB, 256 * MiB)
    jobs = [job("c", 1), job("b", 2), job("a", 2), job("d", 0.5)]
    assert picked(decide(jobs, NOW, budget)) == [("a", Scope.WHOLE, Why.COUNT),
                                                 ("b", Scope.WHOLE, Why.COUNT)]


def test_past_the_log_budget_the_oldest_lose_their_logs_and_keep_their_records():
    budget = Budget(14 * DAY, 1000, 10 * MiB, 256 * MiB)
    jobs = [job("a", 5, 4 * MiB), job("b", 4, 0), job("c", 3, 4 * MiB), job("d", 2, 4 * MiB)]
    plan = decide(jobs, NOW, budget)
    # 12 MiB > 10: "a" (the oldest with logs) loses them; "b" has none to lose.
    assert picked(plan) == [("a", Scope.LOGS, Why.LOG_BYTES)]
    assert plan.whole() == []
    assert "retire the logs of 1 finished job(s) (retention.log_bytes)" in plan.sentence()
    # A budget below one job's logs leaves none (retention.log_bytes says to keep it above).
    plan = decide(jobs, NOW, Budget(14 * DAY, 1000, 3 * MiB, 256 * MiB))
    assert [x[0] for x in picked(plan)] == ["a", "c", "d"]


def test_logs_retired_whole_count_toward_the_log_budget():
    budget = Budget(14 * DAY, 1000, 10 * MiB, 256 * MiB)
    plan = decide([job("old", 20, 8 * MiB), job("a", 2, 4 * MiB), job("b", 1, 4 * MiB)],
                  NOW, budget)
    assert picked(plan) == [("old", Scope.WHOLE, Why.AGE)]  # 8 MiB left: within


def test_specs_past_their_budget_go_whole():
    budget = Budget(14 * DAY, 1000, 10 * 1024 * MiB, 1000)
    plan = decide([job("a", 3, spec=600), job("b", 2, spec=600), job("c", 1, spec=300)],
                  NOW, budget)
    assert picked(plan) == [("a", Scope.WHOLE, Why.RECORD_BYTES)]


def test_a_full_disk_takes_logs_until_the_shortfall_is_freed():
    plan = decide([job("a", 3, 2 * MiB), job("b", 2, 2 * MiB), job("c", 1, 2 * MiB)], NOW,
                  ROOMY, shortfall=3 * MiB)
    assert picked(plan) == [("a", Scope.LOGS, Why.DISK_FULL), ("b", Scope.LOGS, Why.DISK_FULL)]


def test_every_rule_at_once_and_nothing_twice():
    budget = Budget(10 * DAY, 3, 5 * MiB, 10_000)
    jobs = [job(f"j{i:02d}", 20 - i, MiB, 1000) for i in range(20)]
    plan = decide(jobs, NOW, budget)
    ids = [r.job_id for r in plan.retire]
    assert len(ids) == len(set(ids))
    assert [r.why for r in plan.retire].count(Why.AGE) == 10   # 11..20 days ago
    assert [r.why for r in plan.retire].count(Why.COUNT) == 7  # 3 of the 10 left stay
    assert {r.job_id for r in plan.retire} == {f"j{i:02d}" for i in range(17)}


def test_budget_takes_the_settings():
    cfg = config.load(path="/dev/null", env={}, overrides={"retention.max_jobs": 7})
    b = Budget.from_settings(cfg.retention)
    assert (b.max_age, b.max_jobs, b.log_bytes) == (14 * DAY, 7, 10 * 1024 ** 3)
    with pytest.raises(config.ConfigError, match="retention.log_bytes: must be >= 1048576"):
        config.load(path="/dev/null", env={}, overrides={"retention.log_bytes": 10})
    with pytest.raises(config.ConfigError, match="retention.interval: must be >= 0.05"):
        config.load(path="/dev/null", env={}, overrides={"retention.interval": 0})


# -- safe removal ------------------------------------------------------------------

def test_a_planted_link_never_makes_removal_delete_what_it_points_to(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    runs = tmp_path / "jobs"
    run = runs / "job1"
    (run / "sub").mkdir(parents=True)
    (run / "err.json").write_text("{}")
    os.symlink(precious, run / "link-to-dir")
    os.symlink(precious / "keep.txt", run / "sub" / "link-to-file")
    os.symlink(precious, runs / "job2")  # a link where a run dir should be
    assert statedir.remove_tree(str(runs), "job1") is True
    assert not run.exists()
    assert (precious / "keep.txt").read_text() == "mine"
    with pytest.raises(OSError, match="not a directory"):
        statedir.remove_tree(str(runs), "job2")
    assert (precious / "keep.txt").read_text() == "mine" and os.path.islink(runs / "job2")
    for bad in ("..", "a/b", ""):
        with pytest.raises(OSError):
            statedir.remove_tree(str(runs), bad)
    assert statedir.remove_tree(str(runs), "gone") is False


# -- a pass on a real registry and real files ----------------------------------------

@pytest.fixture
def node(tmp_path):
    """A registry, its logs and run dirs, and settings like a daemon's."""
    sock = tmp_path / "run" / "control.sock"
    state = tmp_path / "state"
    overrides = {"daemon.socket": str(sock), "daemon.state_dir": str(state),
                 "daemon.standalone": True, "daemon.node_id": "node-a", "retention.max_jobs": 3,
                 "retention.log_bytes": MiB, "agent.log_max_bytes": MiB,
                 "snapshot.root": str(tmp_path / "shm")}
    cfg = config.load(path="/dev/null", env={}, overrides=overrides)
    os.makedirs(cfg.logs_dir)
    os.makedirs(cfg.jobs_run_dir)
    registry = JobRegistry(str(state), "node-a", clock=time.time)
    yield cfg, registry
    registry.close()


def ended(registry: JobRegistry, cfg, job_id: str, log_bytes: int, state=JobState.SUCCEEDED,
          lines: bool = True) -> None:
    registry.create(JobRecord(id=job_id, command=["/bin/true"], cwd="/", uid=1000, gid=1000))
    os.makedirs(os.path.join(cfg.logs_dir, job_id))
    os.makedirs(os.path.join(cfg.jobs_run_dir, job_id))
    with open(os.path.join(cfg.logs_dir, job_id, "rank-0.log"), "wb") as fh:
        line = b"x" * 99 + b"\n"
        fh.write(line * (log_bytes // 100) + (b"THE-END\n" if lines else b""))
    if state is not None:
        registry.transition(job_id, JobState.RENDEZVOUS, "joining")
        registry.transition(job_id, JobState.RUNNING, "ran")
        registry.transition(job_id, state, "done")


def retirer(cfg, registry, active=(), forget=None) -> Retirer:
    keeper = LogKeeper(cfg.logs_dir, cfg.agent.log_max_bytes, 1.0, lambda: list(active))
    return Retirer(cfg, registry, keeper, lambda: list(active), forget)


def test_a_job_that_wrote_far_past_the_cap_and_ended_keeps_its_newest_lines(node):
    cfg, registry = node
    ended(registry, cfg, "big", 20 * MiB)  # ended before any periodic check saw it
    retirer(cfg, registry).run_once()
    job_dir = os.path.join(cfg.logs_dir, "big")
    on_disk = sum(os.path.getsize(os.path.join(job_dir, n)) for n in os.listdir(job_dir))
    assert on_disk <= MiB, on_disk
    # The rotated part, then the live log (a rotation on ext4 or xfs cuts the
    # copied head off in whole blocks: less than a block of it stays there).
    kept = b""
    for name in ("rank-0.log.1", "rank-0.log"):
        with open(os.path.join(job_dir, name), "rb") as fh:
            kept += fh.read()
    assert kept.startswith(b"==== elasticd: log rotated (generation 1)")
    assert kept.endswith(b"THE-END\n") and kept.count(b"THE-END") == 1


def test_a_pass_retires_by_count_and_bytes_and_never_a_live_job(node):
    cfg, registry = node
    forgotten = []
    for i in range(5):
        ended(registry, cfg, f"old{i}", 400 * 1024)
    ended(registry, cfg, "running", 3 * MiB, state=None)  # live: its agent runs
    ended(registry, cfg, "ending", 100 * 1024)            # ended, agent not gone yet
    r = retirer(cfg, registry, active=("running", "ending"), forget=forgotten.append)
    plan = r.run_once()
    # 5 finished beyond max_jobs 3: old0 and old1 go whole; the 3 left hold 1.2 MiB
    # of logs, past retention.log_bytes 1 MiB: old2 (the oldest) loses its logs.
    assert [(x.job_id, x.scope) for x in plan.retire] == [
        ("old0", Scope.WHOLE), ("old1", Scope.WHOLE), ("old2", Scope.LOGS)]
    assert forgotten == ["old0", "old1"]
    ids = {j.id for j in registry.list()}
    assert ids == {"old2", "old3", "old4", "running", "ending"}
    assert registry.events(job_id="old0") == []
    kept = registry.get("old2")
    assert kept.state is JobState.SUCCEEDED and kept.logs_retired_at > 0
    assert "logs retired" in registry.events(job_id="old2")[-1].reason
    assert registry.get("old3").logs_retired_at == 0
    assert sorted(os.listdir(cfg.logs_dir)) == ["ending", "old3", "old4", "running"]
    # The running job's logs stay, however big: agent.log_max_bytes bounds them.
    assert os.path.getsize(os.path.join(cfg.logs_dir, "running", "rank-0.log")) > 3 * MiB - 100
    # Run dirs: only the live job's and the one whose agent still runs stay.
    assert sorted(os.listdir(cfg.jobs_run_dir)) == ["ending", "running"]
    assert r.removed_run_dirs == 5


def test_a_run_dir_with_a_planted_link_goes_and_its_target_stays(node, tmp_path):
    cfg, registry = node
    precious = tmp_path / "etc-like"
    precious.mkdir()
    (precious / "shadow").write_text("root's")
    ended(registry, cfg, "j1", 1000)
    os.symlink(precious, os.path.join(cfg.jobs_run_dir, "j1", "error.json"))
    os.symlink(precious, os.path.join(cfg.jobs_run_dir, "stranger"))  # no job, a link
    r = retirer(cfg, registry)
    r.run_once()
    assert not os.path.lexists(os.path.join(cfg.jobs_run_dir, "j1"))
    assert os.path.islink(os.path.join(cfg.jobs_run_dir, "stranger")) and r.errors == 1
    assert (precious / "shadow").read_text() == "root's"


def test_snapshot_dirs_of_jobs_not_live_go_and_nothing_else_there_is_touched(node, tmp_path):
    cfg, registry = node
    root = cfg.snapshot.root
    os.makedirs(root)
    ended(registry, cfg, "done", 1000)
    ended(registry, cfg, "running", 1000, state=None)
    for job_id in ("done", "running", "unknown1"):   # unknown1: left by a killed daemon
        os.makedirs(os.path.join(root, job_id))
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "shadow").write_text("root's")
    os.symlink(precious, os.path.join(root, "linked"))        # named like a job, a link
    os.makedirs(os.path.join(root, ".not-a-job"))
    os.symlink(precious, os.path.join(root, "done", "rank0.a"))
    r = retirer(cfg, registry, active=("running",))
    r.run_once()
    assert sorted(os.listdir(root)) == [".not-a-job", "linked", "running"]
    assert r.removed_snapshot_dirs == 2 and r.errors == 0
    assert os.listdir(precious) == ["shadow"] and (precious / "shadow").read_text() == "root's"


def test_events_of_jobs_known_here_only_by_them_are_retired_by_age(node):
    cfg, registry = node
    now = time.time()
    registry.import_events([
        JobEvent(job_id="theirs", node_id="node-b", origin_seq=1, time=now - 20 * DAY,
                 kind="state", reason="x"),
        JobEvent(job_id="fresh", node_id="node-b", origin_seq=2, time=now,
                 kind="state", reason="y")])
    retirer(cfg, registry).run_once()
    assert registry.events(job_id="theirs") == []
    assert len(registry.events(job_id="fresh")) == 1


def test_a_pass_over_many_finished_jobs_is_quick(node):
    cfg, registry = node
    n = 500
    for i in range(n):
        registry.create(JobRecord(id=f"j{i:04d}", command=["/bin/true"], cwd="/", uid=1000,
                                  gid=1000))
        registry.transition(f"j{i:04d}", JobState.CANCELLED, "done")
        os.makedirs(os.path.join(cfg.logs_dir, f"j{i:04d}"))
    r = retirer(cfg, registry)
    t0 = time.perf_counter()
    r.run_once()  # measures every job once, retires all but 3
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    r.run_once()
    again = time.perf_counter() - t0
    print(f"retention pass: {n} finished jobs {first * 1000:.0f} ms, then {again * 1000:.1f} ms")
    assert len(registry.list()) == 3
    assert first < 20 and again < 2


# -- this node's events in etcd go with the job --------------------------------------

class DownStore(MemoryStore):
    """A MemoryStore whose deletes fail while ``down`` is set."""
    down = False

    def delete_prefix(self, prefix):
        if self.down:
            raise StoreUnavailable("etcd is down (test)")
        return super().delete_prefix(prefix)


def test_a_job_retired_whole_takes_this_nodes_events_in_etcd_once_etcd_answers(node):
    cfg, registry = node
    store = DownStore()
    cfg = dataclasses.replace(cfg, events=dataclasses.replace(cfg.events, retry=0.05))
    events = EventLog(cfg, store, registry, records=SealedRecords(b"k" * 32, "/elasticd"))
    other = f"{EVENTS}/j1/node-b/000000000001"
    store.put(other, "{}")  # another node's event of the job: its own to retire
    events.start()
    try:
        ended(registry, cfg, "j1", 1000)
        deadline = time.monotonic() + 10
        while events.published < registry.last_seq and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(store.list(f"{EVENTS}/j1/node-a")[0]) == 4
        later = lambda: time.time() + 15 * DAY  # noqa: E731
        keeper = LogKeeper(cfg.logs_dir, cfg.agent.log_max_bytes, 1.0, list)
        r = Retirer(cfg, registry, keeper, list, events.forget_job, clock=later)
        store.down = True
        r.run_once()
        assert registry.list() == [] and registry.events(job_id="j1") == []
        assert len(store.list(f"{EVENTS}/j1/node-a")[0]) == 4  # etcd away: kept for later
        store.down = False
        r.run_once()
        assert store.list(f"{EVENTS}/j1")[0][0].key == other
        assert len(store.list(f"{EVENTS}/j1")[0]) == 1
    finally:
        events.stop()
