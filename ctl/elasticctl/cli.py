"""elasticctl: the command line of elasticd. One function per command.

Exit codes (scripts rely on them): 0 ok; 1 the job failed or the daemon
refused the request; 2 usage; 3 the daemon cannot be reached; 130
interrupted. ``wait`` (and ``submit --wait``) exits with the job's own exit
code instead, clamped to 1..255 when the job did not succeed.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Callable, TextIO

import grpc

from elasticctl import client as clientlib
from elasticctl import output
from elasticctl.arguments import (  # noqa: F401 (parse_*: from here as before)
    add_arguments, parse_env, parse_nnodes)
from elasticd.v1 import control_pb2 as pb

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_BROKEN_PIPE = 141
WAIT_STEP = 5.0          # seconds each WaitJob call may block
STREAM_TIMEOUT = 120.0   # seconds a non-following Logs/Events stream may take
TERMINAL = output.TERMINAL


class Context:
    """What a command works with: the daemon, the printer, stderr."""

    def __init__(self, args: argparse.Namespace, client: clientlib.Client,
                 printer: output.Printer, err: TextIO):
        self.args, self.client, self.printer, self.err = args, client, printer, err

    def note(self, text: str) -> None:
        self.err.write(f"elasticctl: {text}\n")
        self.err.flush()


# ---------------------------------------------------------------- waiting

def wait_exit_code(job: pb.Job) -> int:
    """0 if the job succeeded, else its exit code clamped to 1..255 (128+N if killed by N)."""
    if job.state == pb.SUCCEEDED:
        return EXIT_OK
    code = job.exit_code
    if code <= 0:
        sig = job.last_failure.signal if job.HasField("last_failure") else 0
        code = 128 + sig if sig > 0 else EXIT_FAILED
    return min(code, 255)


def wait_for(ctx: Context, job_id: str, timeout: float | None) -> pb.Job | None:
    """Poll WaitJob until the job ends; None if ``timeout`` seconds pass first."""
    show = ctx.err.isatty()
    deadline = None if timeout is None else time.monotonic() + timeout
    last = None
    while True:
        step = WAIT_STEP
        if deadline is not None:
            step = min(step, deadline - time.monotonic())
            if step <= 0:
                return None
        job = ctx.client.call("WaitJob", pb.WaitJobRequest(id=job_id, timeout_seconds=step),
                              wait=step)
        job_id = job.id or job_id  # a name may be reused once this job ends
        seen = (job.state, job.restarts)
        if show and seen != last:
            ctx.err.write(f"job {job.id}: {output.state_name(job.state)} "
                          f"(restarts {output.restarts_text(job)})\n")
            ctx.err.flush()
            last = seen
        if job.state in TERMINAL:
            return job


def _finish_wait(ctx: Context, job_id: str, timeout: float | None) -> int:
    job = wait_for(ctx, job_id, timeout)
    if job is None:
        ctx.note(f"job {job_id} still running after {timeout:g} s (stopped waiting)")
        return EXIT_FAILED
    ctx.printer.finished(job)
    return wait_exit_code(job)


# ---------------------------------------------------------------- commands

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeError:
        return False


def inheritable_env(environ: dict) -> tuple[dict, list]:
    """The caller's environment minus what the daemon cannot take.

    Shells export functions as variables like ``BASH_FUNC_module%%`` (Lmod,
    Environment Modules), and a variable may hold bytes that are not UTF-8;
    neither can travel, and neither should stop a submission.
    """
    env, skipped = {}, []
    for key, value in environ.items():
        if _ENV_NAME.match(key) and _utf8(value):
            env[key] = value
        else:
            skipped.append(key.encode("utf-8", "backslashreplace").decode())
    return env, sorted(skipped)


def caller_cwd_env(ctx: Context) -> tuple[str, dict]:
    """The caller's directory and environment (plus --env), as a job inherits them."""
    env, skipped = inheritable_env(dict(os.environ))
    if skipped:
        ctx.note(f"not passing {len(skipped)} environment variable(s) that cannot be sent "
                 f"(function exports or non-UTF-8 values): {', '.join(skipped)[:200]}")
    env.update(dict(ctx.args.env))
    try:
        cwd = os.getcwd()
        for text in (cwd, *ctx.args.cmd, *env.values()):
            text.encode("utf-8")
    except UnicodeError:
        raise clientlib.CtlError("the working directory or the command is not valid UTF-8; "
                       "run from a directory and with arguments that are") from None
    except FileNotFoundError:
        raise clientlib.CtlError(
            "the current directory no longer exists; cd somewhere that does") from None
    return cwd, env


