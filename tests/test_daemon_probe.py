"""cluster/daemon_probe.py on real sockets: a refused connection says a peer's daemon is
gone; an accepted one, silence and no port say nothing. And the replication listener
takes a probe quietly (no refusal counted), as it takes one from a real peer's
DaemonProbe."""
from __future__ import annotations

import socket
import time

from elasticd.cluster.daemon_probe import DaemonProbe

from test_replication_channel import server  # noqa: F401 (fixture: a real listener)


def _answer(probe: DaemonProbe, node: str, address: str, within: float = 5.0) -> bool:
    """Ask as the rendezvous decider does: again while the probe is pending."""
    deadline = time.monotonic() + within
    gone = probe.gone(node, address)
    while probe.pending() and time.monotonic() < deadline:
        time.sleep(probe.look)
        gone = probe.gone(node, address)
    assert not probe.pending()
    return gone


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()        # nothing listens there now: the host refuses
    return port


def test_a_refused_connection_says_gone_a_listener_says_alive():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    ports = {"dead": _closed_port(), "live": listener.getsockname()[1], "unpublished": 0}
    probe = DaemonProbe(lambda node: ports[node], timeout=2.0)
    try:
        assert _answer(probe, "dead", "127.0.0.1") is True
        assert _answer(probe, "live", "127.0.0.1") is False
        assert _answer(probe, "unpublished", "127.0.0.1") is False
        # Settled answers are kept: a listener that opens on the dead port later (a
        # restarted daemon) changes nothing until forget().
        assert probe.gone("dead", "127.0.0.1") is True
    finally:
        probe.forget()
        listener.close()


def test_no_answer_within_the_timeout_says_nothing():
    # A listener that never accepts, its queue full: the host drops a new connection's
    # SYN, as a host that is down or cut off answers nothing.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        queued.append(s)
    probe = DaemonProbe(lambda node: port, timeout=0.3)
    try:
        t0 = time.monotonic()
        gone = probe.gone("far", "127.0.0.1")
        assert probe.pending() and gone is False
        gone = _answer(probe, "far", "127.0.0.1")
        assert gone is False and time.monotonic() - t0 >= 0.25
    finally:
        probe.forget()
        for s in queued:
            s.close()
        listener.close()


def test_probes_off_or_a_port_that_is_no_port_say_nothing():
    assert DaemonProbe(lambda node: _closed_port(), timeout=0).gone("n", "127.0.0.1") is False
    assert DaemonProbe(lambda node: "x", timeout=1).gone("n", "127.0.0.1") is False
    assert DaemonProbe(lambda node: 70000, timeout=1).gone("n", "127.0.0.1") is False
    assert DaemonProbe(lambda node: 7, timeout=1).gone("n", "") is False


def test_a_port_unknown_at_the_first_ask_is_looked_up_again():
    # ci90: a decider whose read of the peer's record failed once (etcd busy) kept "no
    # port" for the whole round and waited out the peer's lease. Unknown is not an answer.
    ports = iter([0, None, _closed_port()])
    probe = DaemonProbe(lambda node: next(ports), timeout=2.0)
    try:
        assert probe.gone("dead", "127.0.0.1") is False and not probe.pending()
        assert probe.gone("dead", "127.0.0.1") is False and not probe.pending()
        assert _answer(probe, "dead", "127.0.0.1") is True
    finally:
        probe.forget()


def test_the_replication_listener_takes_a_probe_quietly(server):  # noqa: F811
    pusher, plan, _, _ = server
    probe = DaemonProbe(lambda node: plan.port, timeout=2.0)
    try:
        assert _answer(probe, "n2", "127.0.0.1") is False
    finally:
        probe.forget()
    time.sleep(0.3)     # the listener's thread has seen the hang-up
    assert sum(pusher.stats.refusals().values()) == 0
