"""elasticctl's arguments: each command's options and operands, and the types that check
them (the commands and the parser that dispatches them are cli.py)."""
from __future__ import annotations

import argparse
from typing import Callable


def parse_nnodes(text: str) -> tuple[int, int]:
    """``MIN`` or ``MIN:MAX`` -> (min, max); 1 <= min <= max."""
    lo_s, sep, hi_s = text.partition(":")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected MIN or MIN:MAX (e.g. 2 or 2:4), got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def parse_env(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (VALUE may be empty) -> (key, value)."""
    key, sep, value = text.partition("=")
    if not sep or not key or "\0" in text or not key.isascii() or key[0].isdigit() \
            or not all(c.isalnum() or c == "_" for c in key):
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE with KEY a variable name, got {text!r}")
    return key, value


def _int_at_least(lo: int, what: str) -> Callable[[str], int]:
    def conv(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what}: expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{what}: must be >= {lo}, got {value}")
        return value
    return conv


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of seconds, got {text!r}")
    return value


JOB_HELP = ("job id, or a name of yours: your live job of that name, else your only "
            "finished one (names are per user)")


def add_arguments(name: str, sp: argparse.ArgumentParser, common=None) -> None:
    """The options and operands of command ``name`` on its parser ``sp`` (``common``: the
    options every command takes, for a nested parser)."""
    if name == "submit":
        sp.add_argument("--name", help="job name, unique among your live jobs (other users' "
                                       "names are theirs)")
        sp.add_argument("--nnodes", type=parse_nnodes, default=(1, 1), metavar="MIN[:MAX]",
                        help="nodes the job runs on: a fixed count or an elastic range "
                             "(default 1)")
        sp.add_argument("--inprocess", action="store_true",
                        help="host a job store so a training function wrapped in "
                             "elasticd.inprocess.Wrapper restarts inside its processes after "
                             "a fault, and a rank that died is replaced by a new process that "
                             "joins the others; falls back to process restarts (see "
                             "`elasticctl status`: restarts by layer)")
        sp.add_argument("--nodes", default="", metavar="NODE[,NODE...]",
                        help="run only on these nodes (default: any node with free slots)")
        sp.add_argument("--nproc-per-node", type=_int_at_least(1, "--nproc-per-node"),
                        default=1, metavar="K", help="worker processes per node (default 1)")
        sp.add_argument("--max-restarts", type=_int_at_least(-1, "--max-restarts"), default=-1,
                        metavar="R", help="restarts allowed over the job's whole life "
                                          "(default -1: the daemon's default, "
                                          "agent.default_max_restarts: no lifetime limit)")
        sp.add_argument("--max-restarts-per-window", default=None,
                        type=_int_at_least(-1, "--max-restarts-per-window"), metavar="N",
                        help="restarts allowed within any agent.restart_window (default 1 "
                             "hour): the budget that ends a job failing over and over, while "
                             "one failing now and then runs on (default: the daemon's, "
                             "agent.default_max_restarts_per_window = 10; -1: none)")
        sp.add_argument("--gpus-per-node", type=_int_at_least(-1, "--gpus-per-node"),
                        default=None, metavar="N",
                        help="GPUs the job takes on each node, listed (by UUID) in every "
                             "worker's CUDA_VISIBLE_DEVICES; LOCAL_RANK indexes into them "
                             "(default: one per local rank on a node with GPUs, none "
                             "otherwise); the job waits PENDING until they are free")
        sp.add_argument("--spares", type=_int_at_least(0, "--spares"), default=None,
                        metavar="K",
                        help="spare nodes the job keeps beside its max nodes: each keeps the "
                             "job's worker template warm without ranks and, when a member "
                             "node is lost, takes its place (and its ranks) at once, at the "
                             "same world size (default: the cluster's, "
                             "cluster.default_spares = 0)")
        sp.add_argument("--cpu-bind", choices=("none", "numa"), default="none",
                        help="numa: bind the workers to the CPUs of their GPUs' NUMA node "
                             "(default none)")
        sp.add_argument("--env", type=parse_env, action="append", default=[], metavar="K=V",
                        help="set an environment variable for the workers (repeatable); the "
                             "rest of your environment is passed as it is")
        sp.add_argument("--wait", action="store_true",
                        help="then wait for the job to end and exit with its exit code")
        sp.add_argument("--timeout", type=_seconds, metavar="S",
                        help="with --wait: stop waiting after S seconds (exit 1)")
        sp.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...",
                        help="the command each worker runs, after --, kept verbatim")
    elif name in ("status", "cancel", "wait"):
        sp.add_argument("job", metavar="JOB", help=JOB_HELP)
    elif name == "logs":
        sp.add_argument("job", metavar="JOB", help=JOB_HELP)
        sp.add_argument("--rank", type=_int_at_least(0, "--rank"), metavar="R",
                        help="only this rank (default: every rank on this node, "
                             "each line prefixed [rank R])")
        sp.add_argument("-f", "--follow", action="store_true",
                        help="keep printing new output until the job ends")
        sp.add_argument("--tail", type=_int_at_least(1, "--tail"), metavar="N",
                        help="start with the last N lines of each log")
    elif name == "events":
        sp.add_argument("job", metavar="JOB", nargs="?",
                        help=JOB_HELP + " (default: every job you may see)")
        sp.add_argument("-f", "--follow", action="store_true",
                        help="keep printing new events (with JOB: until the job ends)")
    elif name == "list":
        sp.add_argument("--all", action="store_true",
                        help="every user's jobs (root only; others always see their own)")
    elif name in ("drain", "uncordon"):
        sp.add_argument("node", metavar="NODE", help="node id")
    elif name == "template":
        sp = sp.add_subparsers(dest="action", metavar="warm", required=True).add_parser(
            "warm", help="start one now; it idles until your job takes it, up to "
                         "agent.template_idle_timeout", parents=[common] if common else [],
            usage="elasticctl template warm [options] -- CMD ARGS...")
        sp.add_argument("--nproc-per-node", type=_int_at_least(1, "--nproc-per-node"),
                        default=1, metavar="K",
                        help="as the job will be submitted (default 1)")
        sp.add_argument("--env", type=parse_env, action="append", default=[], metavar="K=V",
                        help="as the job will be submitted (repeatable)")
        sp.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...",
                        help="the command the job will run, after --")
    if name == "wait":
        sp.add_argument("--timeout", type=_seconds, metavar="S",
                        help="stop waiting after S seconds (exit 1)")
