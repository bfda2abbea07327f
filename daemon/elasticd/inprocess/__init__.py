"""In-process restart for torch training functions, and progress beats (worker side).

    from elasticd.inprocess import Wrapper, heartbeat

    @Wrapper(backend="gloo")
    def train(iteration: int):
        ...   # the default process group is ready; ``iteration`` counts restarts

When any rank raises (or makes no progress for the soft timeout), every
rank of the job tears down its process group, meets the others at a barrier
in the job's store, which elasticd hosts outside the ranks (``elasticctl
submit --inprocess``), builds a fresh process group and calls the function
again, in the same processes: no respawn, no re-import of torch. See
wrapper.py for the rules, settings and fallbacks.

``heartbeat()`` tells the daemon this rank made progress (optimizer steps do
so by themselves), ``elasticd_section(name)`` marks a long phase the daemon
times on its own; importing them does not import torch. ``Wrapper`` is
loaded on first use, as it needs torch.
"""
from ._beat import elasticd_section, heartbeat, last_beat

__all__ = ["Wrapper", "heartbeat", "last_beat", "elasticd_section", "InProcessSettings",
           "RestartAbandoned"]


def __getattr__(name):
    if name in ("Wrapper", "InProcessSettings", "RestartAbandoned"):
        from . import wrapper
        return getattr(wrapper, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
