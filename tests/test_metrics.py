"""Prometheus metrics: a real daemon's /metrics after a real job with a fault,
and the alert rules and dashboard in monitoring/ against what it exports."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemons import free_port, scrape, start_with_metrics
from elasticd import __version__
from elasticd.jobs.registry import JobRecord, JobRegistry
from elasticd.jobs.ladder import Layer
from elasticd.exposition.endpoint import EndpointState, MetricsEndpoint
from elasticd.metrics import CAUSES, LAYERS, Metrics
from elasticd.jobs.records import Failure, FailureKind
from elasticd.jobs.states import JobState
from elasticd.store import CompareFailed, KeyExists, LeaseNotFound, MemoryStore

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "monitoring" / "elasticd.rules.yml"
RULES_TEST = ROOT / "monitoring" / "elasticd.rules.test.yml"
DASHBOARD = ROOT / "monitoring" / "grafana-dashboard.json"
PROMTOOL_MISSING = "needs promtool (Debian package `prometheus`; scripts/setup.sh installs it)"


# -- helpers ---------------------------------------------------------------------
def samples(text: str) -> dict[tuple, float]:
    """{(sample name, ((label, value), ...)): value} of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in found, f"{name}{labels} not in the scrape; have: " + ", ".join(
        sorted({n for n, _ in found if n.startswith(name)}))
    return found[key]


