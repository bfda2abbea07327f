"""Run every benchmark of the README's table on this tree and rewrite the table.

    python bench/run_all.py                    # every benchmark: about 90 minutes
    python bench/run_all.py --quick            # fewer repeats, shorter runs
    python bench/run_all.py --only node_loss --only daemon_overhead

Each benchmark below runs as its own process (``python bench/SCRIPT ARGS``,
its output shown as it comes); it prints one ``BENCH-ROW`` line per table row
it measured (bench/rows.py). The rows are kept in bench/results.json with the
script, its arguments, the date and the commit they were measured on (a
``-dirty`` commit: the tree had uncommitted changes), then the lines between
``<!-- bench-table:begin -->`` and ``<!-- bench-table:end -->`` in README.md
are rewritten from that file: one line per row of ``BENCHES``, in that order;
a row not measured yet says how to measure it. A row whose script does not
print it any more is dropped from the file. ``--only`` reruns some benchmarks
and keeps the others' rows as they were measured. Every torchrun baseline is
shown twice where torch has settings of its own to match ours (last call,
timeouts): at its defaults, and matched (the ``matched`` column).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from rows import CELLS, parse_rows  # noqa: E402

BEGIN = "<!-- bench-table:begin -->"
END = "<!-- bench-table:end -->"
README = os.path.join(REPO, "README.md")
RESULTS = os.path.join(HERE, "results.json")
HEADER = ("| what | elasticd | torchrun / torch, defaults | torchrun, settings matched to "
          "ours | ratio | measured |")


@dataclass(frozen=True)
class Row:
    key: str    # what the script's BENCH-ROW line names
    what: str   # the table's first cell


@dataclass(frozen=True)
class Bench:
    name: str            # for --only
    script: str          # in bench/
    args: tuple          # the full run
    quick: tuple         # --quick: fewer repeats, shorter runs
    rows: tuple          # of Row


BENCHES = (
    Bench("goodput", "goodput.py", (), ("--duration", "40"), (
        Row("goodput", "**goodput**, a worker SIGKILLed at random times (mean 10 s), 2 ranks, "
                       "a snapshot in memory every step (`-snap`)"),
        Row("goodput-disk", "the same, a disk checkpoint every 20 steps only"),)),
    Bench("goodput_3nodes", "goodput.py", ("--nodes", "3"), ("--nodes", "3", "--duration", "40"), (
        Row("goodput-3nodes", "goodput on 3 nodes (one etcd), a node killed every 4th fault"),)),
    Bench("goodput_3nodes_spare", "goodput.py", ("--nodes", "3", "--spares", "1"),
          ("--nodes", "3", "--spares", "1", "--duration", "40"), (
        Row("goodput-3nodes-spare", "the same with a spare node (4 nodes, the job `--nnodes 3:3 "
                                    "--spares 1`), a member killed every 4th fault, "
                                    "snapshots every step"),)),
    Bench("template_start", "template_start.py", (), ("--reps", "1"), (
        Row("template-submit", "submit → first training step, the template of the user's "
                               "previous job kept (`RUN_NAME` differs per submit)"),
        Row("template-restarted", "the same, first submit after a daemon restart"),
        Row("template-fault", "fault at step 5 → first step after the restart, "
                              "ranks forked from the template"))),
    Bench("restart", "restart_vs_torchrun.py", (), ("--reps", "1"), (
        Row("restart-warm", "worker crash → first step after restart (warm spares)"),)),
    Bench("inprocess", "inprocess_vs_process.py", (), ("--reps", "1"), (
        Row("inprocess-raise", "the same, in-process restart (`--inprocess`): a rank raises"),)),
    Bench("inprocess_exit", "inprocess_vs_process.py", ("--fault", "exit"),
          ("--fault", "exit", "--reps", "1"), (
        Row("inprocess-exit", "the same, in-process: a rank calls `os._exit` (replaced)"),)),
    Bench("hang_recovery", "hang_recovery.py", (), ("--quick",), (
        Row("hang", "rank hung in C → first step after recovery, default settings"),)),
    Bench("node_loss", "node_loss_bench.py", (), ("--reps", "1"), (
        Row("node-loss", "kill -9 of one of 3 nodes → first step on the survivors"),)),
    Bench("node_loss_spare", "node_loss_bench.py", ("--spares",), ("--spares", "--reps", "1"), (
        Row("node-loss-spare", "kill -9 of a member of a 2-node job with a spare (3 nodes, "
                               "`--nnodes 2:2 --spares 1`) → first step at full world size"),)),
    Bench("scale_sim", "scale_sim.py", (), ("--quick",), (
        Row("scale-sim", "N simulated nodes (membership, watches, rendezvous, phase records) "
                         "on one etcd"),)),
    Bench("scale_sim_1000", "scale_sim.py",
          ("--nodes", "1000", "--job-nodes", "20", "--daemon-nodes", "100"),
          ("--nodes", "200", "--job-nodes", "20", "--daemon-nodes", "100", "--seconds", "4"), (
        Row("scale-sim-replay", "1,000 nodes in 50 jobs of 20 on one etcd, and one job of "
                                "all 1,000: 100 run the daemon's code, 900 replay its etcd "
                                "traffic (bench/scale_replay.py)"),)),
    Bench("watch", "watch_bench.py", ("--watchers", "50", "--writes", "50"),
          ("--watchers", "50", "--writes", "50", "--seconds", "4"), (
        Row("watch-delivery", "a watch event delivered to each of N nodes by one etcd: its CPU "
                              "per delivery, the daemon's gRPC Watch stream against etcd's "
                              "JSON gateway (the daemon's own store, both)"),)),
    Bench("rendezvous", "rendezvous_bench.py", ("--n", "64"), ("--n", "16"), (
        Row("rendezvous", "rendezvous of N participants on one etcd"),)),
    Bench("membership", "membership_bench.py", (), ("--trials", "3", "--seconds", "5"), (
        Row("node-loss-noticed", "node loss noticed after kill -9, default settings"),)),
    Bench("snapshot", "snapshot_bench.py", (), ("--reps", "2"), (
        Row("snapshot-save", "snapshot save stall, 1 GiB of state per rank: sync and async "
                             "(`wait=False`), vs `torch.save` to local disk + fsync"),
        Row("snapshot-restore", "snapshot restore of that state (tensors mapped), vs "
                                "`torch.load` of the checkpoint"))),
    Bench("replication", "replication_bench.py", (), ("--reps", "1", "--steps", "100"), (
        Row("replication", "snapshot replication to the buddy node (2 daemons, loopback): "
                           "step time it costs a job that snapshots every step"),)),
    Bench("daemon_overhead", "daemon_overhead.py", (),
          ("--starts", "2", "--idle-seconds", "5", "--spawns", "5", "--rpc-calls", "200"), (
        Row("idle-daemon", "idle daemon"),)),
)


# ---------------------------------------------------------------- the table

def render(results: dict) -> list[str]:
    """The table's lines, one per row of BENCHES, from bench/results.json's rows."""
    lines = [HEADER, "|---|---|---|---|---|---|"]
    for bench in BENCHES:
        for row in bench.rows:
            got = results.get(row.key)
            if got is None:
                lines.append(f"| {row.what} | not measured on this tree yet: "
                             f"`bench/run_all.py --only {bench.name}` | | | | |")
                continue
            cells = [_cell(got.get(c, "")) for c in CELLS]
            args = " ".join(got.get("args", []))
            where = (f"bench/{got['script']}{' ' + args if args else ''}, "
                     f"{got['date']}, {got['commit']}")
            lines.append("| " + " | ".join([row.what, *cells, _cell(where)]) + " |")
    return lines


def _cell(text: str) -> str:
    return " ".join(str(text).replace("|", "\\|").split())


def rewrite(text: str, lines: list[str]) -> str:
    """``text`` (README.md) with the lines between the two markers replaced by ``lines``."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin or text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md needs one {BEGIN} line and, after it, one {END} line")
    start = text.index("\n", begin) + 1
    return text[:start] + "".join(line + "\n" for line in lines) + text[end:]


