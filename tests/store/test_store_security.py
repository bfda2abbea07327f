"""TLS (CA, client certificate) and user/password auth on real etcd servers."""

from __future__ import annotations

import base64
import json
import time
import urllib.request

import pytest

from etcd_server import EtcdServer, make_certs
from store_backends import open_backend
from store_watching import Watcher, replay
from elasticd.store import Lease, StoreAuthError, detect_api, open_store

TIMEOUT = 1.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory, etcd):  # etcd: skip the module when there is no binary
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def tls_etcd(certs):
    with EtcdServer(certs=certs, client_cert_auth=True) as server:
        yield server


@pytest.mark.parametrize("kind", ["etcd2", "etcd3"])
def test_tls_with_client_certificate(tls_etcd, certs, kind):
    assert tls_etcd.url.startswith("https://")
    store = open_store(kind, tls_etcd.endpoints, timeout=TIMEOUT, ca_cert=certs.ca,
                       cert=certs.client_cert, key=certs.client_key)
    _, rev = store.list("/tls")
    store.put("/tls/a", "secret")
    assert store.get("/tls/a").value == "secret"
    lease = store.grant_lease(5)
    store.put("/tls/l", "x", lease=lease)
    store.refresh_lease(lease)
    store.revoke_lease(lease)
    events = replay(store, "/tls", rev, count=2)
    assert [(e.type, e.key) for e in events][:2] == [("put", "/tls/a"), ("put", "/tls/l")]
    store.delete_prefix("/tls")
    store.close()


@pytest.mark.parametrize("kind", ["etcd2", "etcd3"])
def test_wrong_ca_is_a_clear_error_not_a_hang(tls_etcd, certs, kind):
    store = open_store(kind, tls_etcd.endpoints, timeout=TIMEOUT, ca_cert=certs.other_ca,
                       cert=certs.client_cert, key=certs.client_key)
    t0 = time.monotonic()
    with pytest.raises(StoreAuthError, match="(?i)certificate"):
        store.get("/tls/a")
    assert time.monotonic() - t0 < TIMEOUT
    store.close()


def test_lease_stream_over_tls_with_client_certificate(tls_etcd, certs):
    """membership.lease_transport = grpc: the keep-alive stream uses the same CA and
    client certificate as the gateway, and a wrong CA is a clear error at once."""
    tls = dict(timeout=TIMEOUT, cert=certs.client_cert, key=certs.client_key,
               lease_transport="grpc")
    store = open_store("etcd3", tls_etcd.endpoints, ca_cert=certs.ca, **tls)
    lease = store.grant_lease(5)
    store.refresh_lease(lease)
    store.refresh_lease(lease)
    store.revoke_lease(lease)
    store.close()
    wrong = open_store("etcd3", tls_etcd.endpoints, ca_cert=certs.other_ca, **tls)
    t0 = time.monotonic()
    with pytest.raises(StoreAuthError, match="(?i)certificate"):
        wrong.refresh_lease(Lease(lease.id, 5))
    assert time.monotonic() - t0 < TIMEOUT
    wrong.close()


def test_watch_stream_over_tls_with_client_certificate(tls_etcd, certs):
    """membership.watch_transport = grpc: the Watch stream uses the same CA and client
    certificate as the gateway, and a wrong CA is a clear error at once."""
    tls = dict(timeout=TIMEOUT, cert=certs.client_cert, key=certs.client_key,
               watch_transport="grpc")
    store = open_store("etcd3", tls_etcd.endpoints, ca_cert=certs.ca, **tls)
    rev = store.put("/tlsw/a", "1")
    assert [(e.key, e.value) for e in replay(store, "/tlsw", rev - 1, count=1)] == [
        ("/tlsw/a", "1")]
    store.close()
    wrong = open_store("etcd3", tls_etcd.endpoints, ca_cert=certs.other_ca, **tls)
    t0 = time.monotonic()
    with pytest.raises(StoreAuthError, match="(?i)certificate"):
        list(wrong.watch("/tlsw", rev - 1, timeout=TIMEOUT))
    assert time.monotonic() - t0 < TIMEOUT
    wrong.close()


