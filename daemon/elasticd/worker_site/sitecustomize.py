"""Worker start-up hook that elasticd installs through PYTHONPATH.

Python imports ``sitecustomize`` at start-up from the first directory on
sys.path that has one; elasticd puts this directory first on every worker's
PYTHONPATH. Without any change to the training script it:

* makes every ``torch.optim`` optimizer step and every module forward pass
  a progress beat, and ``torch.save`` / ``torch.load`` /
  ``torch.distributed.checkpoint`` save and load the ``checkpoint`` phase
  and ``torch.distributed.barrier`` the ``barrier`` phase
  (see elasticd_heartbeat.py), by registering torch's global optimizer step
  post-hook and module forward hook, and wrapping those functions, the
  moment the torch module defining each is imported (before ``torch``
  binds ``torch.save``): torch itself is never imported from here, so
  non-torch processes pay nothing for it;
* has rank 0 host its round's MASTER_PORT store (``init_process_group``'s
  ``env://``) on ``MASTER_ADDR`` alone when the daemon asks for it
  (``ELASTICD_MASTER_BIND``, set for a MASTER_ADDR on loopback: a job on one
  node), where torch's own store would listen on every interface;
* makes SIGUSR1 dump every thread's Python stack to stderr (the rank's log),
  which is what the daemon sends a rank that stopped making progress;
* says so when a beat hook cannot be installed (``elasticd_heartbeat.beats_off``:
  a line in the rank's log and an ``off`` record the daemon warns about), so
  hang detection is never off without a word;
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


class _ImportHookFinder(object):
    """A meta-path finder that watches for a few modules and runs a hook after each loads."""

    def __init__(self, hooks):
        self._hooks = dict(hooks)  # module name -> callable(module)
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        if name not in self._hooks or self._busy:
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
        spec.loader = _LoaderThenHook(loader, self._hooks.pop(name), name)
        if not self._hooks:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        return spec


class _LoaderThenHook(object):
    def __init__(self, loader, on_loaded, name):
        self._loader = loader
        self._on_loaded = on_loaded
        self._name = name

    def __getattr__(self, name):  # get_source, is_package, ... as the real loader has them
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self._on_loaded(module)
        except Exception as exc:  # a broken hook must not break importing torch
            if self._name != _MASTER_STORE_MODULE:
                _beats_off("the hook on " + self._name, exc)


def _register_step_hook(optimizer_module):
    register = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
    if register is not None:
        from elasticd_heartbeat import optimizer_step_hook
        register(optimizer_step_hook)


def _register_forward_hook(module_module):
    register = getattr(module_module, "register_module_forward_hook", None)
    if register is not None:
        from elasticd_heartbeat import forward_hook
        register(forward_hook)


def _wrapper_of(phase, *names):
    """A hook that makes the module's functions ``names`` run as ``phase``."""
    def wrap(module):
        from elasticd_heartbeat import in_phase
        for name in names:
            fn = getattr(module, name, None)
            if callable(fn):
                setattr(module, name, in_phase(phase, fn))
    return wrap


# The worker contract (elasticd/workers/env.py; copies, checked equal by tests).
MASTER_BIND_ENV = "ELASTICD_MASTER_BIND"


def _bind_master_store(rendezvous_module):
    """Make rank 0's ``env://`` store listen on ``MASTER_BIND`` only (when it is set and
    equals MASTER_ADDR, and no agent store hosts it): torch's own binds every address.
    Anything unexpected falls back to torch's own creation."""
    create = getattr(rendezvous_module, "_create_c10d_store", None)
    if not callable(create):
        return

    def create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        import os
        bind = os.environ.get(MASTER_BIND_ENV, "")
        if rank != 0 or not bind or bind != hostname or \
                os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        import socket
        sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind, port))
            sock.listen(socket.SOMAXCONN)
            from torch.distributed import TCPStore
        except (OSError, ImportError):
            sock.close()
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        fd = sock.detach()  # the store owns it from here (as in jobstore/round_server.py)
        try:
            return TCPStore(host_name=hostname, port=port, world_size=world_size,
                            is_master=True, timeout=timeout, multi_tenant=True,
                            use_libuv=kwargs.get("use_libuv", args[0] if args else True),
                            master_listen_fd=fd)
        except TypeError:  # a torch whose TCPStore takes no listening socket
            os.close(fd)
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)

    rendezvous_module._create_c10d_store = create_c10d_store


_MASTER_STORE_MODULE = "torch.distributed.rendezvous"
_HOOKS = {
    _MASTER_STORE_MODULE: _bind_master_store,
    "torch.optim.optimizer": _register_step_hook,
    "torch.nn.modules.module": _register_forward_hook,
    "torch.serialization": _wrapper_of("checkpoint", "save", "load"),
    "torch.distributed.checkpoint.state_dict_saver": _wrapper_of(
        "checkpoint", "save", "save_state_dict", "async_save"),
    "torch.distributed.checkpoint.state_dict_loader": _wrapper_of(
        "checkpoint", "load", "load_state_dict"),
    "torch.distributed.distributed_c10d": _wrapper_of("barrier", "barrier",
                                                      "monitored_barrier"),
}


def _install_torch_hooks():
    pending = {}
    for name, hook in _HOOKS.items():
        if name in sys.modules:  # cannot happen at start-up, but be exact
            hook(sys.modules[name])
        else:
            pending[name] = hook
    if pending:
        sys.meta_path.insert(0, _ImportHookFinder(pending))


def _beats_off(what, exc):
    """The beats could not be installed: elasticd_heartbeat says so in the rank's log and
    its heartbeat file, where the daemon reads it (never silently off)."""
    why = "%s failed: %s: %s" % (what, type(exc).__name__, exc)
    try:
        from elasticd_heartbeat import beats_off
        beats_off(why)
    except Exception:
        try:
            sys.stderr.write("elasticd: this process sends no progress beats, hang detection "
                             "is off for it: %s\n" % why)
        except Exception:
            pass


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


try:
    _install_fault_handler()
except Exception:
    pass
try:
    _install_torch_hooks()
except Exception as _exc:
    _beats_off("installing the torch hooks", _exc)
_run_shadowed_sitecustomize()
