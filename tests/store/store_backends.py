"""The store backends the store tests run against, and how each is opened."""
from __future__ import annotations

from elasticd.store import open_store

# etcd3-grpc: the v3 store with its watches on etcd's gRPC Watch stream
# (membership.watch_transport = grpc) and its lease refreshes on the gRPC keep-alive.
BACKENDS = ["memory", "etcd2", "etcd3", "etcd3-grpc"]


def open_backend(kind: str, endpoints, **kwargs):
    """A store of backend ``kind`` (one of BACKENDS but memory) on ``endpoints``."""
    if kind == "etcd3-grpc":
        return open_store("etcd3", endpoints, watch_transport="grpc", lease_transport="grpc",
                          **kwargs)
    return open_store(kind, endpoints, **kwargs)
