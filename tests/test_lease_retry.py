"""The lease keeper retries a failed refresh at once, then every half second.

Found on real networks (test_chaos_soak.py): a minority etcd member was cut
off while daemons talked to it; a refresh hung for the request timeout
(1.5 s), the keeper then waited another 0.5 s, and with the 1 s refresh
interval that is the whole 3 s TTL: the leases of healthy nodes expired and
their peers restarted the job. The store already points at the next
endpoint after such a failure, so the first retry must go at once.
"""
from __future__ import annotations

from elasticd.cluster.membership import LeaseKeeper
from elasticd.store import StoreUnavailable, open_store
from elasticd.trust.sealed import PLAIN


class Flaky:
    """A store whose lease refreshes fail while ``down`` is set."""

    def __init__(self, store):
        self.store, self.down = store, False

    def refresh_lease(self, lease):
        if self.down:
            raise StoreUnavailable("member cut off (test)")
        return self.store.refresh_lease(lease)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_first_retry_after_a_failed_refresh_goes_at_once():
    store = Flaky(open_store("memory"))
    info = {"node_id": "n1", "host": "h", "address": "10.0.0.1", "slots": 1, "version": "t",
            "pid": 1, "state": "ready"}
    keeper = LeaseKeeper(store, "n1", ttl=3, interval=1.0, info=lambda: dict(info),
                         records=PLAIN)
    keeper.register()
    assert keeper.tick() == "refreshed the lease" and keeper._next_wait() == 1.0
    store.down = True
    assert keeper.tick() == "etcd unavailable"
    assert keeper._next_wait() == 0.0          # at once: the lease is nearly out
    assert keeper.tick() == "etcd unavailable"
    assert keeper._next_wait() == 0.5          # then no faster than every half second
    assert keeper._next_wait() == 0.5
    store.down = False
    assert keeper.tick() == "refreshed the lease" and keeper._next_wait() == 1.0


def test_refreshes_leave_every_interval_however_long_each_takes():
    """A refresh that took 0.75 s (200 ms each way and a retransmission) is followed
    by the next 0.25 s later, not a whole interval later: found in CI, where a
    healthy node's lease expired on the 200 ms + 5 % loss link
    (test_partitions.py::test_latency_and_loss_on_every_etcd_link)."""
    store = Flaky(open_store("memory"))
    info = {"node_id": "n1", "host": "h", "address": "10.0.0.1", "slots": 1, "version": "t",
            "pid": 1, "state": "ready"}
    keeper = LeaseKeeper(store, "n1", ttl=3, interval=1.0, info=lambda: dict(info),
                         records=PLAIN)
    keeper.register()
    assert keeper.tick() == "refreshed the lease"
    assert keeper._next_wait(took=0.75) == 0.25
    assert keeper._next_wait(took=2.5) == 0.0
    store.down = True
    keeper.tick()
    keeper._next_wait(took=1.5)                       # the retry at once
    keeper.tick()
    assert keeper._next_wait(took=0.25) == 0.25       # half a second from the last start
    assert keeper._next_wait(took=1.5) == 0.0         # a hung request was wait enough


class ExpiresAfterALook:
    """A store where a node key expires (its old lease ran out) just after the first
    look at it."""

    def __init__(self, store):
        self.store, self.armed = store, True

    def get(self, key):
        kv = self.store.get(key)
        if self.armed and kv is not None:
            self.armed = False
            self.store.delete(key)
        return kv

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_our_stale_key_expiring_while_we_register_is_no_other_daemon():
    import socket
    store = ExpiresAfterALook(open_store("memory"))
    # A daemon of this host that no longer runs (pid 1 is no elasticd) left its key.
    info = {"node_id": "n1", "host": socket.gethostname(), "address": "10.0.0.1",
            "slots": 1, "version": "t", "pid": 1, "state": "ready"}
    LeaseKeeper(store.store, "n1", ttl=30, interval=1.0, info=lambda: dict(info),
                records=PLAIN).register()
    keeper = LeaseKeeper(store, "n1", ttl=30, interval=1.0, info=lambda: dict(info),
                         records=PLAIN)
    keeper.register()           # was: NodeIdInUse "was just taken by another daemon"
    assert not store.armed and keeper.lease is not None
    assert store.store.get("/v1/nodes/n1") is not None
