"""Malformed, hostile and fuzzed requests on the control and credential sockets.

A real elasticd, its real sockets; requests built as protobuf messages and sent
through elasticctl's Client (which fetches a real token), or through a raw
gRPC channel / a raw socket where the point is to skip what the client does.
Every refusal must be a clean status code whose message names the field, and
the daemon must answer the next call.
"""
from __future__ import annotations

import os
import re
import socket
import struct
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemons import DaemonProc, short_tmpdir
from elasticctl.client import fetch_token
from elasticd.v1 import control_pb2 as pb
from elasticd.v1 import control_pb2_grpc as pb_grpc

TERMINAL = {pb.SUCCEEDED, pb.FAILED, pb.CANCELLED}
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.ALREADY_EXISTS}


@pytest.fixture(scope="module")
def d():
    """One daemon, two slots: whatever the fuzz gets accepted runs small."""
    daemon = DaemonProc(short_tmpdir(), node_id="fuzz", slots=2)
    daemon.start()
    yield daemon
    daemon.cleanup()


def base(d: DaemonProc, **fields) -> pb.SubmitRequest:
    req = pb.SubmitRequest(command=["/bin/true"], cwd=d.root,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    for key, value in fields.items():
        if key == "command":
            del req.command[:]
            req.command.extend(value)
        elif key == "env":
            req.env.clear()
            req.env.update(value)
        else:
            setattr(req, key, value)
    return req


def refused(d: DaemonProc, method: str, request) -> grpc.RpcError:
    """The RpcError the daemon answers ``request`` with (fails if it accepts it)."""
    with d.client() as c:
        try:
            if method in ("Logs", "Events"):
                list(c.stream(method, request, timeout=10))
            else:
                c.call(method, request)
        except grpc.RpcError as exc:
            return exc
    raise AssertionError(f"{method} accepted {str(request)[:300]!r}")


def answers(d: DaemonProc) -> None:
    """The daemon is alive and serving."""
    assert d.proc.poll() is None, f"elasticd died:\n{d.log()[-4000:]}"
    with d.client() as c:
        c.call("ListJobs", pb.ListJobsRequest())


def log_mark(d: DaemonProc) -> int:
    return len(d.log())


def no_internal_errors(d: DaemonProc, since: int) -> None:
    """No call since ``since`` (a log_mark) ended in INTERNAL (logged as 'control X failed')."""
    text = d.log()[since:]
    assert not re.findall(r"control \w+ failed", text), text[-4000:]


def settle(d: DaemonProc, job_ids) -> None:
    """Cancel what is still live among ``job_ids`` and wait for all to end."""
    with d.client() as c:
        for job_id in job_ids:
            if c.call("GetJob", pb.GetJobRequest(id=job_id)).state not in TERMINAL:
                c.call("CancelJob", pb.CancelJobRequest(id=job_id))
    for job_id in job_ids:
        d.wait_job(job_id, timeout=30)


# ---------------------------------------------------------------- Submit fields

BAD_SUBMITS = {
    "empty command": (dict(command=[]), "command"),
    "blank program": (dict(command=["  ", "x"]), "command"),
    "nproc -1": (dict(nproc_per_node=-1), "nproc_per_node"),
    "nproc 10**6": (dict(nproc_per_node=10 ** 6), "nproc_per_node"),
    "nproc int32 max": (dict(nproc_per_node=2 ** 31 - 1), "nproc_per_node"),
    "max_restarts -5": (dict(max_restarts=-5), "max_restarts"),
    "max_restarts huge": (dict(max_restarts=2 ** 31 - 1), "max_restarts"),
    "min_nodes -3": (dict(min_nodes=-3), "min_nodes"),
    "max_nodes below min": (dict(min_nodes=3, max_nodes=2), "max_nodes"),
    "cwd empty": (dict(cwd=""), "cwd"),
    "cwd relative": (dict(cwd="relative/dir"), "cwd"),
    "cwd missing": (dict(cwd="/nonexistent/elasticd-test"), "cwd"),
    "cwd a file": (dict(cwd="/etc/passwd"), "cwd"),
    "cwd with NUL": (dict(cwd="/tmp\x00/x"), "cwd"),
    "env name starts with digit": (dict(env={"1BAD": "x"}), "1BAD"),
    "env name with =": (dict(env={"A=B": "x"}), "A=B"),
    "env name empty": (dict(env={"": "x"}), "env"),
    "env value with NUL": (dict(env={"OK": "a\x00b"}), "env[OK]"),
    "100 KB argument": (dict(command=["/bin/true", "x" * 100_000]), "command[1]"),
    "10_000 arguments": (dict(command=["/bin/true"] + ["a"] * 9_999), "command"),
    "NUL in argument": (dict(command=["/bin/true", "a\x00b"]), "command[1]"),
    "NUL in program": (dict(command=["/bin/true\x00"]), "command[0]"),
    "bad name": (dict(name="../x"), "name"),
    "name too long": (dict(name="n" * 64), "name"),
}


@pytest.mark.parametrize("case", list(BAD_SUBMITS), ids=list(BAD_SUBMITS))
def test_bad_submit_is_invalid_argument_naming_the_field(d, case):
    fields, named = BAD_SUBMITS[case]
    exc = refused(d, "Submit", base(d, **fields))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
    assert named in exc.details()
    assert len(exc.details()) < 1000  # one readable line, not an echo of the request


def test_nproc_zero_means_one(d):
    with d.client() as c:
        job = c.call("Submit", base(d, nproc_per_node=0)).job
    assert job.nproc_per_node == 1
    assert d.wait_job(job.id, timeout=30).state == pb.SUCCEEDED


def test_job_that_cannot_fit_or_needs_a_cluster_is_failed_precondition(d):
    exc = refused(d, "Submit", base(d, nproc_per_node=3))  # 2 slots
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "slots" in exc.details()
    exc = refused(d, "Submit", base(d, min_nodes=2))       # standalone: one node
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "standalone" in exc.details()


def test_name_of_a_live_job_cannot_be_reused(d):
    sleeper = ["/bin/sleep", "30"]
    with d.client() as c:
        job = c.call("Submit", base(d, command=sleeper, name="dup")).job
    try:
        exc = refused(d, "Submit", base(d, command=sleeper, name="dup"))
        assert exc.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in exc.details()
    finally:
        settle(d, [job.id])
    # Once it has ended, the name is free again.
    with d.client() as c:
        again = c.call("Submit", base(d, name="dup")).job
    d.wait_job(again.id, timeout=30)


def test_five_megabyte_request_is_resource_exhausted(d):
    big = base(d, command=["/bin/true"] + ["y" * 60_000] * 90)  # ~5.4 MB, each arg < 64 KB
    assert big.ByteSize() > 5_000_000
    exc = refused(d, "Submit", big)
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    answers(d)


# ---------------------------------------------------------------- job ids

@pytest.mark.parametrize("method,request_type", [
    ("GetJob", pb.GetJobRequest), ("CancelJob", pb.CancelJobRequest),
    ("WaitJob", pb.WaitJobRequest), ("Logs", pb.LogsRequest), ("Events", pb.EventsRequest)])
def test_unknown_and_malformed_job_ids(d, method, request_type):
    exc = refused(d, method, request_type(id="nosuchjob"))
    assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()
    assert "nosuchjob" in exc.details()
    for bad in ("../../etc", "a/b", "x" * 200, "job\x00", " spaced"):
        exc = refused(d, method, request_type(id=bad))
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, exc.details())
        assert exc.details().startswith("id:")


