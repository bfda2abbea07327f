"""Another local user with full access to a job's store cannot forge its ranks' records.

Real root daemon, real unprivileged users made here (``h14_victim`` who runs
an ``--inprocess`` job, ``h14_mallory`` who attacks it), real torch ranks
and job store. torch's TCPStore answers anyone who connects: mallory lists
its keys (which shows the job's key prefix), then plants fault reports and
done markers of her own and copies genuine records (a real fault of
iteration 0, real barrier markers) under the keys of the iteration running
and the next one. Every record the ranks act on is sealed with a key the
store never sees (elasticd/inprocess/records.py), so none of hers verifies:
the job restarts in-process exactly once, for its own real fault, and
SUCCEEDS with no process restart; each rank logs the rejected records and
tells the daemon, whose events say so.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from elasticd.v1 import control_pb2 as pb
from test_local_trust import (PY, _PYTHONPATH, _listening, _log, _secret_of, everything_shown,
                              job_store_process,
                              real_users, status, submit_as, submitted, wait_for)
from test_local_trust import node  # noqa: F401 (a fixture: the same root daemon)

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: real users are created and the daemon "
                                       "switches to them (CI runs as root)")

USERS = ("h14_victim", "h14_mallory")


@pytest.fixture(scope="module")
def users():
    with real_users(USERS, "h14-home-") as made:
        yield made


# mallory's script: waits for the victim's iteration 1, then forges and replays.
ATTACK = r"""
import datetime, json, re, sys, time
from torch.distributed import TCPStore
s = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,
             timeout=datetime.timedelta(seconds=30))
KEY = re.compile(r"^(.*/elasticd/inprocess/r\d+a\d+/)/it(\d+)//(.+)$")
deadline = time.monotonic() + float(sys.argv[3])
while True:
    keys = s.list_keys()
    found = {}
    for k in keys:
        m = KEY.match(k)
        if m:
            found[(int(m.group(2)), m.group(3))] = k
            base = m.group(1)
    if {(0, "fault/0"), (0, "start/r0"), (1, "entered"), (1, "start/r0"),
            (1, "start/r1")} <= set(found):
        break
    if time.monotonic() > deadline:
        sys.exit("no iteration 1 in the store: %r" % keys)
    time.sleep(0.05)

def key(it, rest):
    return "%s/it%d//%s" % (base, it, rest)

genuine_fault = s.get(found[(0, "fault/0")])      # rank 1's real fault of iteration 0
start_r0 = s.get(found[(0, "start/r0")])
start_r1_now = s.get(found[(1, "start/r1")])
entered_now = s.get(found[(1, "entered")])
planted = []
def plant(k, v):
    s.set(k, v)
    planted.append(k)
# Replays: genuine records under the running and the next iteration's keys.
plant(key(1, "fault/0"), genuine_fault)
plant(key(2, "fault/0"), genuine_fault)
plant(key(1, "done/r0"), start_r0)                # iteration 0's marker, as a done marker
plant(key(1, "done/r1"), start_r1_now)            # this iteration's, under another key
plant(key(2, "start/r0"), start_r0)
plant(key(2, "entered"), entered_now)
# Forgeries: plain text and the record format with a made-up MAC.
for slot in range(1, 6):
    plant(key(1, "fault/%d" % slot), b"PWNED by mallory")
plant(key(1, "fault/6"), b"v1." + b"0" * 64 + b".PWNED by mallory")
plant(key(1, "fault/7"), genuine_fault.replace(b"injected", b"PWNED"))
print(json.dumps({"keys": keys, "planted": planted}))
"""


@pytest.mark.slow  # 30 s of training for mallory to strike in: the default suite's budget
def test_a_user_who_reads_the_job_store_cannot_forge_or_replay_its_records(node, users):
    victim, mallory = users["victim"], users["mallory"]
    work = victim.mkdir(os.path.join(node.root, "victim-inproc"))
    job_id = submitted(submit_as(
        node, victim, "--inprocess", "--nproc-per-node", "2", "--max-restarts", "0", "--",
        PY, "-m", "elasticd.examples.train_inprocess", "--steps", "600", "--step-time", "0.05",
        "--crash-at-step", "25", "--checkpoint-every", "10", "--log-every", "20", cwd=work))
    store = wait_for(lambda: job_store_process(node, job_id, victim.uid), 120,
                     "the victim's job store")
    port = wait_for(lambda: _listening(store.pid), 60, "the job store listening")[0][1]
    script = os.path.join(node.root, "attack.py")
    with open(script, "w") as fh:
        fh.write(ATTACK)
    os.chmod(script, 0o644)
    # mallory starts now (importing torch takes a while) and strikes once iteration 1 runs;
    # 600 steps (30 s) leave her that while on a loaded machine (240 did not).
    r = mallory.run(["env", f"PYTHONPATH={_PYTHONPATH}", PY, script, "127.0.0.1", str(port),
                     "150"], cwd="/", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    attack = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(attack["planted"]) == 13
    assert status(node, job_id)["state"] == "RUNNING"  # planted while it trains
    secret = _secret_of(status(node, job_id)["workers"][0]["pid"])

    job = node.wait_job(job_id, timeout=240)
    logs = [_log(node, job_id, rank) for rank in range(2)]
    assert pb.JobState.Name(job.state) == "SUCCEEDED", (logs[0] + logs[1])[-4000:]
    assert job.restarts == 0                                  # no process restart
    assert dict(job.restarts_by_layer)["inprocess"] == 1      # its own fault, only
    for rank, text in enumerate(logs):
        assert [int(i) for i in re.findall(r"INPROCESS_ITERATION (\d+)", text)] == [0, 1], text
        assert "done: 600 steps, iteration 1" in text and "all_reduce sum 1 ok" in text
        # Each rank noticed, once per kind, and acted on nothing.
        assert text.count("failed authentication (fault at") == 1, text[-3000:]
    assert "injected failure on rank 1 at step 25" in logs[1]
    shown = everything_shown(node, job_id)
    # ... and told the daemon, which says so in the job's events.
    assert re.search(r"rank \d: ignored a fault record in the job store that failed "
                     r"authentication", shown), shown[-3000:]
    assert "PWNED" not in shown and not any("PWNED" in text for text in logs)
    # What mallory saw names neither the secret nor anything she could seal with.
    assert len(secret) >= 32 and secret not in json.dumps(attack["keys"])
    assert secret not in shown and not any(secret in text for text in logs)
