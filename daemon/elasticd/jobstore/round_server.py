"""Each round's MASTER_PORT store, listening before any rank starts: ``python jobstore/round_server.py``.

When rank 0 hosts the round's TCPStore (torch's default under env://),
ranks on other nodes often ask for it before rank 0 got there; torch then
retries the connect after a backoff of 0.25-0.75 s, at every restart. So on
a job across nodes every node's daemon keeps this process (the job's own
Python, as the job's user, in its own process group, dying with the agent
thread), and each time the node joins a round it asks it for a new store:
the store listens from then on, before the round even closes, and its port
is the node's MASTER_PORT offer. The ranks of the round are told
``TORCHELASTIC_USE_AGENT_STORE=True`` (all of them connect as clients, as
under torchrun's agent store), so no rank binds and nobody waits.

Protocol on stdin/stdout, one line each: it prints ``ELASTICD_ROUND_STORE
READY`` once torch is imported; for each ``NEW`` line it reads, it listens
on a fresh port of exactly ``--host`` (the socket made here and handed to
TCPStore, whose own server would listen on every address) and prints
``ELASTICD_ROUND_STORE PORT <port>``. A round's store must be fresh (torch
adds no per-attempt prefix under the agent store), so every NEW makes a new
one; the ``--keep`` newest are served, older ones are closed. It exits when
stdin closes (the daemon is done with it, or died) or on SIGTERM.

    python jobstore/round_server.py --host ADDRESS [--keep 4]
"""
import argparse
import collections
import datetime
import signal
import socket
import sys

READY = "ELASTICD_ROUND_STORE READY"
PORT = "ELASTICD_ROUND_STORE PORT"


def listen(host):
    """A TCP socket listening on exactly ``host`` (an address or a name), any free port."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(addr)
    sock.listen(1024)
    return sock


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True, help="the one address to listen on")
    p.add_argument("--keep", type=int, default=4, help="stores served at once (newest)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds a store operation may wait (TCPStore timeout)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from torch.distributed import TCPStore
    served = collections.deque(maxlen=max(1, args.keep))  # a store dropped is closed
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if line.strip() != "NEW":
            continue
        sock = listen(args.host)
        port = sock.getsockname()[1]
        # The store owns the socket from here (it closes it when dropped): detached.
        served.append(TCPStore(args.host, port, world_size=None, is_master=True,
                               timeout=datetime.timedelta(seconds=args.timeout),
                               wait_for_workers=False, master_listen_fd=sock.detach()))
        sys.stdout.write("%s %d\n" % (PORT, port))
        sys.stdout.flush()
    return 0  # EOF: the daemon closed our stdin or is gone


if __name__ == "__main__":
    sys.exit(main())
