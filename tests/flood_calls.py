"""Flood the daemon with one kind of call, or time another user's calls, as a real user.

    flood_calls.py UID GID GROUPS SOCKET flood KIND JOB THREADS SECONDS
    flood_calls.py UID GID GROUPS SOCKET time list - INTERVAL SECONDS

Starts as root (the interpreter may not be readable by others), drops to the
uid/gid for real, then either floods (THREADS threads, each on a connection of
its own, each making KIND calls back to back for SECONDS: ``cancel`` and
``status`` of JOB, ``list``, ``submit-invalid``, a submit the daemon refuses
as invalid) or times ``list`` calls (one every INTERVAL seconds for SECONDS).
Prints ``ready`` once its connections are up, then one JSON line: how many
calls, by status code, and their latency (p50, p99, max, seconds).
"""
import json
import os
import sys
import threading
import time

import grpc

from elasticctl.client import fetch_token
from elasticd.v1 import control_pb2 as pb
from elasticd.v1 import control_pb2_grpc as pb_grpc

uid, gid, groups, sock, mode, kind, job, width, seconds = sys.argv[1:10]
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(int(gid))
os.setuid(int(uid))
token = fetch_token(sock)
META = (("elasticd-token", token),)
CALLS = {
    "cancel": lambda stub: stub.CancelJob(pb.CancelJobRequest(id=job), metadata=META,
                                          timeout=60),
    "status": lambda stub: stub.GetJob(pb.GetJobRequest(id=job), metadata=META, timeout=60),
    "list": lambda stub: stub.ListJobs(pb.ListJobsRequest(), metadata=META, timeout=60),
    "submit-invalid": lambda stub: stub.Submit(pb.SubmitRequest(
        command=["/bin/true"], cwd="/", nproc_per_node=-5), metadata=META, timeout=60),
}
lock = threading.Lock()
codes: dict = {}
said: dict = {}      # the first message of each refusal
latencies: list = []


def one(stub) -> None:
    t0 = time.monotonic()
    try:
        CALLS[kind](stub)
        code = "OK"
    except grpc.RpcError as exc:
        code = exc.code().name
        said.setdefault(code, (exc.details() or "")[:300])
    took = time.monotonic() - t0
    with lock:
        codes[code] = codes.get(code, 0) + 1
        latencies.append(took)


def flood(stub, until: float) -> None:
    while time.monotonic() < until:
        one(stub)


# A connection of its own for each (channels with equal arguments would share one), as
# from that many processes.
channels = [grpc.insecure_channel(f"unix:{sock}", options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(int(width) if mode == "flood" else 1)]
for channel in channels:
    grpc.channel_ready_future(channel).result(timeout=30)
stubs = [pb_grpc.ControlStub(c) for c in channels]
print("ready", flush=True)
until = time.monotonic() + float(seconds)
if mode == "flood":
    threads = [threading.Thread(target=flood, args=(s, until), daemon=True) for s in stubs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(float(seconds) + 120)
else:
    while time.monotonic() < until:
        one(stubs[0])
        time.sleep(float(width))
latencies.sort()


def pct(q: float) -> float:
    return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0


print(json.dumps({"calls": len(latencies), "codes": codes, "said": said, "p50": pct(0.5),
                  "p99": pct(0.99), "max": latencies[-1] if latencies else 0.0}), flush=True)
for channel in channels:
    channel.close()
