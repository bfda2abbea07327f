"""Store pieces that need no etcd: the memory store's clock,
key rules, the prefix wrapper and open_store's arguments."""

from __future__ import annotations

import pytest

from elasticd.store import (
    EVENT_EXPIRE,
    KeyExists,
    LeaseNotFound,
    MemoryStore,
    StoreUnavailable,
    check_key,
    dir_prefix,
    open_store,
)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_memory_lease_follows_the_injected_clock():
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    lease = store.grant_lease(3)
    store.put("/n/a", "a", lease=lease)
    _, rev = store.list("/n")
    clock.now += 2.9
    store.refresh_lease(lease)
    clock.now += 2.9
    assert store.get("/n/a").value == "a"
    clock.now += 0.2
    store.expire()
    assert store.get("/n/a") is None
    events = list(store.watch("/n", rev, timeout=0.1))
    assert [(e.type, e.key) for e in events] == [(EVENT_EXPIRE, "/n/a")]
    with pytest.raises(LeaseNotFound):
        store.refresh_lease(lease)


def test_memory_store_refuses_calls_once_closed():
    store = MemoryStore()
    store.close()
    with pytest.raises(StoreUnavailable):
        store.get("/a")


def test_key_rules():
    assert check_key("/a/b-c_d.e:f") == "/a/b-c_d.e:f"
    for bad in ("a", "/", "/a/", "/a//b", "/./a", "/a/..", "/a\nb", 3):
        with pytest.raises(ValueError):
            check_key(bad)
    assert dir_prefix("/a/b") == dir_prefix("/a/b/") == "/a/b/"
    assert dir_prefix("/") == "/"


def test_prefixed_store_keeps_callers_keys_relative():
    store = open_store("memory", prefix="/elasticd")
    inner = store.inner
    rev = store.put("/v1/nodes/a", "1")
    assert inner.get("/elasticd/v1/nodes/a").value == "1"
    assert store.get("/v1/nodes/a").key == "/v1/nodes/a"
    kvs, _ = store.list("/v1/nodes")
    assert [kv.key for kv in kvs] == ["/v1/nodes/a"]
    store.delete("/v1/nodes/a")
    events = list(store.watch("/v1", rev - 1, timeout=0.1))
    assert [(e.type, e.key) for e in events] == [("put", "/v1/nodes/a"), ("delete", "/v1/nodes/a")]
    assert inner.list("/")[0] == []


def test_open_store_checks_its_arguments():
    with pytest.raises(ValueError, match="kind"):
        open_store("zookeeper", ["http://127.0.0.1:2379"])
    with pytest.raises(ValueError, match="endpoint"):
        open_store("etcd3", [])
    assert open_store("v2", ["http://127.0.0.1:1"]).name == "etcd2"  # no request made
    assert open_store("v3", ["http://127.0.0.1:1"]).name == "etcd3"


def test_held_things_are_made_once_and_end_with_their_last_user():
    from elasticd.store.follow import Held
    held, made = Held(), []

    def make():
        made.append(object())
        return made[-1]
    first, new = held.take("j1", make)
    again, new_again = held.take("j1", make)
    assert (new, new_again, again is first, len(made)) == (True, False, True, 1)
    assert held.let_go("j1") is None and "j1" in held      # one user left
    assert held.let_go("j1") is first and "j1" not in held  # the last: it is given back
    assert held.let_go("j1") is None and held.get("j1") is None
    other, _ = held.take("j2", make)
    assert held.clear() == [other] and held.keys() == []
