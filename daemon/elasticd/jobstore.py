"""A job's coordination store, hosted outside its ranks: ``python jobstore.py``.

In-process restart (elasticd.inprocess) needs a store that outlives any one
rank: torch's TCPStore hosted by rank 0 dies with rank 0. The daemon starts
this file by path with the job's own Python (it needs torch, which the
daemon never imports), as the job's user, once per job; it serves a
``torch.distributed.TCPStore`` and prints one line, ``ELASTICD_STORE
<host> <port>``, on stdout, which the daemon hands to the workers as
ELASTICD_STORE_ADDR / ELASTICD_STORE_PORT. It exits when its stdin closes
(the daemon is done with it, or died) or on SIGTERM.

    python jobstore.py [--host 0.0.0.0] [--port 0]
"""
import argparse
import datetime
import signal
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--advertise", default="127.0.0.1", help="address printed for the workers")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from torch.distributed import TCPStore
    store = TCPStore(args.host, args.port, world_size=None, is_master=True,
                     timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    sys.stdout.write("ELASTICD_STORE %s %d\n" % (args.advertise, store.port))
    sys.stdout.flush()
    sys.stdin.read()  # EOF: the daemon closed our stdin or is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
