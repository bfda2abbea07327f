"""scripts/setup.sh: the torch build a setting selects, checked with pip itself, offline.

``TORCH_INDEX_URL`` adds an index to pip's (``setup.sh --pip-args`` prints the
arguments pip gets). Two local indexes stand in for PyPI (``torch 2.13.0``, the
CUDA build there) and PyTorch's CPU index (``2.13.0+cpu``): with the setting's
arguments pip resolves ``torch==2.13.0`` (pyproject.toml's pin) to the CPU
build, without it to PyPI's. The wheels are tiny stand-ins with real metadata;
pip runs isolated from this machine's own settings (its find-links dir holds
the real CPU wheel). The whole install in a bare Debian is tests/test_first_hour.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from daemons import REPO

SETUP = os.path.join(REPO, "scripts", "setup.sh")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pip_args(**env) -> list[str]:
    proc = subprocess.run(["bash", SETUP, "--pip-args"], capture_output=True, text=True,
                          env={**{k: v for k, v in os.environ.items()
                                  if k != "TORCH_INDEX_URL"}, **env}, timeout=60, check=True)
    return proc.stdout.splitlines()


def test_the_setting_adds_the_cpu_index_and_nothing_else():
    assert pip_args() == ["install", "-e", ".[test]"]
    assert pip_args(TORCH_INDEX_URL=CPU_INDEX) == ["install", "-e", ".[test]",
                                                   "--extra-index-url", CPU_INDEX]


def _wheel(index: str, version: str) -> None:
    """A minimal torch wheel of ``version`` in the PEP 503 index at ``index``."""
    name = f"torch-{version}-py3-none-any.whl"
    folder = os.path.join(index, "torch")
    os.makedirs(folder, exist_ok=True)
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(os.path.join(folder, name), "w") as whl:
        whl.writestr(f"{info}/METADATA",
                     f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    with open(os.path.join(folder, "index.html"), "w") as fh:
        fh.write(f'<html><body><a href="{name}">{name}</a></body></html>\n')


def _resolve(tmp_path, extra: list[str]) -> str:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--isolated", "--no-deps", "--dry-run",
         "--ignore-installed", "--report", str(report), "--no-cache-dir",
         "--index-url", (tmp_path / "pypi").as_uri(), *extra, "torch==2.13.0"],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("PIP_")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    chosen = json.loads(report.read_text())["install"]
    assert len(chosen) == 1
    return chosen[0]["metadata"]["version"]


@pytest.mark.skipif(subprocess.run([sys.executable, "-m", "pip", "--version"],
                                   capture_output=True).returncode != 0,
                    reason="needs pip in the test interpreter")
def test_pip_takes_the_cpu_build_from_the_index_the_setting_names(tmp_path):
    _wheel(str(tmp_path / "pypi"), "2.13.0")            # PyPI's: the CUDA build
    _wheel(str(tmp_path / "cpu"), "2.13.0+cpu")          # PyTorch's CPU index
    assert _resolve(tmp_path, []) == "2.13.0"
    args = pip_args(TORCH_INDEX_URL=(tmp_path / "cpu").as_uri())
    assert _resolve(tmp_path, args[3:]) == "2.13.0+cpu"
