"""elasticctl without elasticd: parsing, printing, unreachable sockets, and the
client against a small in-test Control server on a real unix socket."""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import tempfile
import threading
from concurrent import futures

import grpc
import pytest

from elasticctl import cli, client as clientlib, output
from elasticd.v1 import control_pb2 as pb
from elasticd.v1 import control_pb2_grpc


@pytest.fixture
def sockdir():
    # Short path: a unix socket path must fit in 108 bytes.
    d = tempfile.mkdtemp(prefix="ectl-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_tokens(monkeypatch):
    monkeypatch.setattr(clientlib, "_tokens", {})
    monkeypatch.delenv("ELASTICD_SOCKET", raising=False)


def failed_job(**kw) -> pb.Job:
    job = pb.Job(id="j1", name="bert", state=pb.FAILED, reason="out of restarts",
                 command=["python", "train.py", "--lr", "3e-4"], cwd="/work", user="alice",
                 uid=1000, min_nodes=2, max_nodes=4, nproc_per_node=2, max_restarts=3,
                 restarts=3, round=4, created_at=1_700_000_000.0, started_at=1_700_000_005.0,
                 finished_at=1_700_000_100.0, exit_code=3,
                 last_failure=pb.Failure(rank=1, exit_code=3, cause="worker exited with code 3",
                                         traceback="Traceback (most recent call last):\n"
                                                   + "".join(f"  line {i}\n" for i in range(20))
                                                   + "ValueError: boom\n",
                                         time=1_700_000_099.0, restart=3, node_id="n1"),
                 workers=[pb.Worker(rank=0, local_rank=0, pid=11, state="stopped", node_id="n1"),
                          pb.Worker(rank=1, local_rank=1, pid=12, state="failed", exit_code=3,
                                    node_id="n1")])
    for k, v in kw.items():
        setattr(job, k, v)
    return job


# ---------------------------------------------------------------- parsing

def test_parse_nnodes_range_and_command_kept_verbatim():
    args = cli.parse_args(["submit", "--nnodes", "2:4", "--nproc-per-node", "8", "--env", "A=b=c",
                           "--", "python", "train.py", "--lr", "3e-4", "-o", "json", "--", "x"])
    assert args.nnodes == (2, 4)
    assert args.nproc_per_node == 8
    assert args.env == [("A", "b=c")]
    assert args.max_restarts == -1
    assert args.cmd == ["python", "train.py", "--lr", "3e-4", "-o", "json", "--", "x"]
    assert args.output == "table"


def test_parse_nnodes_single_value():
    assert cli.parse_nnodes("3") == (3, 3)


@pytest.mark.parametrize("bad", ["x", "4:2", "0", "2:", ":3", "1:x"])
def test_bad_nnodes_is_usage_error(bad, capsys):
    assert cli.main(["submit", "--nnodes", bad, "--", "true"]) == 2
    assert "MIN" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["NOEQUALS", "=v", "1X=v", "A B=v"])