def sample_names(text: str) -> set[str]:
    """Every name a query may use: sample names, and the families declared
    (a family may have no sample yet, e.g. progress beats)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                 "and", "or", "unless", "offset", "inf", "nan", "le"}


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (ours are plain identifiers)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)                     # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)                    # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        word, rest = m.group(0), expr[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue  # a function or a keyword
        if m.start() > 0 and expr[m.start() - 1] in "$0123456789.":
            continue  # a Grafana variable, or a number like 1e9
        names.add(word)
    return names


# -- one real daemon, one real job through a fault -------------------------------
@pytest.fixture(scope="module")
def faulted():
    """(scrape text, the job's events) after a 2-rank job whose rank 1 crashes once."""
    d, port = start_with_metrics()
    try:
        job_id = d.submit(sys.executable, "-m", "elasticd.examples.train", "--steps", "40",
                          "--crash-at-step", "10", nproc=2)
        d.wait_job(job_id, timeout=120)
        deadline = time.monotonic() + 30  # the agent hands its template on after the end
        while d.job(job_id).template_state == "ready" and time.monotonic() < deadline:
            time.sleep(0.05)
        yield scrape(port), d.events(job_id), d
    finally:
        d.cleanup()


def test_counters_follow_the_job_through_its_fault(faulted):
    text, events, _ = faulted
    found = samples(text)
    from elasticd.v1 import control_pb2 as pb
    moves = [pb.JobState.Name(e.to_state) for e in events if e.kind == "state"]
    exits = [e.reason for e in events if e.kind == "worker_exit"]
    assert moves[-1] == "SUCCEEDED", moves
    assert any("exited with exit code 1" in r for r in exits), exits
    # The injected crash is one restart; the sample script's rank 0 sometimes
    # aborts at exit after training (gloo teardown), which is a second, real
    # one. The counters must match what the job's own events say happened.
    restarts = moves.count("RESTARTING")
    by_signal = sum("killed by" in r for r in exits)
    assert value(found, "elasticd_job_transitions_total", to_state="RESTARTING") == restarts
    assert value(found, "elasticd_job_transitions_total", to_state="RUNNING") == \
        moves.count("RUNNING")
    assert value(found, "elasticd_job_transitions_total", to_state="SUCCEEDED") == 1
    assert restarts - by_signal >= 1
    assert value(found, "elasticd_restarts_total", layer="process", cause="exit") == \
        restarts - by_signal
    assert value(found, "elasticd_restarts_total", layer="process", cause="signal") == by_signal
    for layer in LAYERS:
        for cause in CAUSES:
            if layer != "process" or cause not in ("exit", "signal"):
                assert value(found, "elasticd_restarts_total", layer=layer, cause=cause) == 0
    assert value(found, "elasticd_faults_total", cause="exit") == restarts - by_signal
    assert value(found, "elasticd_jobs", state="SUCCEEDED") == 1
    assert value(found, "elasticd_jobs", state="RUNNING") == 0
    assert value(found, "elasticd_workers_started_total") == 2 * moves.count("RUNNING")
    assert value(found, "elasticd_workers_running") == 0
    # Every start of the ranks went through the worker template (on by default).
    paths = [e.start_path for e in events if e.kind == "start"]
    assert paths == ["template"] * moves.count("RUNNING"), paths
    assert value(found, "elasticd_rank_starts_total", path="template") == len(paths)
    assert value(found, "elasticd_rank_start_duration_seconds_count", path="template") == \
        len(paths)
    assert value(found, "elasticd_job_templates") == 0  # it ended with its job
    assert value(found, "elasticd_idle_templates") == 1  # kept for the user's next job
    assert value(found, "elasticd_idle_template_rss_bytes") > 0
    assert value(found, "elasticd_template_reuses_total") == 0
    # Each RUNNING came after a RENDEZVOUS; each restart was recovered.
    assert value(found, "elasticd_rendezvous_duration_seconds_count") == moves.count("RUNNING")
    assert value(found, "elasticd_rendezvous_round_nodes_count") == moves.count("RUNNING")
    assert value(found, "elasticd_rendezvous_round_nodes_sum") == moves.count("RUNNING")  # 1 each
    assert value(found, "elasticd_recovery_duration_seconds_count", layer="process") == restarts
    assert 0 < value(found, "elasticd_recovery_duration_seconds_sum", layer="process") < 60
    assert value(found, "elasticd_control_rpc_duration_seconds_count",
                 method="Submit", code="OK") == 1


def test_node_lease_and_store_are_exported(faulted):
    text, _, d = faulted
    found = samples(text)
    assert value(found, "elasticd_node_lease_ok") == 1
    assert value(found, "elasticd_node_lease_last_refresh_timestamp_seconds") > 0
    assert value(found, "elasticd_node_lease_refreshes_total") >= 1
    assert value(found, "elasticd_node_lease_errors_total") == 0
    assert value(found, "elasticd_node_lease_refresh_duration_seconds_count") == \
        value(found, "elasticd_store_request_duration_seconds_count", operation="refresh_lease")
    # Registering the node is one create under a fresh lease.
    assert value(found, "elasticd_store_request_duration_seconds_count", operation="create") >= 1
    assert value(found, "elasticd_store_request_errors_total", operation="refresh_lease",
                 error="unavailable") == 0
    info = [labels for (name, labels) in found if name == "elasticd_build_info"]
    assert info and dict(info[0])["node_id"] == d.node_id
    assert dict(info[0])["store"] == "memory"


def test_labels_stay_bounded(faulted):
    """No label carries a job id, rank or round; no *_created noise."""
    text, _, _ = faulted
    allowed = {"to_state", "state", "layer", "cause", "operation", "error", "method", "code",
               "le", "version", "node_id", "store",
               "reason",  # elasticd_cluster_specs_rejected_total: one of RejectReason
               "kind",  # elasticd_etcd_records_rejected_total: trust/sealed.Kind (+ Reason)
               "path",  # elasticd_rank_starts_total: template | spare | cold (StartPath)
               "result"}  # elasticd_gpu_health_checks_total: ok | failed
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("elasticd_"), family.name
        for s in family.samples:
            assert set(s.labels) <= allowed, (s.name, s.labels)
            assert not s.name.endswith("_created"), s.name
    assert len(text) < 64 * 1024


def test_promtool_accepts_the_scrape(faulted):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_MISSING)
    proc = subprocess.run([promtool, "check", "metrics"], input=faulted[0], text=True,
                          capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_etcd_outage_shows_as_unavailable_store_requests_and_a_lost_lease(daemon_factory):
    """What ElasticdEtcdUnavailable and ElasticdNodeLeaseLost alert on."""
    from etcd_cluster import cluster_daemon, fresh_prefix
    from etcd_server import EtcdServer, etcd_binary
    if etcd_binary() is None:
        pytest.skip("needs etcd (Debian packages etcd-server, etcd-client)")
    with EtcdServer() as etcd:
        d = cluster_daemon(daemon_factory, etcd.url, "n-a", fresh_prefix(), metrics=True)
        d.start()
        found = samples(scrape(d.metrics_port))
        assert value(found, "elasticd_node_lease_ok") == 1
        assert dict(next(labels for (name, labels) in found
                         if name == "elasticd_build_info"))["store"] in ("etcd3", "etcd2")
        etcd.freeze()  # SIGSTOP: connections are accepted, nothing answers
        try:
            deadline = time.monotonic() + 20
            while True:
                found = samples(scrape(d.metrics_port))
                if value(found, "elasticd_node_lease_ok") == 0 and value(
                        found, "elasticd_store_request_errors_total", operation="refresh_lease",
                        error="unavailable") >= 1:
                    break
                assert time.monotonic() < deadline, sorted(
                    (k, v) for k, v in found.items() if "lease" in k[0] or "errors" in k[0])
                time.sleep(0.2)
            assert value(found, "elasticd_node_lease_errors_total") >= 1
        finally:
            etcd.thaw()


# -- alert rules and dashboard ---------------------------------------------------
def test_promtool_checks_and_unit_tests_the_alert_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_MISSING)
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True,
                          text=True, timeout=60)
    assert test.returncode == 0, test.stdout + test.stderr


