"""Fixtures for the store tests: one real etcd for the session, a store of
each backend on it, and a fresh key prefix per test."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

# tests/etcd_server.py and tests/store/store_watching.py import as top-level
# modules whether or not tests/ is a package.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from etcd_server import EtcdServer, etcd_binary  # noqa: E402

from store_backends import BACKENDS, open_backend  # noqa: E402

from elasticd.store import open_store  # noqa: E402

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary")


@pytest.fixture(scope="session")
def etcd():
    """One etcd (v2 API on) shared by the whole session; tests that stop
    or reconfigure etcd start their own."""
    if etcd_binary() is None:
        pytest.skip("no etcd binary (install etcd or set ELASTICD_TEST_ETCD)")
    with EtcdServer() as server:
        yield server


@pytest.fixture(params=BACKENDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def store(kind, request):
    if kind == "memory":
        s = open_store("memory")
    else:
        server = request.getfixturevalue("etcd")
        s = open_backend(kind, server.endpoints, timeout=2.0)
    yield s
    s.close()


@pytest.fixture
def prefix() -> str:
    return f"/test/{uuid.uuid4().hex[:10]}"