def cmd_submit(ctx: Context) -> int:
    a = ctx.args
    lo, hi = a.nnodes
    cwd, env = caller_cwd_env(ctx)
    req = pb.SubmitRequest(name=a.name or "", command=a.cmd, cwd=cwd, env=env,
                           min_nodes=lo, max_nodes=hi, nproc_per_node=a.nproc_per_node,
                           nodes=[n for n in a.nodes.split(",") if n],
                           inprocess=a.inprocess,
                           max_restarts=a.max_restarts,
                           max_restarts_per_window=a.max_restarts_per_window,
                           gpus_per_node=a.gpus_per_node, cpu_bind=a.cpu_bind,
                           spares=a.spares)
    job = ctx.client.call("Submit", req).job
    if not a.wait:
        ctx.printer.submitted(job)
        return EXIT_OK
    if not ctx.printer.json:
        ctx.printer.submitted(job)
    return _finish_wait(ctx, job.id, a.timeout)


def cmd_list(ctx: Context) -> int:
    jobs, token = [], ""
    while True:  # the daemon answers in pages (limits.response_bytes each)
        resp = ctx.client.call("ListJobs", pb.ListJobsRequest(all_users=ctx.args.all,
                                                              page_token=token))
        jobs.extend(resp.jobs)
        token = resp.next_page_token
        if not token:
            break
    ctx.printer.jobs(jobs)
    return EXIT_OK


def cmd_status(ctx: Context) -> int:
    ctx.printer.job(ctx.client.call("GetJob", pb.GetJobRequest(id=ctx.args.job)))
    return EXIT_OK


def cmd_logs(ctx: Context) -> int:
    a = ctx.args
    job = ctx.client.call("GetJob", pb.GetJobRequest(id=a.job))
    ranks = {w.rank for w in job.workers}
    prefix = a.rank is None and (job.nproc_per_node > 1 or len(ranks) > 1)
    req = pb.LogsRequest(id=job.id, follow=a.follow, tail_lines=a.tail or 0)
    if a.rank is not None:
        req.rank = a.rank
    for chunk in ctx.client.stream("Logs", req, timeout=None if a.follow else STREAM_TIMEOUT):
        ctx.printer.log(chunk.rank, chunk.text, prefix)
    return EXIT_OK


def ends_job(ev: pb.Event, job_id: str) -> bool:
    """The event that moves the job to a final state (`events JOB -f` ends there)."""
    return bool(job_id) and ev.job_id == job_id and ev.kind == "state" and \
        ev.to_state in TERMINAL


def cmd_events(ctx: Context) -> int:
    a = ctx.args
    job_id = ctx.client.call("GetJob", pb.GetJobRequest(id=a.job)).id if a.job else ""
    req = pb.EventsRequest(id=job_id, follow=a.follow)
    last = 0
    for ev in ctx.client.stream("Events", req, timeout=None if a.follow else STREAM_TIMEOUT):
        ctx.printer.event(ev)
        last = ev.seq
        if a.follow and ends_job(ev, job_id):
            break  # the job ended: like `logs -f`, so does the command
    else:
        return EXIT_OK
    # What the daemon recorded after the end already (e.g. its worker template kept).
    for ev in ctx.client.stream("Events", pb.EventsRequest(id=job_id, after_seq=last),
                                timeout=STREAM_TIMEOUT):
        ctx.printer.event(ev)
    return EXIT_OK


def cmd_cancel(ctx: Context) -> int:
    # The daemon answers once the workers are stopped (its stop grace period
    # plus a margin); allow for a long configured grace period.
    ctx.printer.cancelled(ctx.client.call("CancelJob", pb.CancelJobRequest(id=ctx.args.job),
                                          wait=120.0))
    return EXIT_OK


def cmd_wait(ctx: Context) -> int:
    return _finish_wait(ctx, ctx.args.job, ctx.args.timeout)


def cmd_template(ctx: Context) -> int:
    """`template warm -- CMD`: a worker template for your next job with CMD, started on
    this node now, from your directory and environment as `submit` would send them."""
    cwd, env = caller_cwd_env(ctx)
    ctx.printer.warmed(ctx.client.call("WarmTemplate", pb.WarmTemplateRequest(
        command=ctx.args.cmd, cwd=cwd, env=env, nproc_per_node=ctx.args.nproc_per_node)))
    return EXIT_OK


def cmd_nodes(ctx: Context) -> int:
    ctx.printer.nodes(ctx.client.call("ListNodes", pb.ListNodesRequest()))
    return EXIT_OK


