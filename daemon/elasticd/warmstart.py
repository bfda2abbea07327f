"""Bootstrap of a warm spare worker: import the heavy modules, then wait.

The daemon starts this file by path with the job's own Python interpreter
(so it needs nothing of elasticd installed there), as the job's user, in
the job's directory and environment. It imports torch ahead of need, then
blocks on stdin for one JSON line: the worker's full environment and its
command line. It then becomes that worker exactly as ``python [-u] SCRIPT
ARGS`` or ``python [-u] -m MODULE ARGS`` would, minus the seconds of
interpreter start and torch import. EOF on stdin means "not needed": exit 0.

Nothing here may print before the assignment arrives except import errors.
"""
import json
import os
import runpy
import sys


def _preload() -> None:
    names = os.environ.get("ELASTICD_WARM_PRELOAD", "torch,torch.distributed")
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            __import__(name)
        except Exception:  # the worker will import it itself and see the error
            pass


def _become(assignment: dict) -> None:
    os.environ.clear()
    os.environ.update(assignment["env"])
    os.chdir(assignment["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # workers get /dev/null on stdin, as when spawned directly
    os.close(devnull)
    args = list(assignment["args"])  # what follows the interpreter on the command line
    while args and args[0] in ("-u", "-B"):
        args.pop(0)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = args[0]
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    # Python put this file's directory first on sys.path; the worker must not
    # see elasticd's modules as top-level ones. _become sets the real entry.
    sys.path[0] = os.getcwd()
    _preload()
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    _become(json.loads(line))


if __name__ == "__main__":
    main()
