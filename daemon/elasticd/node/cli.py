"""``elasticd`` command line: flags over env over the config file."""
from __future__ import annotations

import argparse
import os
import sys

from .. import __version__, config, logsetup

EPILOG = """\
Settings come from, later winning: defaults, the config file
(/etc/elasticd/elasticd.toml or --config), ELASTICD_<SECTION>_<NAME> environment
variables, then these flags. --help-config lists every setting.

examples:
  elasticd --standalone                 one node, in-memory store, no etcd
  elasticd --etcd http://10.0.0.5:2379  join the cluster kept in that etcd
  elasticd --check-config --config /etc/elasticd/elasticd.toml
  elasticd keygen [--out PATH] [--force]   write a new cluster key (0600)
  elasticd etcd-roles [--apply]            print (or make) the etcd RBAC roles
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elasticd", description="Node daemon for elastic, fault-tolerant PyTorch training.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="PATH", help="config file (default: "
                   f"{config.DEFAULT_CONFIG_PATH} if it exists)")
    p.add_argument("--standalone", action="store_true", default=None,
                   help="run one node with an in-memory store (no etcd)")
    p.add_argument("--node-id", metavar="ID", help="this node's id (default: hostname)")
    p.add_argument("--socket", metavar="PATH", help="control socket path")
    p.add_argument("--state-dir", metavar="DIR", help="job records and logs")
    p.add_argument("--etcd", metavar="URL[,URL...]", help="etcd endpoints")
    p.add_argument("--etcd-prefix", metavar="P", help="etcd key prefix (default /elasticd)")
    p.add_argument("--metrics-port", metavar="N", type=int, help="Prometheus port (0: off)")
    p.add_argument("--metrics-address", metavar="ADDR", help="address the metrics endpoint "
                   "listens on (default 0.0.0.0; 127.0.0.1 keeps it on this host)")
    p.add_argument("--slots", metavar="N", type=int, help="worker processes this node runs at "
                   "once (default: CPUs)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--set", metavar="SECTION.NAME=VALUE", action="append", default=[],
                   help="any setting, e.g. --set agent.stop_grace_period=10 (repeatable)")
    p.add_argument("--check-config", action="store_true",
                   help="validate the settings, print them, and exit")
    p.add_argument("--help-config", action="store_true",
                   help="list every setting with its default and meaning, and exit")
    p.add_argument("--version", action="version", version=f"elasticd {__version__}")
    return p


_FLAG_SETTINGS = {
    "standalone": "daemon.standalone", "node_id": "daemon.node_id", "socket": "daemon.socket",
    "state_dir": "daemon.state_dir", "etcd": "etcd.endpoints", "etcd_prefix": "etcd.prefix",
    "metrics_port": "metrics.port", "metrics_address": "metrics.address", "slots": "daemon.slots", "log_level": "daemon.log_level",
}


def overrides_from(args: argparse.Namespace) -> dict:
    out = {}
    for attr, key in _FLAG_SETTINGS.items():
        value = getattr(args, attr)
        if value is not None:
            out[key] = value
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise config.ConfigError([f"--set {item!r}: expected SECTION.NAME=VALUE"])
        out[key.strip()] = value
    return out


def keygen_main(argv: list[str]) -> int:
    from ..trust import clusterkey
    p = argparse.ArgumentParser(
        prog="elasticd keygen", description="Write a new random cluster key (mode 0600). "
        "Every node of a cluster needs the same key: make it once, then copy the file "
        "(root-owned, 0600) to each node, as with munge.key.")
    p.add_argument("--out", metavar="PATH", default=config.ClusterSettings().key_file,
                   help="where to write it (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="replace an existing key")
    args = p.parse_args(argv)
    try:
        clusterkey.generate(args.out, force=args.force)
    except clusterkey.ClusterKeyError as exc:
        print(f"elasticd keygen: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a new cluster key to {args.out}; copy it to every node "
          "(same path, root-owned, mode 0600)")
    return 0


def etcd_roles_main(argv: list[str]) -> int:
    from ..trust import etcdroles
    p = argparse.ArgumentParser(
        prog="elasticd etcd-roles", description="Print (or, with --apply, make) the etcd "
        f"roles: {etcdroles.DAEMON_ROLE} read-write on the daemons' prefix only, "
        f"{etcdroles.TORCHRUN_ROLE} read-write on the torchrun adapter's prefix only.",
        epilog="then, if not done yet: add the users (etcdctl user add root; etcdctl user "
               "add elasticd; ...), grant the roles, and `etcdctl auth enable`; set "
               "etcd.username / etcd.password_file on every node.")
    p.add_argument("--config", metavar="PATH", help="elasticd config (for etcd.prefix, "
                   "endpoints and TLS)")
    p.add_argument("--etcd-prefix", metavar="P", help="the daemons' prefix (default: the "
                   "config's etcd.prefix)")
    p.add_argument("--torchrun-prefix", metavar="P", default=etcdroles.TORCHRUN_PREFIX)
    p.add_argument("--daemon-user", metavar="NAME", default="",
                   help=f"grant {etcdroles.DAEMON_ROLE} to this existing etcd user")
    p.add_argument("--torchrun-user", metavar="NAME", default="",
                   help=f"grant {etcdroles.TORCHRUN_ROLE} to this existing etcd user")
    p.add_argument("--apply", action="store_true", help="make them now, through etcd's v3 "
                   "API (needs an etcd user allowed to change roles)")
    p.add_argument("--etcd", metavar="URL[,URL...]", help="endpoints (default: the config's)")
    p.add_argument("--user", metavar="NAME", default="root", help="etcd user for --apply "
                   "(default root)")
    p.add_argument("--password-file", metavar="PATH", help="that user's password")
    args = p.parse_args(argv)
    try:
        overrides = {"etcd.endpoints": args.etcd} if args.etcd else {}
        cfg = config.load(args.config, overrides=overrides)
    except config.ConfigError as exc:
        print(f"elasticd etcd-roles: {exc}", file=sys.stderr)
        return 2
    try:
        steps = etcdroles.plan(args.etcd_prefix or cfg.etcd.prefix, args.torchrun_prefix,
                               args.daemon_user, args.torchrun_user)
    except ValueError as exc:
        print(f"elasticd etcd-roles: {exc}", file=sys.stderr)
        return 2
    if not args.apply:
        print("\n".join(etcdroles.commands(steps)))
        return 0
    from ..store import StoreError
    from ..store.etcd3 import Etcd3Store
    password = ""
    if args.password_file:
        with open(args.password_file) as fh:
            password = fh.read().strip()
    e = cfg.etcd
    store = Etcd3Store(list(cfg.etcd.endpoints), timeout=e.request_timeout * 4,
                       ca_cert=e.ca_cert or None, cert=e.cert or None, key=e.key or None,
                       username=args.user or None, password=password)
    try:
        for line in etcdroles.apply(store, steps):
            print(line)
    except StoreError as exc:
        print(f"elasticd etcd-roles: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return 0


_TOOLS = {"keygen": keygen_main, "etcd-roles": etcd_roles_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _TOOLS:
        return _TOOLS[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    if args.help_config:
        print(config.describe())
        return 0
    try:
        cfg = config.load(args.config, overrides=overrides_from(args))
    except config.ConfigError as exc:
        print(f"elasticd: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        import dataclasses
        import json
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return 0
    logsetup.setup(cfg.daemon.log_level)
    # The daemon forks workers from threads while gRPC serves; gRPC's fork
    # handlers are for children that use gRPC, which ours never do.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from .daemon import Daemon, install_signal_handlers
    daemon = Daemon(cfg)
    install_signal_handlers(daemon)
    return daemon.run()


if __name__ == "__main__":
    sys.exit(main())
