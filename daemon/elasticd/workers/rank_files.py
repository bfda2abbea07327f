"""Where a rank's hang-detection files are, and what its environment gets for them:
worker_site/ first on PYTHONPATH, its heartbeat file, the learned limits file.

hangs/ reads and writes those files (beat_channel, timeouts); the worker group
puts them in every rank's environment. Names from the worker contract (env.py).
"""
from __future__ import annotations

import os

from . import env as envnames

WORKER_SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker_site")


def site_env(env: dict) -> dict[str, str]:
    """PYTHONPATH with worker_site/ first: what every worker (and spare) gets."""
    rest = env.get("PYTHONPATH", "")
    parts = [WORKER_SITE] + [p for p in rest.split(os.pathsep) if p and p != WORKER_SITE]
    return {"PYTHONPATH": os.pathsep.join(parts)}


def heartbeat_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, envnames.HEARTBEAT_FILE_NAME.format(rank=rank))


def limits_file(run_dir: str) -> str:
    return os.path.join(run_dir, envnames.LIMITS_FILE_NAME)


def rank_env(run_dir: str, rank: int) -> dict[str, str]:
    """What one rank's environment adds: where it beats, where its learned limits are."""
    return {envnames.HEARTBEAT_FILE: heartbeat_file(run_dir, rank),
            envnames.LIMITS_FILE: limits_file(run_dir)}
