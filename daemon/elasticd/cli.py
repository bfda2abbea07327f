"""``elasticd`` command line: flags over env over the config file."""
from __future__ import annotations

import argparse
import os
import sys

from . import __version__, config, logsetup

EPILOG = """\
Settings come from, later winning: defaults, the config file
(/etc/elasticd/elasticd.toml or --config), ELASTICD_<SECTION>_<NAME> environment
variables, then these flags. --help-config lists every setting.

examples:
  elasticd --standalone                 one node, in-memory store, no etcd
  elasticd --etcd http://10.0.0.5:2379  join the cluster kept in that etcd
  elasticd --check-config --config /etc/elasticd/elasticd.toml
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


def main(argv: list[str] | None = None) -> int:
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
