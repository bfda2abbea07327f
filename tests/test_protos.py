"""The checked-in control API stubs are exactly what grpcio-tools makes of the .proto."""
import filecmp
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUBS = ("control_pb2.py", "control_pb2.pyi", "control_pb2_grpc.py")


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run(["bash", os.path.join(REPO, "scripts", "gen_protos.sh"), str(tmp_path)],
                   check=True, cwd=REPO, env=dict(os.environ, PYTHON=sys.executable))
    for name in STUBS:
        fresh = tmp_path / "elasticd" / "v1" / name
        checked_in = os.path.join(REPO, "daemon", "elasticd", "v1", name)
        assert filecmp.cmp(fresh, checked_in, shallow=False), (
            f"daemon/elasticd/v1/{name} drifted from protos/elasticd/v1/control.proto: "
            "run scripts/gen_protos.sh and commit the result")


def test_stubs_import_and_name_every_rpc():
    from elasticd.v1 import control_pb2
    service = control_pb2.DESCRIPTOR.services_by_name["Control"]
    assert {m.name for m in service.methods} >= {
        "Submit", "ListJobs", "GetJob", "CancelJob", "WaitJob", "Logs", "Events", "ListNodes",
        "SetNodeState"}