def test_empty_job_id_is_invalid_argument(d):
    for method, request in (("GetJob", pb.GetJobRequest()), ("CancelJob", pb.CancelJobRequest()),
                            ("WaitJob", pb.WaitJobRequest()), ("Logs", pb.LogsRequest())):
        exc = refused(d, method, request)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, exc.details())


def test_bad_wait_and_logs_arguments_on_a_real_job(d):
    with d.client() as c:
        job_id = c.call("Submit", base(d)).job.id
    d.wait_job(job_id, timeout=30)
    for timeout in (-1.0, float("nan")):
        exc = refused(d, "WaitJob", pb.WaitJobRequest(id=job_id, timeout_seconds=timeout))
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_seconds" in exc.details()
    for req in (pb.LogsRequest(id=job_id, rank=5), pb.LogsRequest(id=job_id, rank=-1)):
        exc = refused(d, "Logs", req)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank" in exc.details()
    exc = refused(d, "Logs", pb.LogsRequest(id=job_id, tail_lines=-1))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "tail_lines" in exc.details()


# ---------------------------------------------------------------- identity

def raw_stub(d: DaemonProc):
    channel = grpc.insecure_channel(f"unix:{d.socket}")
    return channel, pb_grpc.ControlStub(channel)


def test_call_without_a_token_is_unauthenticated(d):
    channel, stub = raw_stub(d)
    with channel:
        for call, req in ((stub.ListJobs, pb.ListJobsRequest()),
                          (stub.Submit, base(d)),
                          (stub.GetJob, pb.GetJobRequest(id="nosuchjob")),
                          (stub.ListNodes, pb.ListNodesRequest())):
            with pytest.raises(grpc.RpcError) as exc:
                call(req, timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ".cred" in exc.value.details()  # says where a token comes from
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Events(pb.EventsRequest(), timeout=10))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_forged_tokens_are_unauthenticated(d):
    mark = log_mark(d)
    real = fetch_token(d.socket)
    body, _, mac = real.rpartition(":")
    version, uid, gid, pid, expiry, nonce = body.split(":")
    forged = [
        "forged",
        f"v1:0:0:1:{int(time.time()) + 3600}:{nonce}:{'0' * 64}",  # root, made-up signature
        f"v1:12345:{gid}:{pid}:{expiry}:{nonce}:{mac}",               # another uid, old signature
        f"{body}:{mac[:-1]}{'0' if mac[-1] != '0' else '1'}",          # one digit off
        f"v2:{uid}:{gid}:{pid}:{expiry}:{nonce}:{mac}",
        real + "x" * 600,
        ":",
        "",
    ]
    channel, stub = raw_stub(d)
    with channel:
        for token in forged:
            with pytest.raises(grpc.RpcError) as exc:
                stub.ListJobs(pb.ListJobsRequest(), timeout=10,
                              metadata=(("elasticd-token", token),))
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, (token, exc.value)
        # The real one works on the same channel.
        stub.ListJobs(pb.ListJobsRequest(), timeout=10, metadata=(("elasticd-token", real),))
    no_internal_errors(d, mark)


