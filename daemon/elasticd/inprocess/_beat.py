"""The heartbeat functions, shared with worker_site/elasticd_heartbeat.py.

In a worker elasticd started, ``elasticd_heartbeat`` is on the path (and the
optimizer hook already uses it): import that very module so there is one
rate limiter and one record of the last beat. Elsewhere load the same file
from this package, under the same module name.
"""
import importlib.util
import os
import sys

try:
    import elasticd_heartbeat as _hb
except ImportError:
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "worker_site", "elasticd_heartbeat.py")
    _spec = importlib.util.spec_from_file_location("elasticd_heartbeat", _path)
    _hb = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_hb)
    sys.modules["elasticd_heartbeat"] = _hb

heartbeat = _hb.heartbeat
last_beat = _hb.last_beat
