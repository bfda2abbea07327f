"""The C library, loaded once, for the calls Python's ``os`` lacks (prctl's death
signal in workers/launch.py, fallocate's collapse mode in workers/logrotate.py)."""
from __future__ import annotations

import ctypes
import ctypes.util

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