# A gRPC client refuses to send non-ASCII metadata, but the socket takes any
# bytes: speak just enough HTTP/2 by hand (HPACK literals, no Huffman).

def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def raw_grpc_call(path: str, method: str, headers: list[tuple[bytes, bytes]],
                  message: bytes = b"") -> bytes:
    """One hand-made gRPC call; returns the raw bytes the server sent back."""
    block = b"".join(_literal(k, v) for k, v in [
        (b":method", b"POST"), (b":scheme", b"http"),
        (b":path", f"/elasticd.v1.Control/{method}".encode()), (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers"), *headers])
    body = b"\x00" + struct.pack(">I", len(message)) + message
    out = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"")
                  + _frame(1, 4, 1, block) + _frame(0, 1, 1, body))
        deadline = time.monotonic() + 5
        while b"grpc-status" not in out and time.monotonic() < deadline:
            try:
                part = s.recv(65536)
            except socket.timeout:
                break
            if not part:
                break
            out += part
        # The trailer's value may arrive just after its name.
        try:
            s.settimeout(0.3)
            out += s.recv(65536)
        except (socket.timeout, OSError):
            pass
    return out


def grpc_status(raw: bytes) -> int | None:
    m = re.search(rb"grpc-status[\x00-\x7f](\d+)", raw)
    return int(m.group(1)) if m else None


def test_raw_http2_helper_sees_unauthenticated_without_token(d):
    # Checks the hand-made client above against a case with a known answer.
    raw = raw_grpc_call(d.socket, "ListJobs", [])
    assert grpc_status(raw) == grpc.StatusCode.UNAUTHENTICATED.value[0], raw[-300:]


def test_non_ascii_token_is_unauthenticated_not_internal(d):
    token = "v1:0:0:1:99999999999:ab:é".encode()
    raw = raw_grpc_call(d.socket, "ListJobs", [(b"elasticd-token", token)])
    answers(d)
    assert grpc_status(raw) == grpc.StatusCode.UNAUTHENTICATED.value[0], raw[-300:]


def test_undecodable_request_body_leaves_the_daemon_serving(d):
    token = fetch_token(d.socket).encode()
    for body in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\x0f", os.urandom(512)):
        raw = raw_grpc_call(d.socket, "Submit", [(b"elasticd-token", token)], body)
        assert grpc_status(raw) not in (None, grpc.StatusCode.OK.value[0]), raw[-300:]
    answers(d)


# ---------------------------------------------------------------- garbage on the sockets

def test_garbage_bytes_on_the_control_socket(d):
    payloads = [os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 65536,
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(2048),
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(1, 4, 1, os.urandom(200)),
                b"PRI * HTTP/2.0\r\n"]  # then hang up mid-preface
    for data in payloads:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(d.socket)
            try:
                s.sendall(data)
                s.recv(4096)
            except OSError:
                pass  # the daemon may hang up on us: that is fine
    # A connection that says nothing and stays open does not block others.
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(d.socket)
    try:
        answers(d)
    finally:
        idle.close()
    answers(d)


def test_garbage_bytes_on_the_credential_socket(d):
    cred = d.socket + ".cred"
    for data in (os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n", b"\x00" * (1 << 20), b""):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(cred)
            try:
                s.sendall(data)
                s.recv(4096)
            except OSError:
                pass
    # Many that connect and leave at once, and some that connect and never read.
    for _ in range(50):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(cred)
    silent = []
    for _ in range(20):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(cred)
        silent.append(s)
    try:
        t0 = time.monotonic()
        assert fetch_token(d.socket)
        assert time.monotonic() - t0 < 3
        answers(d)
    finally:
        for s in silent:
            s.close()


# ---------------------------------------------------------------- fuzz

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
_env_name = st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True), _text)
_program = st.sampled_from(["/bin/true", "true", "", " ", "no-such-binary-xyz", "/", "/etc/passwd",
                            "/bin/true\x00", "./true", "é"])
