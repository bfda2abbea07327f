"""A state's structure: flatten a nested state into its tensors and a tagged tree,
refuse anything that is not a tensor or a plain value, tell two structures apart,
and build the state back from the tree and tensors.

The tree is JSON, one tagged list per node, so nothing in it is ever executed or
unpickled: ``["d", [[key, node], ...]]`` a dict (str or int keys), ``["l", [...]]``
a list, ``["t", [...]]`` a tuple, ``["T", i]`` the i-th tensor, ``["N"]`` None,
``["B", bool]``, ``["I", "decimal"]``, ``["F", "float.hex"]`` (exact, NaN and
-0.0 included), ``["S", str]``, ``["Y", "base64"]`` bytes.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass

import torch

from .errors import BadState, StructureChanged

MAX_DEPTH = 64          # containers inside containers; deeper (or a cycle) is refused
MAX_INT_DIGITS = 4000   # Python's own int/str limit is 4300


@dataclass(frozen=True)
class Flat:
    """A state taken apart: the tree, its tensors in order, and its signature
    (path, what) per node, which two saves of one structure share."""
    tree: list
    tensors: tuple
    signature: tuple


def path_text(path: tuple) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}"
    return f"a {type(value).__name__}" if type(value).__module__ == "builtins" else \
        f"a {type(value).__module__}.{type(value).__qualname__}"


def _check_tensor(t: torch.Tensor, path: tuple) -> None:
    where = path_text(path)
    if t.layout != torch.strided:
        raise BadState(f"{where}: a {t.layout} tensor; only dense (strided) tensors are saved")
    if t.is_quantized or t.is_nested:
        raise BadState(f"{where}: a quantized or nested tensor; only plain dense tensors")
    if t.device.type not in ("cpu", "cuda"):
        raise BadState(f"{where}: a tensor on {t.device}; only cpu and cuda tensors are saved")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise BadState(f"{where}: a {type(t).__qualname__} (a tensor subclass); save its "
                       f"plain tensor(s) instead (e.g. a DTensor's to_local())")


def _walk(value, path: tuple, depth: int, tensors: list, sig: list):
    if depth > MAX_DEPTH:
        raise BadState(f"{path_text(path)}: nested deeper than {MAX_DEPTH} (a cycle?)")
    if isinstance(value, torch.Tensor):
        _check_tensor(value, path)
        sig.append((path, f"tensor {str(value.dtype)[6:]} {list(value.shape)}"))
        tensors.append(value)
        return ["T", len(tensors) - 1]
    kind = type(value)
    if value is None:
        sig.append((path, "None"))
        return ["N"]
    if kind is bool:
        sig.append((path, "bool"))
        return ["B", value]
    if kind is int:
        text = str(value)
        if len(text) > MAX_INT_DIGITS:
            raise BadState(f"{path_text(path)}: an int of {len(text)} digits")
        sig.append((path, "int"))
        return ["I", text]
    if kind is float:
        sig.append((path, "float"))
        return ["F", value.hex()]
    if kind is str:
        sig.append((path, "str"))
        return ["S", value]
    if kind is bytes:
        sig.append((path, "bytes"))
        return ["Y", base64.b64encode(value).decode("ascii")]
    if isinstance(value, dict):
        sig.append((path, "dict"))
        items = []
        for k, v in value.items():
            if type(k) not in (str, int):
                raise BadState(f"{path_text(path)}: a key {k!r} that is {_kind(k)}; keys "
                               f"must be str or int")
            items.append([k, _walk(v, path + (k,), depth + 1, tensors, sig)])
        return ["d", items]
    if kind is list or kind is tuple:
        sig.append((path, kind.__name__))
        return ["l" if kind is list else "t",
                [_walk(v, path + (i,), depth + 1, tensors, sig) for i, v in enumerate(value)]]
    raise BadState(f"{path_text(path)}: {_kind(value)}; a snapshot holds tensors, None, "
                   f"bool, int, float, str, bytes and dicts/lists/tuples of them")


def flatten(state) -> Flat:
    """``state`` as a Flat; BadState naming the first path that is not a tensor, a plain
    value (None, bool, int, float, str, bytes) or a dict/list/tuple of them."""
    tensors: list = []
    sig: list = []
    tree = _walk(state, (), 0, tensors, sig)
    return Flat(tree, tuple(tensors), tuple(sig))


def check_same(before: tuple, now: tuple, rank: int) -> None:
    """StructureChanged, saying what changed, unless the two signatures are equal."""
    if before == now:
        return
    old, new = dict(before), dict(now)
    lines = []
    for path, what in before:
        if path not in new:
            lines.append(f"{path_text(path)} ({what}) is gone")
        elif new[path] != what:
            lines.append(f"{path_text(path)} was {what}, now {new[path]}")
    lines += [f"{path_text(p)} ({w}) is new" for p, w in now if p not in old]
    if not lines:
        lines.append("the keys come in another order")
    more = f"; and {len(lines) - 5} more" if len(lines) > 5 else ""
    raise StructureChanged(
        f"rank {rank} saves a different structure than its previous save in this process: "
        + "; ".join(lines[:5]) + more
        + " (a snapshot keeps one structure per rank: save the same keys, types, dtypes and "
          "shapes each time, e.g. after the optimizer's first step)")


class BadTree(ValueError):
    """A stored tree that is not one this module writes."""


def _node(n, tensors: list, depth: int):
    if depth > MAX_DEPTH or type(n) is not list or not n or type(n[0]) is not str:
        raise BadTree("not a node")
    tag, args = n[0], n[1:]
    if tag == "N" and not args:
        return None
    if len(args) != 1:
        raise BadTree(f"node {tag!r} with {len(args)} values")
    (a,) = args
    if tag == "T" and type(a) is int and 0 <= a < len(tensors):
        return tensors[a]
    if tag == "B" and type(a) is bool:
        return a
    if tag == "I" and type(a) is str and len(a) <= MAX_INT_DIGITS + 1:
        return int(a)
    if tag == "F" and type(a) is str:
        return float.fromhex(a)
    if tag == "S" and type(a) is str:
        return a
    if tag == "Y" and type(a) is str:
        return base64.b64decode(a, validate=True)
    if tag in ("l", "t") and type(a) is list:
        items = [_node(x, tensors, depth + 1) for x in a]
        return items if tag == "l" else tuple(items)
    if tag == "d" and type(a) is list:
        out = {}
        for kv in a:
            if type(kv) is not list or len(kv) != 2 or type(kv[0]) not in (str, int):
                raise BadTree("a dict item")
            out[kv[0]] = _node(kv[1], tensors, depth + 1)
        return out
    raise BadTree(f"node {tag!r}")


def build(tree, tensors: list):
    """The state ``tree`` describes, its ``["T", i]`` nodes taken from ``tensors``;
    BadTree for anything this module would not have written. (Plain recursive
    functions, no closures: a closure that calls itself is a reference cycle, and
    it would keep the restored tensors, and their mapping, alive until a GC.)"""
    try:
        return _node(tree, tensors, 0)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, BadTree):
            raise
        raise BadTree(str(exc)[:200]) from None
