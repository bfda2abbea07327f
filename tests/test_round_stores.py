"""A node's round stores (jobstore/round_host.py): MASTER_PORT listens before ranks start.

When rank 0 hosts its round's TCPStore, ranks of other nodes that ask for it
first are refused and torch tries again 0.25-0.75 s later, at every restart
of a job across nodes (issue 22, 3-node goodput). Each node of such a job
keeps a round store process (real: the job's Python, torch's TCPStore) that
opens a fresh store whenever the node joins a round; here the process on its
own, driven as the agent drives it, forked from the job's worker template (or
started on its own without one); and the in-process job store
(jobstore/host.py), forked the same way.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import psutil

from elasticd.jobstore.host import JobStoreHost
from elasticd.jobstore.round_host import RoundStoreHost, worker_env
from elasticd.workers.group import GroupSpec
from elasticd.workers.round_place import RoundPlace
from elasticd.workers.template import TemplateState, WorkerTemplate
from elasticd.workers.template_key import TemplateKey, template_env

CLIENT = r"""
import datetime, sys
from torch.distributed import TCPStore
port = int(sys.argv[1])
s = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
if sys.argv[2] == "set":
    s.set("k", sys.argv[3])
else:
    print(s.get("k").decode())
"""


def spec(tmp_path, command=(sys.executable, "-m", "train")) -> GroupSpec:
    return GroupSpec(job_id="j1", command=tuple(command), cwd=str(tmp_path), env={},
                     uid=os.getuid(), gid=os.getgid(), nproc=1, restart_count=0,
                     max_restarts=-1, place=RoundPlace.before_any_round(1),
                     log_dir=str(tmp_path / "logs"), run_dir=str(tmp_path / "run"),
                     node_id="n1")


def template(tmp_path, preload=("torch", "torch.distributed")) -> WorkerTemplate:
    """A real worker template for ``spec``'s job (``python -m train``), starting."""
    (tmp_path / "train.py").write_text("")
    s = spec(tmp_path)
    t = WorkerTemplate("j1", "n1", ready_timeout=120)
    t.start(s, TemplateKey.of(s, preload), template_env(s))
    assert t.state is TemplateState.STARTING, t.reason
    return t


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def client(tmp_path, port: int, *args: str) -> str:
    path = tmp_path / "client.py"
    path.write_text(CLIENT)
    res = subprocess.run([sys.executable, str(path), str(port), *args], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip()


def test_each_join_gets_a_fresh_store_that_listens_at_once(tmp_path):
    host = RoundStoreHost("j1", "n1", timeout=120)
    host.start(spec(tmp_path), bind="127.0.0.1")
    try:
        assert host.reason == ""
        first = host.new_port()      # waits for the server's torch import
        assert first and host.ready and listening(first)
        client(tmp_path, first, "set", "round-1")
        assert client(tmp_path, first, "get") == "round-1"
        second = host.new_port()     # the next round: its own, empty store
        assert second and second != first and listening(second)
        client(tmp_path, second, "set", "round-2")
        assert client(tmp_path, first, "get") == "round-1"  # the last round's is untouched
        assert client(tmp_path, second, "get") == "round-2"
        pid = host.pid
        assert psutil.Process(pid).username() == psutil.Process().username()
    finally:
        host.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not listening(first) and not listening(second)
    assert host.new_port() == 0


def test_only_the_newest_stores_are_kept(tmp_path):
    host = RoundStoreHost("j1", "n1", timeout=120)
    host.start(spec(tmp_path), bind="127.0.0.1")
    try:
        ports = [host.new_port() for _ in range(6)]   # the server keeps 4
        assert all(ports) and len(set(ports)) == 6
        assert [listening(p) for p in ports] == [False, False, True, True, True, True]
    finally:
        host.stop()


def test_a_command_that_is_not_python_has_no_round_stores(tmp_path):
    host = RoundStoreHost("j1", "n1", timeout=120)
    host.start(spec(tmp_path, command=("/bin/sh", "-c", "true")), bind="127.0.0.1")
    assert "not `python SCRIPT`" in host.reason
    assert host.new_port() == 0


def test_a_server_that_dies_is_given_up_and_the_node_offers_plain_ports(tmp_path):
    # A "python" whose every run exits at once: the server never says READY.
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    host = RoundStoreHost("j1", "n1", timeout=120)
    host.start(spec(tmp_path, command=(str(fake), "-m", "train")), bind="127.0.0.1")
    assert host.new_port() == 0
    assert "exited (3)" in host.reason
    assert host.new_port() == 0     # never asked again


def test_a_wake_ends_the_first_wait_without_giving_up(tmp_path):
    host = RoundStoreHost("j1", "n1", timeout=120)
    host.start(spec(tmp_path), bind="127.0.0.1")
    try:
        stop = threading.Event()
        stop.set()                  # a cancel or a shutdown woke the agent
        assert host.new_port(stop=stop) == 0
        assert host.reason == "" and host.pid
        assert host.new_port() > 0  # the next join waits and gets one
    finally:
        host.stop()


def test_the_server_is_forked_from_the_jobs_template_once_it_is_ready(tmp_path):
    # No second interpreter importing torch: the template has it imported already.
    tpl = template(tmp_path)
    host = RoundStoreHost("j1", "n1", timeout=120)
    try:
        host.start(spec(tmp_path), bind="127.0.0.1", template=lambda: tpl)
        assert host.reason == "" and host.pid == 0   # the template still imports
        first = host.new_port()                  # waits for the template, then forks
        assert tpl.state is TemplateState.READY
        assert host.forked_from == tpl.pid
        server = psutil.Process(host.pid)
        assert server.ppid() == tpl.pid
        assert server.username() == psutil.Process().username()
        assert os.getsid(server.pid) == server.pid      # a session of its own, as a rank
        assert first and listening(first)
        client(tmp_path, first, "set", "round-1")
        assert client(tmp_path, first, "get") == "round-1"
        second = host.new_port()
        assert second and second != first and listening(second)
        ports = [host.new_port() for _ in range(4)]    # the 4 newest are served
        assert not listening(first) and not listening(second)
        assert all(listening(p) for p in ports)
    finally:
        host.stop()
    # Ended with the job: the template reaps it and says so, and has no child left,
    # so it may serve the user's next job (template_pool: settle).
    assert tpl.settle(30)
    assert not any(listening(p) for p in ports)
    assert host.new_port() == 0
    tpl.stop()


def test_a_ready_template_forks_the_server_at_once(tmp_path):
    tpl = template(tmp_path)
    assert tpl.ready(120)
    host = RoundStoreHost("j1", "n1", timeout=120)
    try:
        host.start(spec(tmp_path), bind="127.0.0.1", template=lambda: tpl)
        assert host.forked_from == tpl.pid
        assert listening(host.new_port())
    finally:
        host.stop()
        tpl.stop()


def test_a_template_that_cannot_be_used_gets_a_server_of_its_own(tmp_path):
    # The template became unusable (here failed by hand: as when it dies, cannot be
    # made or refuses to fork): the server is spawned with the job's Python instead.
    tpl = template(tmp_path)
    tpl._fail("killed for the test")
    host = RoundStoreHost("j1", "n1", timeout=120)
    try:
        host.start(spec(tmp_path), bind="127.0.0.1", template=lambda: tpl)
        assert host.pid and host.forked_from == 0
        port = host.new_port()
        assert port and listening(port)
    finally:
        host.stop()


def test_a_wake_ends_the_wait_for_the_template_without_giving_up(tmp_path):
    tpl = template(tmp_path)
    host = RoundStoreHost("j1", "n1", timeout=120)
    try:
        host.start(spec(tmp_path), bind="127.0.0.1", template=lambda: tpl)
        stop = threading.Event()
        stop.set()
        assert host.new_port(stop=stop) == 0
        assert host.reason == "" and host.pid == 0
        assert listening(host.new_port())        # the next join waits and gets one
        assert host.forked_from == tpl.pid
    finally:
        host.stop()
        tpl.stop()


def test_the_in_process_job_store_is_forked_from_the_template_too(tmp_path):
    tpl = template(tmp_path)
    host = JobStoreHost()
    try:
        addr, port = host.ensure(spec(tmp_path), bind="127.0.0.1", advertise="127.0.0.1",
                                 timeout=120, template=tpl)   # waits for the template
        assert addr == "127.0.0.1" and listening(port)
        assert host.forked_from == tpl.pid
        client(tmp_path, port, "set", "kept")
        assert host.ensure(spec(tmp_path), "127.0.0.1", "127.0.0.1", 120, tpl) == (addr, port)
        assert client(tmp_path, port, "get") == "kept"
        host.stop()
        assert not listening(port)
        assert tpl.settle(30)   # its child is gone and reported: back to the pool it may go
        # Another template still importing, and a wake: no store, no error.
        woken = threading.Event()
        woken.set()
        (tmp_path / "other").mkdir()
        other = template(tmp_path / "other")
        assert host.ensure(spec(tmp_path / "other"), "127.0.0.1", "127.0.0.1", 120, other,
                           stop=woken) is None
        other.stop()
        # No template (agent.worker_template off): a store of its own, with the job's Python.
        _, port = host.ensure(spec(tmp_path), "127.0.0.1", "127.0.0.1", 120, None)
        assert listening(port) and host.forked_from == 0
    finally:
        host.stop()
        tpl.stop()


def test_ranks_are_told_whether_the_round_store_hosts_master_port():
    assert worker_env(True) == {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert worker_env(False) == {"TORCHELASTIC_USE_AGENT_STORE": "False"}
