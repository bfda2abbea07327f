"""A job's coordination store, hosted outside its ranks: ``python jobstore/server.py``.

In-process restart (elasticd.inprocess) needs a store that outlives any one
rank: torch's TCPStore hosted by rank 0 dies with rank 0. The daemon starts
this file by path with the job's own Python (it needs torch, which the
daemon never imports), as the job's user, once per job; it serves a
``torch.distributed.TCPStore`` and prints one line, ``ELASTICD_STORE
<host> <port>``, on stdout, which the daemon hands to the workers as
ELASTICD_STORE_ADDR / ELASTICD_STORE_PORT. It exits when its stdin closes
(the daemon is done with it, or died) or on SIGTERM.

TCPStore's own server listens on every address whatever host it is given;
so the listening socket is made here, bound to exactly ``--host``, and
handed to it (``master_listen_fd``).

    python jobstore/server.py --host ADDRESS [--port 0]
"""
import argparse
import datetime
import signal
import socket
import sys


def listen(host, port):
    """A TCP socket listening on exactly ``host`` (an address or a name)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(addr)
    sock.listen(1024)
    return sock


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True, help="the one address to listen on")
    p.add_argument("--advertise", default="", help="address printed for the workers "
                                                   "(default: --host)")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sock = listen(args.host, args.port)
    port = sock.getsockname()[1]
    from torch.distributed import TCPStore
    # It serves while this name holds it.
    store = TCPStore(args.host, port, world_size=None, is_master=True,  # noqa: F841
                     timeout=datetime.timedelta(seconds=30), wait_for_workers=False,
                     master_listen_fd=sock.fileno())
    sys.stdout.write("ELASTICD_STORE %s %d\n" % (args.advertise or args.host, port))
    sys.stdout.flush()
    sys.stdin.read()  # EOF: the daemon closed our stdin or is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