# ---------------------------------------------------------------- running

def commit() -> str:
    """This tree's commit, ``-dirty`` if tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=10", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def run(bench: Bench, quick: bool, python: str) -> tuple[int, str]:
    """Run one benchmark, its output shown as it comes; (exit code, output)."""
    args = list(bench.quick if quick else bench.args)
    cmd = [python, os.path.join(HERE, bench.script), *args]
    print(f"\n==== {bench.name}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        out.append(line)
    return proc.wait(), "".join(out)


def take(results: dict, bench: Bench, output: str, quick: bool, when: str,
         at: str) -> list[str]:
    """Put the rows ``output`` carries into ``results``; the rows it lacks, dropped.
    Returns a sentence per row it lacked."""
    got = parse_rows(output)
    missing = []
    for row in bench.rows:
        cells = got.get(row.key)
        if cells is None:
            results.pop(row.key, None)
            missing.append(f"{bench.script} printed no row {row.key!r}")
            continue
        results[row.key] = dict(cells, script=bench.script,
                                args=list(bench.quick if quick else bench.args),
                                date=when, commit=at)
    return missing


def load(path: str) -> dict:
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return {}
    return doc if isinstance(doc, dict) else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, shorter runs")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this benchmark (repeatable): "
                         + ", ".join(b.name for b in BENCHES))
    ap.add_argument("--render-only", action="store_true",
                    help="run nothing: rewrite the table from bench/results.json")
    ap.add_argument("--readme", default=README)
    ap.add_argument("--results", default=RESULTS)
    args = ap.parse_args(argv)
    names = {b.name for b in BENCHES}
    for name in args.only:
        if name not in names:
            ap.error(f"unknown benchmark {name!r}; choose from {', '.join(sorted(names))}")
    results = load(args.results)
    problems = []
    if not args.render_only:
        at = commit()
        for bench in BENCHES:
            if args.only and bench.name not in args.only:
                continue
            code, output = run(bench, args.quick, sys.executable)
            when = datetime.date.today().isoformat()
            problems += take(results, bench, output, args.quick, when, at)
            if code != 0:
                problems.append(f"{bench.script} exited {code}")
            with open(args.results, "w") as fh:  # after each: a long run keeps what it got
                json.dump(results, fh, indent=1, sort_keys=True)
                fh.write("\n")
    with open(args.readme) as fh:
        text = fh.read()
    with open(args.readme, "w") as fh:
        fh.write(rewrite(text, render(results)))
    print(f"\nrewrote the table in {args.readme}")
    for p in problems:
        print(f"problem: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