_count = st.one_of(st.integers(-3, 4), st.integers(-2 ** 31, 2 ** 31 - 1))


_FIELDS = ("name", "command", "cwd", "env", "min_nodes", "max_nodes", "nproc_per_node",
           "max_restarts")


@st.composite
def submit_requests(draw, cwd: str):
    """A valid submission with up to three of its fields replaced by anything at all."""
    valid = {
        "name": st.one_of(st.just(""), st.from_regex(r"fz[a-z0-9._-]{0,6}", fullmatch=True)),
        "command": st.lists(_text.filter(lambda t: "\x00" not in t), max_size=4).map(
            lambda args: ["/bin/true", *args]),
        "cwd": st.sampled_from([cwd, "/", "/tmp"]),
        "env": st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True),
                               _text.filter(lambda t: "\x00" not in t), max_size=4),
        "min_nodes": st.integers(0, 1), "max_nodes": st.integers(0, 1),
        "nproc_per_node": st.integers(0, 2), "max_restarts": st.integers(-1, 3),
    }
    wild = {
        "name": _text,
        "command": st.one_of(st.just([]), st.tuples(_program, st.lists(_text, max_size=4)).map(
            lambda t: [t[0], *t[1]])),
        "cwd": st.sampled_from(["", "relative", "/nonexistent/x", "/etc/passwd", cwd + "/\x00"])
        | _text,
        "env": st.dictionaries(_env_name, _text, max_size=4),
        "min_nodes": _count, "max_nodes": _count, "nproc_per_node": _count,
        "max_restarts": _count,
    }
    changed = draw(st.sets(st.sampled_from(_FIELDS), max_size=3))
    values = {f: draw(wild[f] if f in changed else valid[f]) for f in _FIELDS}
    return pb.SubmitRequest(**values)


def test_fuzzed_submits_get_clean_answers_and_the_daemon_lives(d):
    mark = log_mark(d)
    accepted: list[str] = []
    seen_codes: set = set()

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(req=submit_requests(d.root))
    def one(req):
        with d.client() as c:
            try:
                accepted.append(c.call("Submit", req).job.id)
                seen_codes.add(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                seen_codes.add(exc.code())
                assert exc.code() in CLEAN, (exc.code(), exc.details(), str(req)[:500])

    try:
        one()
    finally:
        if d.proc.poll() is None:
            settle(d, accepted)
    answers(d)
    no_internal_errors(d, mark)
    assert grpc.StatusCode.INVALID_ARGUMENT in seen_codes


def test_fuzzed_job_keys_get_clean_answers(d):
    mark = log_mark(d)

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(key=st.one_of(_text, st.from_regex(r"[a-z0-9][a-z0-9._-]{0,70}", fullmatch=True)),
           method=st.sampled_from(["GetJob", "WaitJob", "Logs", "Events"]))
    def one(key, method):
        request = {"GetJob": pb.GetJobRequest(id=key),
                   "WaitJob": pb.WaitJobRequest(id=key, timeout_seconds=0.01),
                   "Logs": pb.LogsRequest(id=key), "Events": pb.EventsRequest(id=key)}[method]
        with d.client() as c:
            try:
                if method in ("Logs", "Events"):
                    list(c.stream(method, request, timeout=10))
                else:
                    c.call(method, request)
            except grpc.RpcError as exc:
                assert exc.code() in CLEAN, (method, key, exc.code(), exc.details())

    one()
    answers(d)
    no_internal_errors(d, mark)
