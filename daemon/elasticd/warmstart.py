"""Bootstrap of a warm spare worker: import the heavy modules, then wait.

The daemon starts this file by path with the job's own Python interpreter
(so it needs nothing of elasticd installed there), as the job's user, in
the job's directory and environment, as ``python warmstart.py ARGS`` where
ARGS is what follows the interpreter in the job's command. It imports torch
ahead of need, then blocks on stdin for one JSON line: the worker's full
environment and its command line. It then becomes that worker exactly as
``python [-u] SCRIPT ARGS`` or ``python [-u] -m MODULE ARGS`` would, minus
the seconds of interpreter start and torch import. EOF on stdin means "not
needed": exit 0.

Before it imports anything, ``sys.path[0]`` is what the cold start of the
job's command would have (``entry_path``): the script's real directory, or
the working directory for ``-m``, or nothing under ``-P``/PYTHONSAFEPATH;
never the working directory for a script, where anyone who can write it
could plant a ``torch.py``.

Nothing here may print before the assignment arrives except import errors.
"""
import json
import os
import runpy
import sys


def entry_path(args: list) -> str | None:
    """``sys.path[0]`` of a cold ``python ARGS`` in the current directory, as CPython
    computes it: ``-m``: the working directory (getcwd, links resolved); a
    script: the directory of its realpath, or of the path as given when it
    cannot be resolved ("" when that has no directory). None when the cold
    start would not exist (no arguments) or prepend nothing (safe_path).
    """
    if getattr(sys.flags, "safe_path", False):
        return None
    args = list(args)
    while args and args[0] in ("-u", "-B"):
        args.pop(0)
    if not args:
        return None
    if args[0] == "-m":
        return os.getcwd()
    script = args[0]
    try:
        script = os.path.realpath(script, strict=True)
    except (OSError, TypeError):  # 3.10- has no strict: the script must exist anyway
        if not os.path.exists(script):
            return os.path.dirname(script)
        script = os.path.realpath(script)
    return os.path.dirname(script)


def _set_entry(args: list) -> bool:
    """Replace this file's directory at sys.path[0] by the job's entry; False when
    the job's script is not there (nothing may be imported from a guess)."""
    # Python put this file's directory first (unless safe_path put nothing): the
    # worker must not see elasticd's modules as top-level ones.
    ours = os.path.dirname(os.path.realpath(__file__))
    if sys.path and sys.path[0] == ours:
        del sys.path[0]
    entry = entry_path(args)
    if entry is not None:
        sys.path.insert(0, entry)
    rest = [a for a in args if a not in ("-u", "-B")]
    return bool(rest) and (rest[0] == "-m" or os.path.isfile(rest[0]))


def _preload() -> None:
    names = os.environ.get("ELASTICD_WARM_PRELOAD", "torch,torch.distributed")
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            __import__(name)
        except Exception:  # the worker will import it itself and see the error
            pass


def _become(assignment: dict, boot_args: list) -> None:
    os.environ.clear()
    os.environ.update(assignment["env"])
    os.chdir(assignment["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # workers get /dev/null on stdin, as when spawned directly
    os.close(devnull)
    args = list(assignment["args"])  # what follows the interpreter on the command line
    if args != boot_args:  # not the command this spare was started for: its entry
        if sys.path and sys.path[0] == entry_path(boot_args):
            del sys.path[0]
        _set_entry(args)
    while args and args[0] in ("-u", "-B"):
        args.pop(0)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")


def main() -> None:
    boot_args = sys.argv[1:]
    if _set_entry(boot_args):  # sys.path[0] first: nothing imported before it is right
        _preload()
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    _become(json.loads(line), boot_args)


if __name__ == "__main__":
    main()
