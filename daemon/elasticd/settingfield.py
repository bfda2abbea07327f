"""The dataclass field that carries one setting's help text and bounds.

``config/`` reads this metadata to document (``--help``, the sample TOML)
and to check (``min``, ``max``, ``choices``) every setting; the in-process
settings (workers/inprocess_settings.py) are built with it too, so the daemon's
``[inprocess]`` section and the worker-side wrapper share one definition.
Stdlib only: the wrapper imports it inside the job's interpreter.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, help: str, *, min: float | None = None, max: float | None = None,
            choices: tuple[str, ...] | None = None, exclusive_min: bool = False) -> Any:
    """A field with ``default`` and the metadata config/ documents and checks.

    A list default is copied for each instance (dataclasses refuse a shared
    mutable default).
    """
    meta = {"help": help, "min": min, "max": max, "choices": choices,
            "exclusive_min": exclusive_min}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