def test_detect_api_over_tls(tls_etcd, certs):
    assert detect_api(tls_etcd.endpoints, TIMEOUT, ca_cert=certs.ca, cert=certs.client_cert,
                      key=certs.client_key) == "v3"
    with pytest.raises(StoreAuthError):
        detect_api(tls_etcd.endpoints, TIMEOUT, ca_cert=certs.other_ca)


def _call(url: str, method: str, path: str, body: dict, auth: str = "") -> None:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method=method)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status in (200, 201), r.read()


@pytest.fixture(scope="module")
def auth_etcd(etcd):
    """etcd with v3 and v2 auth on: user root, password pw; v3 tokens last 1 s."""
    with EtcdServer(extra_args=("--auth-token-ttl", "1")) as server:
        for path, body in [("/v3/auth/user/add", {"name": "root", "password": "pw"}),
                           ("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/enable", {})]:
            _call(server.url, "POST", path, body)
        _call(server.url, "PUT", "/v2/auth/users/root", {"user": "root", "password": "pw"})
        _call(server.url, "PUT", "/v2/auth/enable", {})
        # v2's guest role may do anything until its rights are revoked
        _call(server.url, "PUT", "/v2/auth/roles/guest",
              {"role": "guest", "revoke": {"kv": {"read": ["/*"], "write": ["/*"]}}},
              auth="root:pw")
        yield server


@pytest.mark.parametrize("kind", ["etcd2", "etcd3", "etcd3-grpc"])
def test_user_password_auth(auth_etcd, kind):
    """etcd3-grpc: the watch goes on etcd's gRPC Watch stream with the login token as
    its ``token`` metadata; an expired token is logged in again there too."""
    store = open_backend(kind, auth_etcd.endpoints, timeout=TIMEOUT,
                         username="root", password="pw")
    store.put("/auth/a", "1")
    assert store.get("/auth/a").value == "1"
    if kind.startswith("etcd3"):
        time.sleep(1.2)  # the token expired: the store logs in again by itself
    events = replay(store, "/auth", 0, count=1)
    assert [(e.key, e.value) for e in events] == [("/auth/a", "1")]
    if kind.startswith("etcd3"):
        store._token = "expired.1"  # the same for plain calls, without the wait
    assert store.list("/auth")[0][0].value == "1"
    store.close()
    for creds in ({"username": "root", "password": "wrong"}, {}):
        bad = open_backend(kind, auth_etcd.endpoints, timeout=TIMEOUT, **creds)
        with pytest.raises(StoreAuthError):
            bad.put("/auth/b", "no")
        bad.close()


def test_watches_on_one_stream_log_in_again_together(auth_etcd):
    """Three watches open on one gRPC stream with a token etcd no longer takes (etcd
    3.4 refuses each create with watch_id -1): each is told to log in, and all three
    go on, on a stream with the new token, with every event."""
    store = open_backend("etcd3-grpc", auth_etcd.endpoints, timeout=TIMEOUT,
                         username="root", password="pw")
    try:
        _, rev = store.list("/again")
        for i in range(3):
            store.put(f"/again/p{i}/k", str(i))
        store._token = "expired.1"
        watchers = [Watcher(store, f"/again/p{i}", rev) for i in range(3)]
        for i, w in enumerate(watchers):
            assert [e.value for e in w.wait_for(1)] == [str(i)]
        for w in watchers:
            w.close()
    finally:
        store.delete_prefix("/again")
        store.close()


def test_lease_stream_with_user_password_auth(auth_etcd):
    """The keep-alive stream carries the gateway's login token (etcd's ``token``
    metadata; etcd 3.4 does not check it there, later versions may)."""
    store = open_store("etcd3", auth_etcd.endpoints, timeout=TIMEOUT, username="root",
                       password="pw", lease_transport="grpc")
    lease = store.grant_lease(5)
    store._token = None      # the stream logs in when it opens
    store.refresh_lease(lease)
    assert store._token
    store.refresh_lease(lease)
    store.revoke_lease(lease)
    store.close()
