"""The worker contract: worker_site/elasticd_heartbeat.py, as a module of this process.

That file defines the beat channel (record format, phases, parser) and is
what workers import; the daemon (hangs/detector.py) and the in-process library
(inprocess/_beat.py) use the very same file, so the format lives in one
place. In a worker elasticd started, ``elasticd_heartbeat`` is on the path
(and the optimizer hook already uses it): that module is used, so there is
one rate limiter and one record of the last beat. Elsewhere (the daemon) the
same file is loaded under the same module name. It imports nothing heavy.
"""
import importlib.util
import os
import sys

try:
    import elasticd_heartbeat as beats
except ImportError:
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker_site",
                         "elasticd_heartbeat.py")
    _spec = importlib.util.spec_from_file_location("elasticd_heartbeat", _path)
    beats = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(beats)
    sys.modules["elasticd_heartbeat"] = beats

__all__ = ["beats"]
