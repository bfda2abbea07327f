"""Worker start-up hook that elasticd installs through PYTHONPATH.

Python imports ``sitecustomize`` at start-up from the first directory on
sys.path that has one; elasticd puts this directory first on every worker's
PYTHONPATH. Without any change to the training script it:

* makes every ``torch.optim`` optimizer step a progress beat (see
  elasticd_heartbeat.py), by registering torch's global optimizer step
  post-hook the moment ``torch.optim.optimizer`` is imported: torch itself
  is never imported from here, so non-torch processes pay nothing for it;
* makes SIGUSR1 dump every thread's Python stack to stderr (the rank's log),
  which is what the daemon sends a rank that stopped making progress;
* then runs the ``sitecustomize`` this one shadows (the next one on
  sys.path, e.g. a distribution's or the user's own), so nothing is lost.

It must stay cheap, never raise, and run on any Python 3 the job may use.
"""
import sys


def _install_fault_handler():
    import faulthandler
    import signal
    if hasattr(signal, "SIGUSR1") and hasattr(faulthandler, "register"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        except (ValueError, RuntimeError, OSError):  # no usable stderr
            pass


_TARGET = "torch.optim.optimizer"


class _OptimizerHookFinder(object):
    """A meta-path finder that only watches for one module and wraps its loader."""

    def __init__(self, on_loaded):
        self._on_loaded = on_loaded
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET or self._busy:
            return None
        self._busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _LoaderThenHook(loader, self._on_loaded, self)
        return spec


class _LoaderThenHook(object):
    def __init__(self, loader, on_loaded, finder):
        self._loader = loader
        self._on_loaded = on_loaded
        self._finder = finder

    def __getattr__(self, name):  # get_source, is_package, ... as the real loader has them
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            sys.meta_path.remove(self._finder)
        except ValueError:
            pass
        try:
            self._on_loaded(module)
        except Exception:  # a broken hook must not break importing torch
            pass


def _register_step_hook(optimizer_module):
    register = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
    if register is None:
        return
    from elasticd_heartbeat import _optimizer_step_hook
    register(_optimizer_step_hook)


def _install_optimizer_hook():
    if _TARGET in sys.modules:  # cannot happen at start-up, but be exact
        _register_step_hook(sys.modules[_TARGET])
        return
    sys.meta_path.insert(0, _OptimizerHookFinder(_register_step_hook))


def _run_shadowed_sitecustomize():
    """Run the next ``sitecustomize`` on sys.path, the one this file hides."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        from importlib.machinery import PathFinder
        from importlib.util import module_from_spec
        spec = PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        module = module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:
        # What site.py does when a sitecustomize fails: report it, carry on.
        import traceback
        sys.stderr.write("Error in the sitecustomize that elasticd's chains to:\n")
        traceback.print_exc()


for _step in (_install_fault_handler, _install_optimizer_hook):
    try:
        _step()
    except Exception:
        pass
_run_shadowed_sitecustomize()
