"""Hold N follow streams as another user: ``hold_streams.py UID GID GROUPS SOCKET JOB N SECONDS``.

Starts as root (the interpreter is not readable by others), drops to the
uid/gid for real, then opens N ``Logs(follow=True)`` calls on one channel
each in threads, prints one line per call once it is known whether the
daemon took it (``open`` on its first chunk, else ``refused CODE MESSAGE``),
then ``ready``, holds the open ones for SECONDS and exits: it stops by itself.
"""
import os
import sys
import threading
import time

import grpc

from elasticctl.client import fetch_token
from elasticd.v1 import control_pb2 as pb
from elasticd.v1 import control_pb2_grpc as pb_grpc

uid, gid, groups, sock, job, n, hold = sys.argv[1:8]
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(int(gid))
os.setuid(int(uid))
token = fetch_token(sock)
lock = threading.Lock()
settled = threading.Semaphore(0)


def one(i: int) -> None:
    channel = grpc.insecure_channel(f"unix:{sock}")
    call = pb_grpc.ControlStub(channel).Logs(pb.LogsRequest(id=job, follow=True),
                                             metadata=(("elasticd-token", token),),
                                             timeout=float(hold) + 30)
    try:
        for _ in call:
            with lock:
                print("open", flush=True)
            settled.release()
            break
        time.sleep(float(hold))
    except grpc.RpcError as exc:
        with lock:
            print("refused", exc.code().name, exc.details(), flush=True)
        settled.release()
    finally:
        call.cancel()
        channel.close()


threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(int(n))]
for t in threads:
    t.start()
deadline = time.monotonic() + 30
for _ in threads:
    if not settled.acquire(timeout=max(0.0, deadline - time.monotonic())):
        break
print("ready", flush=True)
for t in threads:
    t.join(float(hold) + 40)
