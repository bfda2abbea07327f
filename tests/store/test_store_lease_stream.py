"""Lease refreshes over etcd's gRPC keep-alive stream (membership.lease_transport = grpc)
on real etcd servers: one stream kept across refreshes, an ended lease as LeaseNotFound
(and the lease keeper's new grant), every wait bounded, the stream opened again after
etcd restarts, failover, and the setting."""

from __future__ import annotations

import time

import pytest

from etcd_server import EtcdServer, free_port
from elasticd import config
from elasticd.cluster.membership import LeaseKeeper, node_key
from elasticd.cluster.node import open_cluster_store
from elasticd.store import LeaseNotFound, StoreUnavailable, open_store
from elasticd.store.etcd3 import Etcd3Store
from elasticd.trust.sealed import PLAIN

TIMEOUT = 1.0
SLACK = 1.0  # allowed beyond the timeout: process scheduling on a busy CI box


def grpc_store(endpoints, timeout=TIMEOUT) -> Etcd3Store:
    return Etcd3Store(endpoints, timeout=timeout, lease_transport="grpc")


def test_one_stream_keeps_a_lease_past_two_ttls(etcd, prefix):
    store = grpc_store(etcd.endpoints)
    gateway = open_store("etcd3", etcd.endpoints, timeout=TIMEOUT)   # a reader beside it
    try:
        lease = store.grant_lease(1)
        store.put(f"{prefix}/k", "v", lease=lease)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2 * lease.ttl + 0.5:
            store.refresh_lease(lease)
            time.sleep(0.3)
        assert gateway.get(f"{prefix}/k").value == "v"
        assert store._keepalive.opened == 1, "each refresh must reuse the one stream"
        store.revoke_lease(lease)
        assert gateway.get(f"{prefix}/k") is None
        with pytest.raises(LeaseNotFound):   # etcd answers TTL 0 on the stream
            store.refresh_lease(lease)
        assert store._keepalive.opened == 1, "an ended lease does not break the stream"
    finally:
        store.close()
        gateway.close()


def test_lease_keeper_grants_a_new_lease_when_the_stream_says_it_ended(etcd, prefix):
    store = open_store("etcd3", etcd.endpoints, prefix=prefix, timeout=TIMEOUT,
                       lease_transport="grpc")
    info = {"node_id": "n1", "host": "h", "address": "10.0.0.1", "slots": 1, "version": "t",
            "pid": 1, "state": "ready"}
    keeper = LeaseKeeper(store, "n1", ttl=3, interval=1.0, info=lambda: dict(info),
                         records=PLAIN)
    try:
        keeper.register()
        assert keeper.tick() == "refreshed the lease"
        first = keeper.lease
        store.revoke_lease(first)               # as if it had expired
        assert store.get(node_key("n1")) is None
        assert keeper.tick() == "registered again after losing the lease"
        assert keeper.lease.id != first.id
        assert store.get(node_key("n1")).lease_id == keeper.lease.id
        assert keeper.tick() == "refreshed the lease"
    finally:
        keeper.stop()
        store.close()


def test_stream_opens_again_after_etcd_restarts_and_waits_are_bounded(etcd):
    with EtcdServer() as server:
        store = grpc_store(server.endpoints)
        try:
            lease = store.grant_lease(30)
            store.refresh_lease(lease)
            server.restart()
            store.refresh_lease(lease)       # the stream broke; the refresh opens a new one
            assert store._keepalive.opened == 2
            server.freeze()                  # connections open, nothing answers
            try:
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable, match="did not answer"):
                    store.refresh_lease(lease)
                assert time.monotonic() - t0 < TIMEOUT + SLACK
            finally:
                server.thaw()
            store.refresh_lease(lease)   # the late reply skipped, this one's taken
            assert store._keepalive.opened == 2, "one slow answer is no reason to reconnect"
            server.stop()
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.refresh_lease(lease)
            assert time.monotonic() - t0 < TIMEOUT + SLACK
            server.start()
            store.refresh_lease(lease)
        finally:
            store.close()


def test_a_stream_silent_for_two_timeouts_is_opened_again(etcd):
    """etcd slow for one refresh keeps the stream (late replies skipped in order); silent
    for two in a row, the stream and its channel are replaced (as a dead endpoint's)."""
    with EtcdServer() as server:
        store = grpc_store(server.endpoints)
        try:
            lease = store.grant_lease(30)
            store.refresh_lease(lease)
            server.freeze()
            try:
                for _ in range(2):
                    with pytest.raises(StoreUnavailable, match="did not answer"):
                        store.refresh_lease(lease)
                assert store._keepalive._stream is None, "silent twice: dropped"
            finally:
                server.thaw()
            store.refresh_lease(lease)
            assert store._keepalive.opened == 2
            for _ in range(3):               # the new stream answers each refresh in turn
                store.refresh_lease(lease)
            assert store._keepalive.opened == 2
        finally:
            store.close()


def test_a_dead_first_endpoint_is_passed_over_in_the_same_refresh(etcd):
    store = grpc_store([f"http://127.0.0.1:{free_port()}", etcd.url])
    try:
        lease = store.grant_lease(5)
        t0 = time.monotonic()
        store.refresh_lease(lease)
        store.refresh_lease(lease)
        assert time.monotonic() - t0 < TIMEOUT
        store.revoke_lease(lease)
    finally:
        store.close()


def test_lease_transport_is_a_validated_setting_the_daemon_passes_on(etcd, tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert config.load(str(empty), env={}).membership.lease_transport == "grpc"
    with pytest.raises(config.ConfigError, match="membership.lease_transport"):
        config.load(str(empty), env={"ELASTICD_MEMBERSHIP_LEASE_TRANSPORT": "udp"})
    with pytest.raises(ValueError, match="lease_transport"):
        Etcd3Store(etcd.endpoints, lease_transport="udp")
    for transport in ("grpc", "gateway"):
        cfg = config.load(str(empty), env={}, overrides={"etcd.endpoints": etcd.endpoints, "etcd.api": "v3",
                                           "membership.lease_transport": transport})
        store = open_cluster_store(cfg)
        try:
            assert (store.inner._keepalive is not None) == (transport == "grpc")
            store.refresh_lease(store.grant_lease(5))
        finally:
            store.close()


def test_an_endpoint_that_never_answers_is_passed_over_in_the_same_refresh(etcd):
    """A listener that takes connections and says nothing (a hung host): the stream
    tries the next endpoint after its share of the timeout, as the gateway does."""
    import socket
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        store = grpc_store([f"http://127.0.0.1:{mute.getsockname()[1]}", etcd.url])
        granter = grpc_store(etcd.endpoints)   # the gateway would wait out the mute one
        try:
            lease = granter.grant_lease(5)
            t0 = time.monotonic()
            store.refresh_lease(lease)
            assert time.monotonic() - t0 < TIMEOUT + SLACK
            store.refresh_lease(lease)          # on the endpoint that answered
            assert store._keepalive.opened == 2
            granter.revoke_lease(lease)
        finally:
            store.close()
            granter.close()


def test_the_stream_ignores_proxy_variables_as_the_gateway_client_does(etcd, monkeypatch):
    for name in ("http_proxy", "https_proxy", "grpc_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")   # nothing listens
    store = grpc_store(etcd.endpoints)
    try:
        lease = store.grant_lease(5)
        store.refresh_lease(lease)
        store.revoke_lease(lease)
    finally:
        store.close()