def test_bad_env_is_usage_error(bad, capsys):
    assert cli.main(["submit", "--env", bad, "--", "true"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_submit_without_command_is_usage_error(capsys):
    assert cli.main(["submit", "--name", "x"]) == 2
    assert "after --" in capsys.readouterr().err


def test_output_flag_after_subcommand():
    assert cli.parse_args(["status", "j1", "-o", "json"]).output == "json"
    assert cli.parse_args(["-o", "json", "status", "j1"]).output == "json"


def test_every_command_has_help_with_example(capsys):
    for name in cli.COMMANDS:
        assert cli.main([name, "--help"]) == 0
        assert "example:" in capsys.readouterr().out


# ---------------------------------------------------------------- output

def test_status_table_names_exit_code_and_traceback():
    text = output.job_detail(failed_job(), now=1_700_000_200.0)
    assert "last failure: rank 1 exit code 3 (worker exited with code 3)" in text
    assert "restarts:     3/3" in text
    assert "ValueError: boom" in text
    assert "line 5" not in text  # only the last lines of a long traceback
    assert "2023-11-14" in text and "ago)" in text
    assert "RANK" in text and "failed" in text


def test_status_table_names_signal():
    job = failed_job()
    job.last_failure.exit_code, job.last_failure.signal = -1, 9
    assert "rank 1 killed by signal SIGKILL" in output.job_detail(job)


def test_status_shows_learned_hang_timeouts_and_the_straggler():
    job = failed_job()
    job.hang_timeouts.add(phase="train", soft_seconds=5, hard_seconds=10, learned=True,
                          longest_gap_seconds=0.21, gaps=120)
    job.hang_timeouts.add(phase="checkpoint", soft_seconds=60, hard_seconds=180,
                          longest_gap_seconds=0, gaps=0)
    job.straggler.CopyFrom(pb.Straggler(rank=3, ratio=3.04, step_seconds=0.152,
                                        median_step_seconds=0.05, ranks=4, node_id="n1"))
    lines = output.job_detail(job).splitlines()
    at = lines.index("hang timeouts:")
    assert lines[at + 1].split() == ["PHASE", "KILL", "AFTER", "DUMP", "AFTER", "SOURCE",
                                     "LONGEST", "GAP", "GAPS"]
    assert lines[at + 2].split() == ["train", "10s", "5s", "learned", "0.21s", "120"]
    assert lines[at + 3].split()[:4] == ["checkpoint", "180s", "60s", "fixed"]
    assert ("straggler:    rank 3: 3.04x the median rank's work per step (0.152s vs 0.050s, "
            "4 ranks on node n1)") in lines
    data = output.job_dict(job)
    assert data["hang_timeouts"][0]["hard_seconds"] == 10
    assert data["straggler"]["rank"] == 3


def test_status_names_the_node_of_a_straggler_found_across_nodes():
    job = failed_job()
    job.straggler.CopyFrom(pb.Straggler(rank=5, ratio=3.0, step_seconds=0.15,
                                        median_step_seconds=0.05, ranks=8, node_id="n1",
                                        nodes=2, rank_node_id="n2"))
    assert ("straggler:    rank 5: 3.00x the median rank's work per step (0.150s vs 0.050s, "
            "8 ranks on 2 nodes; rank 5 runs on node n2)") in output.job_detail(job).splitlines()
    assert output.job_dict(job)["straggler"]["rank_node_id"] == "n2"


def test_status_json_has_state_string_and_failure():
    buf = io.StringIO()
    output.Printer("json", buf).job(failed_job())
    data = json.loads(buf.getvalue())
    assert data["state"] == "FAILED"
    assert data["last_failure"]["exit_code"] == 3
    assert data["last_failure"]["signal"] == 0
    assert data["restarts"] == 3 and data["max_restarts"] == 3
    assert data["workers"][1]["exit_code"] == 3


def test_json_last_failure_null_when_nothing_failed():
    buf = io.StringIO()
    output.Printer("json", buf).jobs([pb.Job(id="j2", state=pb.RUNNING)])
    data = json.loads(buf.getvalue())
    assert data["jobs"][0]["state"] == "RUNNING"
    assert data["jobs"][0]["last_failure"] is None


def test_event_json_line():
    buf = io.StringIO()
    printer = output.Printer("json", buf)
    printer.event(pb.Event(seq=7, job_id="j1", kind="state", from_state=pb.PENDING,
                           to_state=pb.RENDEZVOUS))
    printer.event(pb.Event(seq=8, job_id="j1", kind="info", rank=-1))
    first, second = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert first["seq"] == 7 and first["to_state"] == "RENDEZVOUS"
    assert second["from_state"] is None


def test_a_jobs_first_event_names_its_state_without_a_blank_before_it():
    first = output.event_line(pb.Event(seq=1, job_id="j1", kind="state", to_state=pb.PENDING,
                                       reason="submitted by root", time=1.0))
    assert "  j1  PENDING: submitted by root  [" in first
    assert "UNSPECIFIED" not in first
    later = output.event_line(pb.Event(seq=2, job_id="j1", kind="state", from_state=pb.PENDING,
                                       to_state=pb.RENDEZVOUS, time=2.0))
    assert "  j1  PENDING -> RENDEZVOUS  [" in later


def test_log_prefix_per_line():
    buf = io.StringIO()
    printer = output.Printer("table", buf)
    printer.log(0, "a\nb\n", prefix=True)
    printer.log(1, "partial", prefix=True)
    printer.log(1, " rest\n", prefix=True)
    assert buf.getvalue() == "[rank 0] a\n[rank 0] b\n[rank 1] partial rest\n"


def test_wait_exit_code():
    assert cli.wait_exit_code(pb.Job(state=pb.SUCCEEDED)) == 0
    assert cli.wait_exit_code(failed_job()) == 3
    assert cli.wait_exit_code(failed_job(exit_code=300)) == 255
    assert cli.wait_exit_code(pb.Job(state=pb.CANCELLED)) == 1
    killed = failed_job(exit_code=-1)
    killed.last_failure.signal = 9
    assert cli.wait_exit_code(killed) == 137


# ---------------------------------------------------------------- unreachable

def test_missing_socket_exits_3(capsys):
    assert cli.main(["--socket", "/nonexistent/x.sock", "list"]) == 3
    err = capsys.readouterr().err
    assert "cannot reach elasticd at /nonexistent/x.sock" in err
    assert "is the daemon running" in err
    # The system daemon's socket is named too: between its restarts neither exists.
    assert "nor the system daemon's /run/elasticd/control.sock" in err


def test_socket_with_nothing_listening_exits_3(sockdir, capsys):
    path = os.path.join(sockdir, "control.sock")
    for p in (path, path + ".cred"):  # bound, never listening: a dead daemon's leftovers
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(p)
        s.close()
    assert cli.main(["--socket", path, "status", "j1"]) == 3
    assert "nothing is listening" in capsys.readouterr().err


def test_not_a_socket_exits_3(sockdir, capsys):
    path = os.path.join(sockdir, "file")
    open(path, "w").close()
    assert cli.main(["--socket", path, "list"]) == 3
    assert "not a socket" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root is never denied")
def test_permission_denied_mentions_group(sockdir, capsys):
    path = os.path.join(sockdir, "control.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0)
    assert cli.main(["--socket", path, "list"]) == 3
    assert "elasticd' group" in capsys.readouterr().err
    s.close()


# ---------------------------------------------------------------- a small Control server

class FakeControl(control_pb2_grpc.ControlServicer):
    """Answers from a dict of jobs; checks the token like the daemon does."""

    def __init__(self):
        self.valid_tokens = {"tok-1"}
        self.submits: list[pb.SubmitRequest] = []
        self.jobs = {"j1": failed_job()}
        self.waits = 0

    def _auth(self, context):
        token = dict(context.invocation_metadata()).get("elasticd-token")
        if token not in self.valid_tokens:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "credential token expired")

    def _job(self, job_id, context):
        for job in self.jobs.values():
            if job_id in (job.id, job.name):
                return job
        context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")

    def Submit(self, request, context):
        self._auth(context)
        self.submits.append(request)
        job = pb.Job(id="j2", name=request.name, state=pb.PENDING, max_restarts=3)
        self.jobs["j2"] = job
        return pb.SubmitResponse(job=job)

    def ListJobs(self, request, context):
        self._auth(context)
        return pb.ListJobsResponse(jobs=list(self.jobs.values()))

    def GetJob(self, request, context):
        self._auth(context)
        return self._job(request.id, context)

    def WaitJob(self, request, context):
        self._auth(context)
        job = self._job(request.id, context)
        self.waits += 1
        if job.id == "j2" and self.waits >= 2:
            job.state = pb.SUCCEEDED
        return job

    def Logs(self, request, context):
        self._auth(context)
        self._job(request.id, context)
        for rank in (0, 1):
            if not request.HasField("rank") or request.rank == rank:
                yield pb.LogChunk(rank=rank, text=f"hello from {rank}\n")

    def Events(self, request, context):
        self._auth(context)
        yield pb.Event(seq=1, job_id="j1", kind="state", from_state=pb.PENDING,
                       to_state=pb.RENDEZVOUS, time=1_700_000_000.0, reason="slots free")

    def ListNodes(self, request, context):
        self._auth(context)
        return pb.ListNodesResponse(nodes=[pb.Node(node_id="n1", state="ready", slots=8,
                                                   slots_free=6)], store="memory",
                                    store_health="ok")


@pytest.fixture
def daemon(sockdir):
    path = os.path.join(sockdir, "control.sock")
    servicer = FakeControl()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    control_pb2_grpc.add_ControlServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    issued = iter(["tok-0", "tok-1", "tok-2"])  # the first token is already stale
    cred = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cred.bind(path + ".cred")
    cred.listen(8)

    def serve_tokens():
        while True:
            try:
                conn, _ = cred.accept()
            except OSError:
                return
            with conn:
                conn.sendall((next(issued, "tok-x") + "\n").encode())

    threading.Thread(target=serve_tokens, daemon=True).start()
    servicer.path = path
    yield servicer
    cred.close()
    server.stop(0)


def test_submit_sends_cwd_env_and_command(daemon, capsys, monkeypatch):
    monkeypatch.setenv("FROM_SHELL", "1")
    rc = cli.main(["--socket", daemon.path, "submit", "--name", "bert", "--nnodes", "2:4",
                   "--env", "LR=3e-4", "--", "python", "train.py", "--flag"])
    assert rc == 0
    assert capsys.readouterr().out.strip() == "j2"
    req = daemon.submits[0]
    assert list(req.command) == ["python", "train.py", "--flag"]
    assert (req.min_nodes, req.max_nodes, req.max_restarts) == (2, 4, -1)
    assert req.cwd == os.getcwd()
    assert req.env["FROM_SHELL"] == "1" and req.env["LR"] == "3e-4"


def test_submit_sends_gpus_per_node_only_when_given(daemon, capsys):
    assert cli.main(["--socket", daemon.path, "submit", "--", "python", "t.py"]) == 0
    assert cli.main(["--socket", daemon.path, "submit", "--gpus-per-node", "0",
                     "--cpu-bind", "numa", "--", "python", "t.py"]) == 0
    default, given = daemon.submits[-2:]
    assert not default.HasField("gpus_per_node") and default.cpu_bind == "none"
    assert given.HasField("gpus_per_node") and given.gpus_per_node == 0
    assert given.cpu_bind == "numa"


def test_status_and_nodes_tables_show_gpus():
    job = failed_job(gpus_per_node=2, cpu_bind="numa")
    for w in job.workers:
        w.gpus.extend([4, 5])
        w.cpus = "48-95"
    lines = output.job_detail(job).splitlines()
    assert "gpus:         2 per node, CPUs bound to their NUMA node" in lines
    at = lines.index("workers:")
    assert lines[at + 1].split()[-2:] == ["GPUS", "CPUS"]
    assert lines[at + 2].split()[-2:] == ["4,5", "48-95"]
    resp = pb.ListNodesResponse(store="etcd3", store_health="ok", nodes=[
        pb.Node(node_id="n1", state="ready", slots=8, slots_free=4, gpus=8, gpus_free=6,
                gpu_source="nvml", gpu_health="ok",
                devices=[pb.NodeGpu(index=0, uuid="GPU-a", memory_mib=81559, numa_node=0,
                                    cpus="0-47", job_id="j1")]),
        pb.Node(node_id="n2", state="draining", slots=8, slots_free=8, suspect="workers of 3 "
                "different jobs failed here")])
    text = output.nodes_table(resp)
    assert "6/8" in text and "FREE/GPUS" in text
    assert "GPUs of n1 (nvml, health ok):" in text
    assert "0  GPU-a  81559 MiB  numa 0  cpus 0-47  job j1" in text
    assert "suspect: n2: workers of 3 different jobs failed here" in text


def test_submit_wait_json_exits_with_job_code(daemon, capsys):
    rc = cli.main(["--socket", daemon.path, "-o", "json", "submit", "--wait", "--", "true"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["state"] == "SUCCEEDED"


def test_wait_failed_job_exits_with_its_code(daemon, capsys):
    assert cli.main(["--socket", daemon.path, "wait", "bert"]) == 3
    assert "exit code 3" in capsys.readouterr().out


def test_status_and_unknown_job(daemon, capsys):
    assert cli.main(["--socket", daemon.path, "status", "j1"]) == 0
    assert "exit code 3" in capsys.readouterr().out
    assert cli.main(["--socket", daemon.path, "status", "nope"]) == 1
    assert "elasticctl: NOT_FOUND: no job 'nope'" in capsys.readouterr().err


def test_logs_prefix_ranks(daemon, capsys):
    assert cli.main(["--socket", daemon.path, "logs", "j1"]) == 0
    assert capsys.readouterr().out == "[rank 0] hello from 0\n[rank 1] hello from 1\n"
    assert cli.main(["--socket", daemon.path, "logs", "j1", "--rank", "1"]) == 0
    assert capsys.readouterr().out == "hello from 1\n"


def test_list_events_nodes_json(daemon, capsys):
    assert cli.main(["--socket", daemon.path, "-o", "json", "list"]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"][0]["id"] == "j1"
    assert cli.main(["--socket", daemon.path, "-o", "json", "events", "j1"]) == 0
    assert json.loads(capsys.readouterr().out)["to_state"] == "RENDEZVOUS"
    assert cli.main(["--socket", daemon.path, "-o", "json", "nodes"]) == 0
    node = json.loads(capsys.readouterr().out)["nodes"][0]
    assert (node["node_id"], node["state"], node["slots"]) == ("n1", "ready", 8)


def test_cred_error_line_is_reported(sockdir, capsys):
    path = os.path.join(sockdir, "control.sock")
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ctl.bind(path)
    cred = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cred.bind(path + ".cred")
    cred.listen(1)

    def answer():
        conn, _ = cred.accept()
        with conn:
            conn.sendall(b"ERR unknown user 4242\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    assert cli.main(["--socket", path, "list"]) == 1
    assert "unknown user 4242" in capsys.readouterr().err
    t.join(5)
    ctl.close()
    cred.close()


def test_grpc_unavailable_exits_3(sockdir, capsys):
    """The credential socket answers but nothing serves gRPC: UNAVAILABLE -> 3."""
    path = os.path.join(sockdir, "control.sock")
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ctl.bind(path)  # never listens
    cred = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cred.bind(path + ".cred")
    cred.listen(1)

    def answer():
        conn, _ = cred.accept()
        with conn:
            conn.sendall(b"tok\n")

    threading.Thread(target=answer, daemon=True).start()
    assert cli.main(["--socket", path, "list"]) == 3
    assert f"cannot reach elasticd at {path}" in capsys.readouterr().err
    ctl.close()
    cred.close()


def test_expired_token_is_fetched_again(daemon, capsys):
    """The cred socket's first token is already stale: the client asks once more."""
    assert daemon.valid_tokens == {"tok-1"}
    assert cli.main(["--socket", daemon.path, "status", "j1"]) == 0
    assert clientlib._tokens[daemon.path] == "tok-1"


def test_wait_timeout_exits_1(daemon, capsys):
    daemon.jobs["j3"] = pb.Job(id="j3", state=pb.RUNNING)
    assert cli.main(["--socket", daemon.path, "wait", "j3", "--timeout", "0.3"]) == 1
    assert "still running after 0.3 s" in capsys.readouterr().err


def test_cancel_of_live_job_says_cancelling():
    buf = io.StringIO()
    output.Printer("table", buf).cancelled(pb.Job(id="j3", state=pb.RUNNING))
    assert buf.getvalue() == "j3 cancelling (now RUNNING)\n"


def test_socket_from_environment(monkeypatch, capsys):
    monkeypatch.setenv("ELASTICD_SOCKET", "/nonexistent/env.sock")
    assert cli.main(["nodes"]) == 3
    assert "/nonexistent/env.sock" in capsys.readouterr().err


def test_a_full_listen_queue_on_the_credential_socket_is_waited_out_not_an_error(sockdir):
    """A connect with a timeout fails at once with EAGAIN while the daemon's listen
    queue is full (a burst of clients, or someone holding connections); the
    client tries again until its own timeout (CI once failed on this under load)."""
    path = os.path.join(sockdir, "c.sock.cred")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    held = []
    try:
        while True:  # fill the queue: a connect that cannot wait now says EAGAIN
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            held.append(s)
        assert held
        def drain():  # the daemon catches up a moment later
            for _ in range(len(held) + 1):
                conn, _ = server.accept()
                conn.sendall(b"ERR test: answered\n")
                conn.close()
        timer = threading.Timer(0.3, drain)
        timer.start()
        with pytest.raises(clientlib.CredentialError, match="answered"):
            clientlib.fetch_token(path[:-len(clientlib.CRED_SUFFIX)])
        timer.join()
    finally:
        for s in held:
            s.close()
        server.close()
