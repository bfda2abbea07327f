"""In-memory snapshots of a rank's training state (worker side): save, restore.

    from elasticd import snapshot

    got = snapshot.restore()              # (step, state) or None
    if got:
        step, state = got
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
    ...
    snapshot.save(step, {"model": model.state_dict(), "opt": opt.state_dict(),
                         "rng": torch.get_rng_state()}, wait=False)

A state is a nested dict (str or int keys) / list / tuple of dense tensors and
plain values (None, bool, int, float, str, bytes); nothing is pickled. Each rank
keeps four slot files (two for the steps on the pin grid, two for the others) in
the job's snapshot dir on tmpfs ($ELASTICD_SNAPSHOT_DIR
under the daemon; /dev/shm/elasticd-snapshots-<uid>/<run id> without one, removed
by ``python -m elasticd.snapshot clean``). See docs/snapshots.md.

The errors load without torch; ``save``, ``restore``, ``SaveHandle`` and
``timings`` load torch on first use.
"""
from .errors import BadState, NoSpace, NotOwned, OverBudget, SnapshotError, StructureChanged

__all__ = ["save", "restore", "SaveHandle", "timings", "Timings", "SnapshotError", "BadState",
           "StructureChanged", "OverBudget", "NoSpace", "NotOwned"]


def __getattr__(name):
    if name in ("save", "SaveHandle"):
        from . import saving as module
        return getattr(module, name)
    if name == "restore":
        from . import restoring as module
        return module.restore
    if name in ("timings", "Timings"):
        from . import costs as module
        return module.last if name == "timings" else module.Timings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
