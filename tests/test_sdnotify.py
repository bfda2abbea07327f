"""elasticd.sdnotify against a real AF_UNIX datagram socket standing in for systemd."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid

import pytest

from elasticd.sdnotify import Notifier


def _listener(address):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


@pytest.fixture
def systemd_socket(tmp_path):
    """A bound datagram socket and the NOTIFY_SOCKET value that names it."""
    # A unix socket path must fit in 108 bytes; a deep tmp_path may not.
    short_dir = None if len(str(tmp_path)) < 90 else tempfile.mkdtemp(prefix="sdn", dir="/tmp")
    path = os.path.join(short_dir or str(tmp_path), "notify")
    sock = _listener(path)
    yield sock, path
    sock.close()
    if short_dir:
        shutil.rmtree(short_dir, ignore_errors=True)


def _recv(sock) -> str:
    return sock.recv(4096).decode()


def _assert_nothing_arrives(sock) -> None:
    sock.settimeout(0.1)
    with pytest.raises(TimeoutError):
        sock.recv(4096)


def test_each_message_arrives_as_one_datagram(systemd_socket):
    sock, path = systemd_socket
    with Notifier({"NOTIFY_SOCKET": path}) as n:
        assert n.enabled
        assert n.ready()
        assert _recv(sock) == "READY=1"
        assert n.status("2 jobs running")
        assert _recv(sock) == "STATUS=2 jobs running"
        assert n.watchdog()
        assert _recv(sock) == "WATCHDOG=1"
        assert n.stopping()
        assert _recv(sock) == "STOPPING=1"


def test_ready_with_status_sends_both_in_one_datagram(systemd_socket):
    sock, path = systemd_socket
    with Notifier({"NOTIFY_SOCKET": path}) as n:
        n.ready(status="serving on /run/elasticd/control.sock")
        assert _recv(sock) == "READY=1\nSTATUS=serving on /run/elasticd/control.sock"


def test_status_newlines_cannot_inject_assignments(systemd_socket):
    sock, path = systemd_socket
    with Notifier({"NOTIFY_SOCKET": path}) as n:
        n.status("line one\nREADY=1")
        assert _recv(sock) == "STATUS=line one READY=1"


def test_abstract_socket():
    name = f"elasticd-test-{uuid.uuid4().hex}"
    sock = _listener(b"\0" + name.encode())
    try:
        with Notifier({"NOTIFY_SOCKET": "@" + name}) as n:
            assert n.enabled
            n.ready()
            assert _recv(sock) == "READY=1"
    finally:
        sock.close()


def test_one_socket_is_kept_open_across_sends(systemd_socket):
    sock, path = systemd_socket
    with Notifier({"NOTIFY_SOCKET": path}) as n:
        first = n._sock
        for _ in range(3):
            n.watchdog()
            assert _recv(sock) == "WATCHDOG=1"
        assert n._sock is first and first.fileno() >= 0
        assert not os.get_inheritable(first.fileno())


def test_watchdog_interval_is_half_of_watchdog_usec(systemd_socket):
    _, path = systemd_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    with Notifier(env) as n:
        assert n.watchdog_interval() == 15.0


def test_watchdog_without_watchdog_pid_is_ours(systemd_socket):
    _, path = systemd_socket
    with Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}) as n:
        assert n.watchdog_interval() == 0.5


def test_watchdog_pid_of_another_process_disables_watchdog(systemd_socket):
    sock, path = systemd_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}
    with Notifier(env, pid=4242) as n:
        assert n.enabled
        assert n.watchdog_interval() is None
        assert not n.watchdog()
        _assert_nothing_arrives(sock)
        n.status("still talking")  # other messages are unaffected
        assert _recv(sock) == "STATUS=still talking"


@pytest.mark.parametrize("usec", ["", "0", "-5", "abc"])
def test_missing_or_bad_watchdog_usec_means_no_watchdog(systemd_socket, usec):
    _, path = systemd_socket
    with Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": usec}) as n:
        assert n.watchdog_interval() is None


def test_bad_watchdog_pid_disables_watchdog(systemd_socket):
    _, path = systemd_socket
    with Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000",
                   "WATCHDOG_PID": "not-a-pid"}) as n:
        assert n.watchdog_interval() is None


def test_without_notify_socket_everything_is_a_quiet_no_op():
    n = Notifier({"WATCHDOG_USEC": "30000000"})
    assert not n.enabled
    assert n.watchdog_interval() is None
    assert n.ready("x") is False
    assert n.status("x") is False
    assert n.watchdog() is False
    assert n.stopping() is False
    n.close()
    n.close()


def test_relative_notify_socket_is_ignored():
    assert not Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled


def test_send_failure_is_logged_not_raised(tmp_path, caplog):
    caplog.set_level("DEBUG", logger="elasticd.sdnotify")
    with Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")}) as n:
        assert n.enabled
        assert n.ready() is False
        assert n.watchdog() is False
    assert "READY=1" in caplog.text and "failed" in caplog.text


def test_reads_os_environ_by_default(systemd_socket, monkeypatch):
    sock, path = systemd_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    with Notifier() as n:
        n.stopping()
        assert _recv(sock) == "STOPPING=1"


def test_close_makes_later_sends_no_ops(systemd_socket):
    sock, path = systemd_socket
    n = Notifier({"NOTIFY_SOCKET": path})
    n.close()
    assert not n.enabled
    assert n.ready() is False
    _assert_nothing_arrives(sock)