def _rule_exprs() -> dict[str, str]:
    import yaml
    rules = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def _dashboard_exprs() -> dict[str, str]:
    dash = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out[f"{panel['title']} {t['refId']}"] = t["expr"]
    return out


def test_alerts_cover_what_operators_need():
    pytest.importorskip("yaml", reason="needs PyYAML to read the rules file")
    exprs = _rule_exprs()
    for needed in ("ElasticdNodeLeaseLost", "ElasticdRestartBudgetBurning",
                   "ElasticdRendezvousStalled", "ElasticdHungRanks", "ElasticdEtcdUnavailable"):
        assert needed in exprs


def test_rules_and_dashboard_use_only_exported_metrics(faulted):
    text = faulted[0]
    exported = sample_names(text)
    exprs = _dashboard_exprs()
    try:
        exprs.update({f"rule {k}": v for k, v in _rule_exprs().items()})
    except ImportError:
        pass  # no PyYAML: the dashboard alone
    assert len(exprs) > 20
    for where, expr in exprs.items():
        names = metric_names_in(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        unknown = {n for n in names if n not in exported}
        assert not unknown, f"{where}: {sorted(unknown)} not exported (expr {expr!r})"
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    for var in variables:
        if var["type"] == "query":
            metric = re.match(r"label_values\((\w+),", var["definition"]).group(1)
            assert metric in exported


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses each query (Grafana's variables filled in) as a recording rule."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_MISSING)
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(_dashboard_exprs().values()):
        expr = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
        lines += [f"      - record: dashboard:q{i}", f"        expr: {json.dumps(expr)}"]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_metric_names_in_reads_promql():
    assert metric_names_in('histogram_quantile(0.99, sum by (le, method) (rate('
                           'elasticd_x_bucket{a="b(c)"}[$__rate_interval])))') == \
        {"elasticd_x_bucket"}
    assert metric_names_in("time() - elasticd_a > 15 and elasticd_b / 1e9 > 0") == \
        {"elasticd_a", "elasticd_b"}


# -- the pieces, without a daemon ------------------------------------------------
def _metrics_on_registry(tmp_path):
    registry = JobRegistry(str(tmp_path), "node-a")
    m = Metrics("node-a")
    registry.listeners.append(m._on_event)
    job = registry.create(JobRecord(id="j1", command=["x"], cwd="/", uid=0, gid=0,
                                    max_restarts=1))
    return registry, m, job.id


def _value(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_a_fault_counts_a_restart_only_when_the_job_restarts(tmp_path):
    registry, m, job = _metrics_on_registry(tmp_path)
    registry.transition(job, JobState.RENDEZVOUS, "round 1")
    registry.transition(job, JobState.RUNNING, "started")
    m.fault_handled(registry.transition(job, JobState.RESTARTING, "restart 1 of 1", restarts=1),
                    Failure(signal=9, cause="rank 0 killed by SIGKILL", time=1.0), Layer.PROCESS)
    assert _value(m, "elasticd_restarts_total", layer="process", cause="signal") == 1
    registry.transition(job, JobState.RENDEZVOUS, "round 2")
    registry.transition(job, JobState.RUNNING, "started")
    assert _value(m, "elasticd_recovery_duration_seconds_count", layer="process") == 1
    assert _value(m, "elasticd_rendezvous_duration_seconds_count") == 2
    # The daemon stopping moves the job to RESTARTING: no fault, no restart.
    registry.transition(job, JobState.RESTARTING, "daemon stopping")
    registry.transition(job, JobState.RUNNING, "resumed")
    # Out of restarts: a fault, but no restart.
    m.fault_handled(registry.transition(job, JobState.FAILED, "no restarts left"),
                    Failure(signal=0, exit_code=1, cause="rank 1 exited"), Layer.PROCESS)
    assert _value(m, "elasticd_faults_total", cause="exit") == 1
    assert _value(m, "elasticd_faults_total", cause="signal") == 1
    assert _value(m, "elasticd_restarts_total", layer="process", cause="exit") == 0
    assert _value(m, "elasticd_recovery_duration_seconds_count", layer="process") == 1
    assert _value(m, "elasticd_job_transitions_total", to_state="RESTARTING") == 2


def test_lost_node_and_hang_restarts_are_labelled(tmp_path):
    registry, m, job = _metrics_on_registry(tmp_path)
    registry.transition(job, JobState.RENDEZVOUS, "round 1")
    registry.transition(job, JobState.RUNNING, "started")
    m.fault_handled(registry.transition(job, JobState.RESTARTING, "node b lost"),
                    Failure(cause="node b lost", kind=FailureKind.NODE_LOST), Layer.RENDEZVOUS)
    assert _value(m, "elasticd_restarts_total", layer="rendezvous", cause="node_lost") == 1
    registry.transition(job, JobState.RUNNING, "round 2")
    m.fault_handled(registry.transition(job, JobState.RESTARTING, "hang"),
                    Failure(signal=9, kind=FailureKind.HANG, cause="rank 0 hang: no progress"),
                    Layer.PROCESS)
    assert _value(m, "elasticd_restarts_total", layer="process", cause="hang") == 1
    assert _value(m, "elasticd_recovery_duration_seconds_count", layer="rendezvous") == 1


def test_progress_beat_age_is_absent_until_beats_come(tmp_path):
    registry, m, job = _metrics_on_registry(tmp_path)

    class Manager:
        slots_total = 4

        @staticmethod
        def slots_used():
            return 0

    m.attach(registry, Manager())
    assert m.registry.get_sample_value("elasticd_job_progress_beat_max_age_seconds") is None
    m.progress_beat(job, at=0.0)
    assert m.registry.get_sample_value("elasticd_job_progress_beat_max_age_seconds") > 0
    registry.transition(job, JobState.CANCELLED, "cancelled")
    assert m.registry.get_sample_value("elasticd_job_progress_beat_max_age_seconds") is None


def test_timed_store_times_requests_and_counts_errors_by_kind():
    m = Metrics("node-a")
    store = m.timed_store(MemoryStore())
    lease = store.grant_lease(5)
    store.create("/a", "1", lease=lease)
    with pytest.raises(KeyExists):
        store.create("/a", "2")
    with pytest.raises(CompareFailed):
        store.compare_and_swap("/a", "3", 12345)
    store.refresh_lease(lease)
    store.revoke_lease(lease)
    with pytest.raises(LeaseNotFound):
        store.refresh_lease(lease)
    assert store.name == "memory" and store.get("/a") is None
    v = lambda name, **labels: m.registry.get_sample_value(name, labels)  # noqa: E731
    assert v("elasticd_store_request_duration_seconds_count", operation="create") == 2
    assert v("elasticd_store_request_errors_total", operation="create",
             error="key_exists") == 1
    assert v("elasticd_store_request_errors_total", operation="compare_and_swap",
             error="compare_failed") == 1
    assert v("elasticd_store_request_errors_total", operation="refresh_lease",
             error="lease_not_found") == 1
    assert v("elasticd_node_lease_refresh_duration_seconds_count") == 2
    assert v("elasticd_build_info", version=__version__, node_id="node-a", store="memory") == 1


def test_endpoint_can_be_turned_off_and_on():
    m = Metrics("node-a")
    off = MetricsEndpoint(m.registry, "127.0.0.1", 0, 1.0)
    off.start()
    assert off.port == 0 and off.status().state is EndpointState.OFF and not off.problem()
    on = MetricsEndpoint(m.registry, "127.0.0.1", free_port(), 0.1)
    on.start()
    try:  # a port taken between free_port and the bind is tried again until it is free
        deadline = time.monotonic() + 10
        while not on.port and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "elasticd_build_info" in scrape(on.port)
    finally:
        on.stop()
    assert on.port == 0


def test_a_job_a_spare_stands_by_for_counts_as_a_spare_not_as_a_stalled_rendezvous(tmp_path):
    from elasticd.metrics.collectors import JobCollector
    registry, m, job = _metrics_on_registry(tmp_path)
    registry.transition(job, JobState.RENDEZVOUS, "round 1")
    registry.update(job, state_since=time.time() - 600)   # ten minutes standing by
    m.registry.register(JobCollector(registry, None, m))
    m.spare_standing(job, True)
    assert _value(m, "elasticd_node_spare_jobs") == 1
    assert _value(m, "elasticd_job_state_max_age_seconds", state="RENDEZVOUS") == 0
    time.sleep(0.3)                # standing by, in RENDEZVOUS
    m.spare_standing(job, False)   # taken: its ranks start
    m.spare_taken(job)
    assert _value(m, "elasticd_node_spare_jobs") == 0
    assert _value(m, "elasticd_spare_takeovers_total") == 1
    assert _value(m, "elasticd_job_state_max_age_seconds", state="RENDEZVOUS") >= 600
    # the takeover's own rendezvous is what the histogram gets, not the wait before it
    registry.transition(job, JobState.RUNNING, "round 2: ranks started")
    assert _value(m, "elasticd_rendezvous_duration_seconds_count") == 1
    assert _value(m, "elasticd_rendezvous_duration_seconds_sum") < 0.3
