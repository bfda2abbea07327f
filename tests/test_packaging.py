"""The .deb from packaging/build-deb.sh, and the wheel from `python -m build`.

Building and inspecting run everywhere dpkg-deb does. Installing the .deb
changes the machine (files under /opt, /usr/bin, /etc, a system group), so
that test runs only as root with CI=true or ELASTICD_TEST_INSTALL_DEB=1, and
never where an elasticd package is already installed; it removes and purges
what it installed, and the group if it made it.
"""
from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from built_deb import built_deb
from daemons import short_tmpdir

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SYSTEM_PYTHON = "/usr/bin/python3"


def run(*cmd, check=True, timeout=120, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def deb(tmp_path_factory) -> Path:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("needs dpkg-deb (Debian's dpkg) to build the .deb")
    if run(SYSTEM_PYTHON, "-c", "import ensurepip, venv", check=False).returncode != 0:
        pytest.skip(f"needs {SYSTEM_PYTHON} with venv (Debian package python3-venv)")
    path = built_deb(tmp_path_factory)
    arch = run("dpkg", "--print-architecture").stdout.strip()
    assert path.name == f"elasticd_{VERSION}_{arch}.deb" and path.is_file()
    return path


@pytest.fixture(scope="module")
def unpacked(deb, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unpacked")
    run("dpkg-deb", "-x", deb, root)
    run("dpkg-deb", "-e", deb, root / "DEBIAN")
    return root


@pytest.mark.slow  # builds a whole venv into a .deb: a minute and more
def test_deb_metadata(deb):
    info = run("dpkg-deb", "--info", deb).stdout
    fields = dict(line.strip().split(": ", 1) for line in info.splitlines()
                  if line.startswith(" ") and ": " in line and not line.startswith("  "))
    assert fields["Package"] == "elasticd"
    assert fields["Version"] == VERSION
    pyver = "%d.%d" % tuple(int(p) for p in run(
        SYSTEM_PYTHON, "-c", "import sys; print(*sys.version_info[:2])").stdout.split())
    # The venv links to this interpreter: the package must pull in that one.
    assert f"python{pyver}" in fields["Depends"] and "adduser" in fields["Depends"]
    for script in ("postinst", "prerm", "postrm", "conffiles"):
        assert script in info


@pytest.mark.slow  # builds a whole venv into a .deb: a minute and more
def test_deb_contents(deb):
    lines = run("dpkg-deb", "--contents", deb).stdout.splitlines()
    entries = {line.split()[5].removeprefix("."): line for line in lines}
    assert entries["/usr/bin/elasticd"].split()[-1] == "/opt/elasticd/bin/elasticd"
    assert entries["/usr/bin/elasticctl"].split()[-1] == "/opt/elasticd/bin/elasticctl"
    for path in ("/lib/systemd/system/elasticd.service", "/etc/elasticd/elasticd.toml",
                 "/usr/share/doc/elasticd/copyright",
                 "/usr/share/elasticd/monitoring/elasticd.rules.yml",
                 "/usr/share/elasticd/monitoring/grafana-dashboard.json"):
        assert path in entries, path
        assert " root/root " in entries[path]
    site = [p for p in entries if "/site-packages/" in p]
    assert any(p.endswith("/elasticd/v1/control_pb2.py") for p in site)
    assert any(p.endswith("/elasticctl/cli.py") for p in site)
    # The daemon must not need torch; nor does the package carry pip.
    assert not any("/site-packages/torch/" in p or "/site-packages/pip/" in p for p in site)


@pytest.mark.slow  # builds a whole venv into a .deb: a minute and more
def test_deb_files_point_at_their_installed_places(unpacked):
    root = unpacked
    assert (root / "DEBIAN" / "conffiles").read_text().split() == ["/etc/elasticd/elasticd.toml"]
    for script in ("postinst", "prerm", "postrm"):
        assert os.access(root / "DEBIAN" / script, os.X_OK), script
        run("sh", "-n", root / "DEBIAN" / script)
    assert "addgroup --system" in (root / "DEBIAN" / "postinst").read_text()
    assert (root / "etc/elasticd/elasticd.toml").read_text() == \
        (ROOT / "packaging" / "elasticd.toml").read_text()
    assert (root / "lib/systemd/system/elasticd.service").read_text() == \
        (ROOT / "systemd" / "elasticd.service").read_text()
    for name in ("elasticd", "elasticctl"):
        first = (root / "opt/elasticd/bin" / name).read_text().splitlines()[0]
        assert first == "#!/opt/elasticd/bin/python", first
    pyver = "python%d.%d" % sys.version_info[:2]
    assert os.readlink(root / "opt/elasticd/bin" / pyver) == f"/usr/bin/{pyver}"
    assert "/opt/elasticd" in (root / "opt/elasticd/pyvenv.cfg").read_text()
    # Nothing remembers the temp dir it was built in.
    stray = run("grep", "-rIl", "/tmp/", root / "opt/elasticd/bin",
                root / "opt/elasticd/pyvenv.cfg", check=False).stdout
    assert not stray, stray


def _may_install() -> str | None:
    """Why the install test must not run here, or None."""
    if os.geteuid() != 0:
        return "installing the .deb needs root"
    if os.environ.get("CI") != "true" and os.environ.get("ELASTICD_TEST_INSTALL_DEB") != "1":
        return "installs into this machine: runs only with CI=true or ELASTICD_TEST_INSTALL_DEB=1"
    if shutil.which("dpkg") is None:
        return "needs dpkg"
    status = run("dpkg-query", "-W", "-f=${Status}", "elasticd", check=False).stdout
    if "installed" in status and "not-installed" not in status:
        return "an elasticd package is already installed here; not touching it"
    return None


@pytest.mark.slow  # builds a whole venv into a .deb: a minute and more
def test_installed_deb_runs_a_job(deb):
    why = _may_install()
    if why:
        pytest.skip(why)
    had_group = _group_exists("elasticd")
    tmp = short_tmpdir("pkg-")
    daemon = None
    try:
        run("dpkg", "-i", deb, timeout=120)
        assert _group_exists("elasticd"), "postinst did not create the elasticd group"
        assert run("/usr/bin/elasticd", "--version").stdout.strip() == f"elasticd {VERSION}"
        _verify_unit("/lib/systemd/system/elasticd.service")
        # The installed daemon's Python has no torch and loads none.
        run("/opt/elasticd/bin/python", "-c",
            "import importlib.util, sys, elasticd.node.daemon; "
            "assert importlib.util.find_spec('torch') is None; "
            "assert 'torch' not in sys.modules")

        sock = os.path.join(tmp, "c.sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        with open(os.path.join(tmp, "daemon.log"), "wb") as log:
            daemon = subprocess.Popen(
                ["/usr/bin/elasticd", "--standalone", "--node-id", "pkg-test", "--socket", sock,
                 "--state-dir", os.path.join(tmp, "state"), "--metrics-port", "0",
                 "--set", f"snapshot.root={os.path.join(tmp, 'shm')}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        ctl = ["/usr/bin/elasticctl", "--socket", sock]
        deadline = time.monotonic() + 20
        while run(*ctl, "list", check=False, env=env).returncode != 0:
            assert daemon.poll() is None, _read(tmp, "daemon.log")
            assert time.monotonic() < deadline, "installed daemon not ready:\n" + \
                _read(tmp, "daemon.log")
            time.sleep(0.1)
        sub = run(*ctl, "-o", "json", "submit", "--", "/bin/true", env=env, cwd=tmp)
        job = json.loads(sub.stdout)["id"]
        run(*ctl, "wait", job, env=env, timeout=60)  # exit code = the job's
        status = json.loads(run(*ctl, "-o", "json", "status", job, env=env).stdout)
        assert status["state"] == "SUCCEEDED", status
        daemon.terminate()
        assert daemon.wait(30) == 0, _read(tmp, "daemon.log")
        daemon = None

        run("dpkg", "-r", "elasticd", timeout=120)
        assert not os.path.lexists("/usr/bin/elasticd")
        assert not os.path.exists("/opt/elasticd")
        assert os.path.exists("/etc/elasticd/elasticd.toml"), "a removed conffile stays"
        run("dpkg", "--purge", "elasticd", timeout=120)
        assert not os.path.exists("/etc/elasticd")
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        run("dpkg", "--purge", "elasticd", check=False, timeout=120)
        if not had_group and _group_exists("elasticd"):
            run("groupdel", "elasticd", check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def _read(tmp: str, name: str) -> str:
    with open(os.path.join(tmp, name), errors="replace") as fh:
        return fh.read()


def _verify_unit(path: str) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return  # tests/test_systemd_unit.py says so; the rest still counts
    env = dict(os.environ, SYSTEMD_LOG_LEVEL="info", SYSTEMD_LOG_COLOR="0")
    proc = run(analyze, "verify", "--man=no", "--recursive-errors=no", path, check=False,
               env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert not [line for line in output.splitlines() if "elasticd.service" in line], output


# -- the wheel -------------------------------------------------------------------
def test_wheel_builds_and_carries_the_generated_protos(tmp_path):
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.skip("needs the `build` package (pip install build) for `python -m build`")
    src = tmp_path / "src"
    src.mkdir()
    # A copy, so the work tree gets no build/ or egg-info of its own.
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("pyproject.toml", "README.md", "daemon", "ctl"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, src / name)
    run(sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", src,
        timeout=300)
    wheels = list((tmp_path / "dist").glob(f"elasticd-{VERSION}-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as whl:
        names = set(whl.namelist())
        meta = whl.read(f"elasticd-{VERSION}.dist-info/METADATA").decode()
        entry_points = whl.read(f"elasticd-{VERSION}.dist-info/entry_points.txt").decode()
    for proto in ("control_pb2.py", "control_pb2_grpc.py", "control_pb2.pyi"):
        assert f"elasticd/v1/{proto}" in names
    for proto in ("lease_pb2.py", "lease_pb2_grpc.py", "lease_pb2.pyi",
                  "watch_pb2.py", "watch_pb2_grpc.py", "watch_pb2.pyi"):
        assert f"elasticd/store/etcdpb/{proto}" in names
    assert "elasticctl/cli.py" in names and "elasticd/examples/train.py" in names
    assert "elasticd = elasticd.node.cli:main" in entry_points
    assert "elasticctl = elasticctl.cli:main" in entry_points
    torch_reqs = [line for line in meta.splitlines()
                  if line.startswith("Requires-Dist: torch")]
    assert torch_reqs and all("extra ==" in line for line in torch_reqs), torch_reqs
