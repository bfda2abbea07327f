"""The checked-in stubs (the control API, etcd's lease and watch streams) are exactly
what grpcio-tools makes of the .proto files."""
import filecmp
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ETCDPB = os.path.join("elasticd", "store", "etcdpb")
STUBS = [(os.path.join("elasticd", "v1"), "control", "elasticd/v1/control.proto"),
         (ETCDPB, "lease", "elasticd/store/etcdpb/lease.proto"),
         (ETCDPB, "watch", "elasticd/store/etcdpb/watch.proto")]


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run(["bash", os.path.join(REPO, "scripts", "gen_protos.sh"), str(tmp_path)],
                   check=True, cwd=REPO, env=dict(os.environ, PYTHON=sys.executable))
    for folder, stem, proto in STUBS:
        for name in (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"):
            fresh = tmp_path / folder / name
            checked_in = os.path.join(REPO, "daemon", folder, name)
            assert filecmp.cmp(fresh, checked_in, shallow=False), (
                f"daemon/{folder}/{name} drifted from protos/{proto}: "
                "run scripts/gen_protos.sh and commit the result")


def test_stubs_import_and_name_every_rpc():
    from elasticd.v1 import control_pb2
    service = control_pb2.DESCRIPTOR.services_by_name["Control"]
    assert {m.name for m in service.methods} >= {
        "Submit", "ListJobs", "GetJob", "CancelJob", "WaitJob", "Logs", "Events", "ListNodes",
        "SetNodeState"}


def test_lease_stubs_keep_etcds_wire_names():
    """etcd routes by the full method name: /etcdserverpb.Lease/LeaseKeepAlive."""
    from elasticd.store.etcdpb import lease_pb2
    service = lease_pb2.DESCRIPTOR.services_by_name["Lease"]
    assert service.full_name == "etcdserverpb.Lease"
    assert [m.name for m in service.methods] == ["LeaseKeepAlive"]
    fields = lease_pb2.LeaseKeepAliveResponse.DESCRIPTOR.fields_by_name
    assert (fields["ID"].number, fields["TTL"].number) == (2, 3)


def test_watch_stubs_keep_etcds_wire_names_and_numbers():
    """/etcdserverpb.Watch/Watch, and the field numbers of etcd's rpc.proto and kv.proto."""
    from elasticd.store.etcdpb import watch_pb2
    service = watch_pb2.DESCRIPTOR.services_by_name["Watch"]
    assert service.full_name == "etcdserverpb.Watch"
    assert [m.name for m in service.methods] == ["Watch"]

    def numbers(message):
        return {f.name: f.number for f in message.DESCRIPTOR.fields}
    assert numbers(watch_pb2.WatchCreateRequest) == {"key": 1, "range_end": 2,
                                                     "start_revision": 3, "filters": 5,
                                                     "prev_kv": 6, "watch_id": 7}
    assert watch_pb2.WatchCreateRequest.NOPUT == 0 and watch_pb2.WatchCreateRequest.NODELETE == 1
    assert numbers(watch_pb2.WatchCancelRequest) == {"watch_id": 1}
    assert numbers(watch_pb2.WatchRequest) == {"create_request": 1, "cancel_request": 2}
    assert numbers(watch_pb2.WatchResponse) == {
        "header": 1, "watch_id": 2, "created": 3, "canceled": 4, "compact_revision": 5,
        "cancel_reason": 6, "events": 11}
    assert numbers(watch_pb2.Event) == {"type": 1, "kv": 2, "prev_kv": 3}
    assert numbers(watch_pb2.KeyValue) == {"key": 1, "create_revision": 2, "mod_revision": 3,
                                           "version": 4, "value": 5, "lease": 6}
    assert watch_pb2.Event.DELETE == 1