def _set_node_state(ctx: Context, state: str) -> int:
    # root only; the daemon answers PERMISSION_DENIED, NOT_FOUND (no such live
    # node) or FAILED_PRECONDITION (etcd unavailable), each exit 1 with its message.
    node = ctx.client.call("SetNodeState", pb.SetNodeStateRequest(node_id=ctx.args.node,
                                                                  state=state))
    ctx.printer.node_state(node)
    return EXIT_OK


def cmd_drain(ctx: Context) -> int:
    return _set_node_state(ctx, "draining")


def cmd_uncordon(ctx: Context) -> int:
    return _set_node_state(ctx, "ready")


# ---------------------------------------------------------------- the parser

# name: (function, one-line help, example, needs the daemon)
COMMANDS: dict[str, tuple[Callable[[Context], int], str, str, bool]] = {
    "submit": (cmd_submit, "queue a job; prints its id",
               "elasticctl submit --name bert --nnodes 2:4 --nproc-per-node 8 -- "
               "python train.py --lr 3e-4", True),
    "list": (cmd_list, "list this node's jobs (one only other nodes run: `status JOB`)",
             "elasticctl list -o json", True),
    "status": (cmd_status, "show one job (on any node): state, restarts, last failure, "
                           "every node's workers",
               "elasticctl status bert", True),
    "logs": (cmd_logs, "print a job's worker output on this node",
             "elasticctl logs bert --rank 3 --tail 100 -f", True),
    "events": (cmd_events, "print job events (state changes, worker exits, restarts)",
               "elasticctl events bert -f", True),
    "cancel": (cmd_cancel, "stop a job's workers and mark it CANCELLED",
               "elasticctl cancel bert", True),
    "wait": (cmd_wait, "wait for a job to end; exits with the job's exit code",
             "elasticctl wait bert --timeout 3600 && echo done", True),
    "nodes": (cmd_nodes, "list the cluster's nodes and their free slots", "elasticctl nodes",
              True),
    "drain": (cmd_drain, "stop placing new jobs on a node (root only); its running jobs go on",
              "sudo elasticctl drain node7", True),
    "uncordon": (cmd_uncordon, "let a drained node take jobs again (root only)",
                 "sudo elasticctl uncordon node7", True),
    "template": (cmd_template, "warm: start a worker template on this node now, so that "
                               "your first job here with that command starts warm",
                 "elasticctl template warm --nproc-per-node 8 -- python train.py", True),
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--output", choices=output.FORMATS, default=argparse.SUPPRESS,
                        help="table (default) or json")
    common.add_argument("--socket", metavar="PATH", default=argparse.SUPPRESS,
                        help="elasticd's control socket")
    parser = argparse.ArgumentParser(
        prog="elasticctl", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Control elasticd, the node daemon for elastic PyTorch training.",
        epilog="exit codes: 0 ok, 1 job failed or request refused, 2 usage, "
               "3 daemon unreachable\n(wait: the job's exit code)\n\n"
               "example: elasticctl submit --nnodes 2 --nproc-per-node 8 -- python train.py")
    parser.add_argument("--socket", metavar="PATH", default=None,
                        help="elasticd's control socket (default: $ELASTICD_SOCKET, else "
                             f"{clientlib.resolve_socket()})")
    parser.add_argument("-o", "--output", choices=output.FORMATS, default="table",
                        help="table (default) or json")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (func, help_text, example, _) in COMMANDS.items():
        usage = "elasticctl submit [options] -- CMD ARGS..." if name == "submit" else None
        sp = subs.add_parser(name, parents=[common], help=help_text, description=help_text,
                             usage=usage,
                             epilog=f"example:\n  {example}",
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(name, sp, common)
        sp.set_defaults(func=func, parser=sp)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and check; argparse's SystemExit(2) on a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        parser.exit(EXIT_USAGE)
    if args.command in ("submit", "template"):
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            args.parser.error("give the command to run after --, e.g. -- python train.py")
        if args.command == "submit" and args.timeout is not None and not args.wait:
            args.parser.error("--timeout needs --wait")
        args.cmd = cmd
    return args


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    err = sys.stderr
    printer = output.Printer(args.output, sys.stdout)
    client = clientlib.Client(clientlib.resolve_socket(args.socket))
    ctx = Context(args, client, printer, err)
    try:
        if COMMANDS[args.command][3]:
            client.upcheck()
        return args.func(ctx)
    except clientlib.CtlError as exc:
        ctx.note(str(exc))
        return exc.exit_code
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and not details:
            details = "the daemon did not answer in time"
        ctx.note(f"{code.name if code else 'ERROR'}: {details}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`); say nothing, and keep Python's
        # exit-time flush from complaining about the closed pipe.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # e.g. the working directory was deleted
        ctx.note(str(exc))
        return EXIT_FAILED
    finally:
        client.close()
