"""The Store contract, run unchanged against memory, etcd2 and etcd3."""

from __future__ import annotations

import threading
import time

import pytest

from store_watching import Watcher, replay
from elasticd.store import (
    EVENT_DELETE,
    EVENT_EXPIRE,
    EVENT_PUT,
    CompareFailed,
    KeyExists,
    LeaseNotFound,
)


def wait_gone(store, key, within: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if store.get(key) is None:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{key} still present after {within}s")


def expired(kind: str) -> str:
    return EVENT_DELETE if kind.startswith("etcd3") else EVENT_EXPIRE


# -- keys and values ---------------------------------------------------------

def test_put_get_roundtrip(store, prefix):
    assert store.get(f"{prefix}/missing") is None
    rev = store.put(f"{prefix}/a", '{"x": "ünïcode"}')
    kv = store.get(f"{prefix}/a")
    assert kv.key == f"{prefix}/a"
    assert kv.value == '{"x": "ünïcode"}'
    assert kv.revision == rev
    assert kv.lease_id == 0
    rev2 = store.put(f"{prefix}/a", "")
    assert rev2 > rev
    assert store.get(f"{prefix}/a").value == ""


def test_create_fails_when_key_exists(store, prefix):
    rev = store.create(f"{prefix}/k", "first")
    assert store.get(f"{prefix}/k").revision == rev
    with pytest.raises(KeyExists):
        store.create(f"{prefix}/k", "second")
    assert store.get(f"{prefix}/k").value == "first"


def test_compare_and_swap(store, prefix):
    key = f"{prefix}/cas"
    with pytest.raises(CompareFailed):
        store.compare_and_swap(key, "x", 12345)  # absent, nonzero revision
    r1 = store.compare_and_swap(key, "v1", 0)  # 0: only if absent
    with pytest.raises(CompareFailed):
        store.compare_and_swap(key, "again", 0)
    r2 = store.compare_and_swap(key, "v2", r1)
    assert r2 > r1
    with pytest.raises(CompareFailed):
        store.compare_and_swap(key, "stale", r1)
    assert store.get(key) == (key, "v2", r2, 0)


def test_delete_plain_and_conditional(store, prefix):
    key = f"{prefix}/d"
    assert store.delete(key) is False
    rev = store.put(key, "v")
    with pytest.raises(CompareFailed):
        store.delete(key, prev_revision=rev + 1000)
    assert store.get(key) is not None
    assert store.delete(key, prev_revision=rev) is True
    assert store.get(key) is None
    with pytest.raises(CompareFailed):
        store.delete(key, prev_revision=rev)
    store.put(key, "again")
    assert store.delete(key) is True


def test_list_prefix_is_a_directory(store, prefix):
    for name in ("b", "a", "c/deep"):
        store.put(f"{prefix}/dir/{name}", name)
    store.put(f"{prefix}/dirx", "sibling, not under dir/")
    kvs, rev = store.list(f"{prefix}/dir")
    assert [kv.key for kv in kvs] == [f"{prefix}/dir/{n}" for n in ("a", "b", "c/deep")]
    assert [kv.value for kv in kvs] == ["a", "b", "c/deep"]
    assert rev >= max(kv.revision for kv in kvs)
    assert store.list(f"{prefix}/dir/")[0] == kvs
    empty, rev2 = store.list(f"{prefix}/nothing")
    assert empty == [] and rev2 >= rev


def test_delete_prefix(store, prefix):
    for i in range(5):
        store.put(f"{prefix}/p/{i}", str(i))
    store.put(f"{prefix}/p/sub/x", "x")
    store.put(f"{prefix}/px", "stays")
    assert store.delete_prefix(f"{prefix}/p") == 6
    assert store.list(f"{prefix}/p")[0] == []
    assert store.get(f"{prefix}/px").value == "stays"
    assert store.delete_prefix(f"{prefix}/p") == 0
    store.put(f"{prefix}/p/again", "ok")  # usable afterwards
    assert len(store.list(f"{prefix}/p")[0]) == 1


def test_garbage_values_do_not_break_list(store, prefix):
    store.put(f"{prefix}/g/json", '{"ok": 1}')
    store.put(f"{prefix}/g/junk", "\x00\x01{not json]]\udcff".encode("utf-8", "replace").decode())
    store.put(f"{prefix}/g/big", "x" * 100_000)
    kvs, _ = store.list(f"{prefix}/g")
    assert [kv.key.rsplit("/", 1)[1] for kv in kvs] == ["big", "json", "junk"]
    assert len(kvs[0].value) == 100_000


def test_keys_are_validated(store):
    for bad in ("relative", "/trailing/", "/a//b", "/a/../b", ""):
        with pytest.raises(ValueError):
            store.put(bad, "x")


# -- leases ------------------------------------------------------------------

def test_lease_expiry_removes_keys_within_ttl_plus_one(store, prefix):
    lease = store.grant_lease(1)
    assert lease.ttl >= 1
    store.put(f"{prefix}/l/a", "a", lease=lease)
    store.create(f"{prefix}/l/b", "b", lease=lease)
    assert store.get(f"{prefix}/l/a").lease_id == lease.id
    wait_gone(store, f"{prefix}/l/a", lease.ttl + 1.0)
    assert store.get(f"{prefix}/l/b") is None
    with pytest.raises(LeaseNotFound):
        store.refresh_lease(lease)
    with pytest.raises(LeaseNotFound):
        store.put(f"{prefix}/l/c", "c", lease=lease)


def test_refresh_keeps_keys_and_emits_no_events(store, prefix):
    lease = store.grant_lease(1)
    store.put(f"{prefix}/r/a", "a", lease=lease)
    _, rev = store.list(f"{prefix}/r")
    w = Watcher(store, f"{prefix}/r", rev)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < lease.ttl + 0.8:
            store.refresh_lease(lease)
            time.sleep(0.3)
        assert store.get(f"{prefix}/r/a").value == "a"
        assert w.events == []
    finally:
        w.close()
    wait_gone(store, f"{prefix}/r/a", lease.ttl + 1.0)


def test_revoke_deletes_at_once_and_is_idempotent(store, prefix):
    lease = store.grant_lease(30)
    store.put(f"{prefix}/v/a", "a", lease=lease)
    store.put(f"{prefix}/v/plain", "no lease")
    store.revoke_lease(lease)
    assert store.get(f"{prefix}/v/a") is None
    assert store.get(f"{prefix}/v/plain").value == "no lease"
    store.revoke_lease(lease)
    with pytest.raises(LeaseNotFound):
        store.refresh_lease(lease)


def test_put_without_lease_detaches_key(store, prefix):
    lease = store.grant_lease(30)
    store.put(f"{prefix}/x", "leased", lease=lease)
    store.put(f"{prefix}/x", "plain")
    assert store.get(f"{prefix}/x").lease_id == 0
    store.revoke_lease(lease)
    assert store.get(f"{prefix}/x").value == "plain"


# -- watch -------------------------------------------------------------------

def test_watch_sees_put_delete_expire_in_order(store, kind, prefix):
    _, rev = store.list(f"{prefix}/w")
    w = Watcher(store, f"{prefix}/w", rev)
    try:
        lease = store.grant_lease(1)
        store.put(f"{prefix}/w/a", "1")
        store.put(f"{prefix}/w/b", "2")
        store.delete(f"{prefix}/w/a")
        store.put(f"{prefix}/w/c", "3", lease=lease)
        store.put(f"{prefix}/wx", "outside the prefix")
        events = w.wait_for(5, timeout=lease.ttl + 3)
    finally:
        w.close()
    assert [(e.type, e.key.rsplit("/", 1)[1], e.value) for e in events] == [
        (EVENT_PUT, "a", "1"), (EVENT_PUT, "b", "2"), (EVENT_DELETE, "a", None),
        (EVENT_PUT, "c", "3"), (expired(kind), "c", None)]
    revs = [e.revision for e in events]
    assert revs == sorted(revs) and revs[0] > rev


def test_a_watch_of_deletes_only_gets_each_delete_by_its_key(store, kind,
                                                                               prefix):
    """What the node watch relies on (cluster/membership.py): no puts at all (etcd3
    filters them out itself), every delete and expiry, the keys alone (a deleted value
    etcd would read again for every watcher); and the store's revision, read without a
    list, is where such a watch starts."""
    written = store.put(f"{prefix}/d/old", "before the watch")
    rev = store.revision()
    assert written <= rev <= store.list(f"{prefix}/d")[1]
    w = Watcher(store, f"{prefix}/d", rev, deletes_only=True)
    try:
        lease = store.grant_lease(1)
        store.put(f"{prefix}/d/a", "1")
        store.put(f"{prefix}/d/a", "2")
        store.delete(f"{prefix}/d/a")
        store.put(f"{prefix}/d/b", "leased", lease=lease)
        store.delete(f"{prefix}/d/old")
        store.put(f"{prefix}/dx", "outside the prefix")
        store.delete(f"{prefix}/dx")
        events = w.wait_for(3, timeout=lease.ttl + 3)
        time.sleep(0.3)      # nothing more comes
    finally:
        w.close()
    assert [(e.type, e.key.rsplit("/", 1)[1], e.value) for e in w.events] == [
        (EVENT_DELETE, "a", None), (EVENT_DELETE, "old", None), (expired(kind), "b", None)]
    assert all(e.revision > rev for e in events)


def test_watch_burst_of_200_loses_nothing(store, prefix):
    _, rev = store.list(f"{prefix}/burst")
    w = Watcher(store, f"{prefix}/burst", rev)
    try:
        writer = threading.Thread(target=lambda: [
            store.put(f"{prefix}/burst/k{i % 7}", str(i)) for i in range(200)])
        writer.start()
        writer.join()
        events = w.wait_for(200, timeout=20)
    finally:
        w.close()
    assert [e.value for e in events] == [str(i) for i in range(200)]
    assert len({e.revision for e in events}) == 200


def test_watch_from_past_revision_replays(store, prefix):
    first = store.put(f"{prefix}/h/a", "1")
    store.put(f"{prefix}/h/b", "2")
    store.delete(f"{prefix}/h/a")
    got = replay(store, f"{prefix}/h", first - 1, count=3)
    assert [(e.type, e.value) for e in got] == [
        (EVENT_PUT, "1"), (EVENT_PUT, "2"), (EVENT_DELETE, None)]
    resumed = replay(store, f"{prefix}/h", got[1].revision, count=1)
    assert resumed == got[2:]


def test_watch_ends_soon_after_stop_event(store, prefix):
    _, rev = store.list(f"{prefix}/s")
    w = Watcher(store, f"{prefix}/s", rev)
    time.sleep(0.3)
    assert w.close() < 1.5
    assert w.error is None


def test_watch_timeout_returns_normally(store, prefix):
    _, rev = store.list(f"{prefix}/t")
    t0 = time.monotonic()
    assert list(store.watch(f"{prefix}/t", rev, timeout=0.6)) == []
    assert 0.5 <= time.monotonic() - t0 < 2.5


def test_health_says_something(store):
    assert store.name in store.health()


def compact_history(store, kind, etcd, prefix):
    """Make the store forget its history up to now."""
    if kind == "memory":
        for i in range(30):  # history=10 keeps at most 20 events
            store.put(f"{prefix}/filler/{i % 3}", str(i))
    elif kind == "etcd2":
        for i in range(1010):  # v2 keeps the last 1000 events
            store.put(f"{prefix}/filler/{i % 3}", str(i))
    else:
        import json
        import urllib.request
        rev = store.put(f"{prefix}/filler/0", "x")
        req = urllib.request.Request(etcd.url + "/v3/kv/compaction", method="POST",
                                     data=json.dumps({"revision": str(rev)}).encode())
        urllib.request.urlopen(req, timeout=5).read()


def test_watch_from_compacted_revision_asks_for_relist(kind, request, prefix):
    from elasticd.store import MemoryStore, WatchCompacted
    from store_backends import open_backend

    etcd = None if kind == "memory" else request.getfixturevalue("etcd")
    store = MemoryStore(history=10) if kind == "memory" else open_backend(kind, etcd.endpoints)
    first = store.put(f"{prefix}/c/a", "1")
    compact_history(store, kind, etcd, prefix)
    with pytest.raises(WatchCompacted):
        list(store.watch(f"{prefix}/c", first - 1, timeout=2))
    kvs, rev = store.list(f"{prefix}/c")  # the documented recovery: re-list, watch on
    assert [kv.value for kv in kvs] == ["1"]
    store.put(f"{prefix}/c/b", "2")
    assert [e.value for e in replay(store, f"{prefix}/c", rev, count=1)] == ["2"]
    store.close()
