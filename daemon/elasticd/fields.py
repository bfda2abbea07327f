"""Checked fields of records from outside the daemon: bounded numbers, text and ids.

A typed record built from a decoded value (values.py) takes each field
through one of these: the value comes back as the type the record holds, or
``ValueError`` names the field. A bool is never a number here, a float is
never an int, and nothing unbounded gets through. Standard library only.
"""
from __future__ import annotations

import math

MAX_ID = 253          # a node or job id: one key segment, as long as a host name at most
MAX_GPUS = 64         # GPUs in one node, more than any machine has: a job's gpus_per_node,
                      # an index or count from nvidia-smi, NVML or the fake GPU file


def whole(doc: dict, name: str, lo: int, hi: int, default: int | None = None) -> int:
    """``doc[name]``, an int in [lo, hi] (``default`` when absent, if given)."""
    v = doc.get(name, default)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{name}: not a whole number in [{lo}, {hi}]")
    return v


def real(doc: dict, name: str, lo: float, hi: float, default: float | None = None) -> float:
    """``doc[name]``, a finite number in [lo, hi], as a float."""
    v = doc.get(name, default)
    if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{name}: not a number in [{lo:g}, {hi:g}]")
    return float(v)


def is_whole(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def is_real(v, lo: float, hi: float) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and lo <= v <= hi


def text(doc: dict, name: str, most: int, default: str | None = None) -> str:
    v = doc.get(name, default)
    if not isinstance(v, str) or len(v) > most:
        raise ValueError(f"{name}: not text of at most {most} characters")
    return v


def flag(doc: dict, name: str, default: bool | None = None) -> bool:
    v = doc.get(name, default)
    if not isinstance(v, bool):
        raise ValueError(f"{name}: not true or false")
    return v


def is_ident(v) -> bool:
    """A node or job id as it appears in a key: one segment, printable, bounded."""
    return isinstance(v, str) and 0 < len(v) <= MAX_ID and v not in (".", "..") \
        and "/" not in v and v.isprintable()


def ident(doc: dict, name: str) -> str:
    v = doc.get(name)
    if not is_ident(v):
        raise ValueError(f"{name}: not a node or job id")
    return v


def idents(doc: dict, name: str, most: int) -> tuple:
    """``doc[name]``: a list of at most ``most`` ids (absent: none)."""
    v = doc.get(name, [])
    if not isinstance(v, list) or len(v) > most or not all(map(is_ident, v)):
        raise ValueError(f"{name}: not a list of at most {most} ids")
    return tuple(v)


def items(doc: dict, name: str, most: int) -> list:
    """``doc[name]``: a list of at most ``most`` items (absent: empty)."""
    v = doc.get(name, [])
    if not isinstance(v, list) or len(v) > most:
        raise ValueError(f"{name}: not a list of at most {most} items")
    return v


def host(doc: dict, name: str) -> str:
    """An address peers connect to: a host name or an IPv4/IPv6 literal (with a zone)."""
    v = doc.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= 255 or not all(
            c.isascii() and (c.isalnum() or c in ".-:_%[]") for c in v):
        raise ValueError(f"{name}: not a host name or address")
    return v
