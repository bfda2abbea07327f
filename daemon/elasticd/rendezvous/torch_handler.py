"""elasticd's rendezvous as a torch ``RendezvousHandler``, for plain torchrun.

    torchrun --rdzv-backend=elasticd --rdzv-endpoint=ETCD_HOST:2379 \\
             --rdzv-id=JOB --nnodes=2:4 --nproc-per-node=8 train.py

runs the same round protocol as the daemons (rendezvous/protocol.py) on
etcd's v3 API (``--rdzv-conf api=v2`` for a v2 server), with no daemon at
all. Each torchrun agent is one node: it holds a lease refreshed in the
background, so a dead agent drops out of the round by itself. The group
rank 0 agent hosts the TCPStore the agents and workers bootstrap from
(``use_agent_store``), as torch's c10d handler does.

This is the only daemon-side module that imports torch; it is registered
under the ``torchrun.handlers`` entry point and never imported by elasticd.

Its keys live under their own prefix (``/elasticd-torchrun``, ``--rdzv-conf
prefix=...``), never the daemons': with etcd's RBAC (``elasticd etcd-roles``)
a torchrun user gets the ``elasticd-torchrun`` role and no access to the
daemons' keys. TLS and credentials come from ``--rdzv-conf`` keys or, better
(``ps`` shows the command line), ``ELASTICD_ETCD_*`` variables, the same
names as the daemon's etcd settings (``etcd_options``). Its timing is
``--rdzv-conf`` keys too (``CONF_NUMBERS``: lease_ttl, last_call_timeout,
join_timeout, request_timeout), checked where they come in. A finished run
leaves nothing in etcd: each agent's keys live under its lease, revoked at
``shutdown``, and the agent that leaves last removes the run's spec and state.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousHandler,
                                                  RendezvousInfo, RendezvousParameters,
                                                  RendezvousStoreInfo)
from torch.distributed.elastic.rendezvous.api import (RendezvousConnectionError,
                                                      RendezvousTimeoutError)

from ..store import LeaseNotFound, StoreError, open_store
from ..trust.sealed import PLAIN
from ..workers import hostname
from .round import ClusterRendezvous, RendezvousStopped, RoundFinal, create_job, forget_job
from .protocol import CANCELLED, FINAL, JobLimits, Result, rounds_prefix
from .status import StatusKind
from .view import JobsView

log = logging.getLogger("elasticd.torchrun")

DEFAULT_PREFIX = "/elasticd-torchrun"
# --rdzv-conf keys that are numbers: (default, smallest allowed, largest allowed, what).
CONF_NUMBERS = {
    "lease_ttl": (10, 1, 3600, "seconds an agent's lease lives unrefreshed: a dead agent "
                               "leaves the round after this"),
    "last_call_timeout": (2.0, 0.0, 3600.0, "seconds a round waits for more agents once "
                                            "--nnodes' minimum joined"),
    "join_timeout": (600.0, 1.0, 86400.0, "seconds an agent waits for a round to close, and "
                                          "a round may stay below the minimum"),
    "request_timeout": (5.0, 0.1, 300.0, "seconds one etcd request may take"),
}


def conf_number(conf: dict, name: str) -> float:
    """The ``--rdzv-conf`` number ``name`` (CONF_NUMBERS), or its default; ValueError
    naming the key when it is not a number in its range."""
    default, lo, hi, _ = CONF_NUMBERS[name]
    raw = conf.get(name, default)
    try:
        value = type(default)(raw)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {name}={raw!r}: not a number") from None
    if not lo <= value <= hi:
        raise ValueError(f"--rdzv-conf {name}={raw!r}: must be between {lo:g} and {hi:g}")
    return value


def endpoints_from(endpoint: str) -> list[str]:
    """``host:port[,host:port]`` or URLs -> URLs (http unless a scheme is given)."""
    out = []
    for part in filter(None, (p.strip() for p in endpoint.split(","))):
        out.append(part if "://" in part else f"http://{part}")
    if not out:
        raise ValueError("--rdzv-endpoint must name etcd, e.g. 10.0.0.5:2379")
    return out


# rdzv-conf key -> environment variable; a conf key wins.
_ETCD_OPTIONS = {"ca_cert": "ELASTICD_ETCD_CA_CERT", "cert": "ELASTICD_ETCD_CERT",
                 "key": "ELASTICD_ETCD_KEY", "username": "ELASTICD_ETCD_USERNAME",
                 "password": "ELASTICD_ETCD_PASSWORD",
                 "password_file": "ELASTICD_ETCD_PASSWORD_FILE"}


def etcd_options(conf: dict, env=os.environ) -> dict:
    """TLS and login for open_store from rdzv-conf keys / ELASTICD_ETCD_* variables:
    ``ca_cert``, ``cert`` + ``key`` (client TLS), ``username`` (or ``user``) with
    ``password`` or ``password_file``. ValueError names what is wrong."""
    got = {name: str(conf.get(name) or env.get(var) or "") for name, var in _ETCD_OPTIONS.items()}
    if conf.get("user") and not conf.get("username"):
        got["username"] = str(conf["user"])
    for name in ("ca_cert", "cert", "key", "password_file"):
        if got[name] and not os.path.isfile(got[name]):
            raise ValueError(f"etcd {name} {got[name]}: no such file")
    if bool(got["cert"]) != bool(got["key"]):
        raise ValueError("etcd client TLS needs both cert and key")
    password = got["password"]
    if got["password_file"]:
        with open(got["password_file"]) as fh:
            password = fh.read().strip()
    if password and not got["username"]:
        raise ValueError("an etcd password needs a username")
    return {"ca_cert": got["ca_cert"] or None, "cert": got["cert"] or None,
            "key": got["key"] or None, "username": got["username"] or None,
            "password": password or None}


def _endpoints(endpoint: str, tls: bool) -> list[str]:
    """As ``endpoints_from``, but a bare host:port means https when TLS is configured."""
    parts = [p.strip() for p in endpoint.split(",") if p.strip()]
    if tls:
        parts = [p if "://" in p else f"https://{p}" for p in parts]
    return endpoints_from(",".join(parts))


class _LeaseKeeper(threading.Thread):
    """Refreshes this agent's lease; a new one if it lapsed."""

    def __init__(self, store, ttl: int):
        super().__init__(name="elasticd-rdzv-lease", daemon=True)
        self._store = store
        self._ttl = ttl
        self.lease = store.grant_lease(ttl)
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                self._store.refresh_lease(self.lease)
            except LeaseNotFound:
                log.warning("rendezvous lease lapsed; taking a new one")
                try:
                    self.lease = self._store.grant_lease(self._ttl)
                except StoreError as exc:
                    log.warning("cannot renew the rendezvous lease: %s", exc)
            except StoreError as exc:
                log.warning("cannot refresh the rendezvous lease: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        try:
            self._store.revoke_lease(self.lease)
        except StoreError:
            pass


class ElasticdRendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters):
        api = params.get("api", "v3")
        self._run_id = params.run_id
        try:
            opts = etcd_options(params.config)
            numbers = {name: conf_number(params.config, name) for name in CONF_NUMBERS}
            if api not in ("v3", "v2", "auto"):
                raise ValueError(f"--rdzv-conf api={api!r}: must be v3, v2 or auto")
        except (ValueError, OSError) as exc:
            raise ValueError(f"elasticd rendezvous: {exc}") from None
        # The ranks reach the store at this address (MASTER_ADDR): a name that does not
        # resolve would have them retry it until their timeout, minutes from now.
        self._addr = params.local_addr or socket.getfqdn()
        unresolved = hostname.problem(self._addr)
        if unresolved:
            raise ValueError(f"elasticd rendezvous: {unresolved} (or give torchrun "
                             "--local-addr with this node's address)")
        tls = bool(opts["ca_cert"] or opts["cert"])
        self._store = open_store({"v3": "etcd3", "v2": "etcd2", "auto": "auto"}[api],
                                 _endpoints(params.endpoint, tls),
                                 prefix=params.get("prefix", DEFAULT_PREFIX),
                                 timeout=numbers["request_timeout"], lease_transport="grpc",
                                 **opts)  # refreshes on one keep-alive stream, as the daemon
        self._node_id = f"{socket.gethostname()}-{os.getpid()}-{id(self) & 0xffff:x}"
        self._lease = _LeaseKeeper(self._store, numbers["lease_ttl"])
        self._lease.start()
        # Plain records: no cluster key here (the users' own prefix), the same decoder.
        self._view = JobsView(self._store, records=PLAIN, retry=1.0)
        self._view.start()
        self._tcp_server: TCPStore | None = None   # the store this agent hosts as rank 0
        self._timeout = numbers["join_timeout"]
        limits = JobLimits(min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                           max_restarts=10 ** 9,  # torchrun keeps its own budget
                           last_call=numbers["last_call_timeout"],
                           join_timeout=self._timeout)
        self._rdzv = ClusterRendezvous(
            self._store, self._view, self._run_id, self._node_id, self._addr, nproc=1,
            lease=lambda: self._lease.lease, limits=limits, poll=0.2,
            joins_everywhere=True)      # torch asks every agent how many nodes wait
        self._result: Result | None = None
        try:
            create_job(self._store, self._run_id, {"id": self._run_id, "torchrun": True},
                       time.time(), records=PLAIN)
        except ValueError:
            pass  # another agent created it first
        except StoreError as exc:
            raise RendezvousConnectionError(f"cannot reach etcd: {exc}") from exc
        self._view.synced.wait(10)

    # -- RendezvousHandler ----------------------------------------------------
    def get_backend(self) -> str:
        return "elasticd"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            if self._result is not None:  # torchrun restarts us: ask for a new round
                self._rdzv.reopen(self._result, f"{self._node_id} restarts its workers", False)
            stop = threading.Event()
            timer = threading.Timer(self._timeout, stop.set)
            timer.start()
            try:
                result = self._rdzv.next_round(stop)
            finally:
                timer.cancel()
        except RoundFinal as final:
            raise RendezvousClosedError(final.state.reason or final.state.status) from None
        except RendezvousStopped:
            raise RendezvousTimeoutError(f"no round closed within {self._timeout:g}s") from None
        except StoreError as exc:
            raise RendezvousConnectionError(f"etcd: {exc}") from exc
        self._result = result
        place = result.place
        master = place.master_addr
        # A fresh store every round: workers use it unprefixed (torch's env://
        # with TORCHELASTIC_USE_AGENT_STORE), so keys of the last attempt must
        # not be there. Rank 0 hosts it on the port it announced when joining.
        self._tcp_server = None
        if place.group_rank == 0:
            self._tcp_server = TCPStore(master, place.master_port, is_master=True,
                                        multi_tenant=True, wait_for_workers=False)
            store: Store = self._tcp_server
        else:
            store = TCPStore(master, place.master_port, is_master=False,
                             timeout=_timedelta(self._timeout))
        prefixed = PrefixStore(f"elasticd/{self._run_id}/{place.round}", store)
        log.info("joined round %d of %s as rank %d of %d", place.round, self._run_id,
                 place.group_rank, place.group_world_size)
        return RendezvousInfo(prefixed, place.group_rank, place.group_world_size,
                              RendezvousStoreInfo(master, place.master_port))

    def is_closed(self) -> bool:
        keys = self._view.job(self._run_id)
        return bool(keys and keys.state and keys.state.status in FINAL)

    def set_closed(self) -> None:
        self._rdzv.finish(CANCELLED, f"closed by torchrun on {self._node_id}")

    def num_nodes_waiting(self) -> int:
        if self._result is None:
            return 0
        status = self._rdzv.status(self._result).kind
        if status is StatusKind.CURRENT:
            return 0
        if status is StatusKind.WAITING:
            keys = self._view.job(self._run_id)
            members = set(self._result.members)
            return len([n for n in keys.joins.get(self._result.place.round + 1, {})
                        if n not in members]) if keys else 1
        return 1  # a new round opened (a peer restarts, or a member was lost)

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        """torchrun's run ended here (it calls this unless a signal ended it): close the
        rendezvous, as torch's own handlers do, and leave nothing of the run in etcd."""
        try:
            self._rdzv.finish(CANCELLED, f"closed by torchrun on {self._node_id}")
        except StoreError as exc:
            log.warning("cannot close the rendezvous of %s: %s", self._run_id, exc)
        self._lease.stop()  # this agent's join, done and workers keys go with its lease
        self._view.stop()
        try:
            self._forget_run()
        finally:
            self._store.close()
        return True

    def _forget_run(self) -> None:
        """Remove the run's keys once no agent's are left under its rounds but the state. Each
        agent looks after revoking its own lease, so the one that revoked last sees none
        and removes them (a crashed agent's keys go with its lease's TTL)."""
        rounds = rounds_prefix(self._run_id)
        try:
            left, _ = self._store.list(rounds + "/")
            if all(kv.key == f"{rounds}/state" for kv in left):
                forget_job(self._store, self._run_id)
        except StoreError as exc:
            log.warning("cannot remove the finished run %s from etcd: %s", self._run_id, exc)


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return ElasticdRendezvousHandler(params)


def handler_creator_factory():
    """The ``torchrun.handlers`` entry point: torch calls it for the creator."""
    return create_handler
