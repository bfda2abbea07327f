"""The checked-in stubs (the control API, etcd's lease stream) are exactly what
grpcio-tools makes of the .proto files."""
import filecmp
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUBS = {os.path.join("elasticd", "v1"): ("control", "elasticd/v1/control.proto"),
         os.path.join("elasticd", "store", "etcdpb"): ("lease",
                                                       "elasticd/store/etcdpb/lease.proto")}


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run(["bash", os.path.join(REPO, "scripts", "gen_protos.sh"), str(tmp_path)],
                   check=True, cwd=REPO, env=dict(os.environ, PYTHON=sys.executable))
    for folder, (stem, proto) in STUBS.items():
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
