"""The one decoder for JSON that comes from outside the daemon: bounded before any work.

Every value read from etcd, every line from a worker template or a worker,
every file a worker can touch goes through ``decode`` before anything looks
inside it. It never raises anything but ``BadValue``: a value too large, not
UTF-8, not JSON, nested too deep, holding NaN, an infinity or a whole number
of more than 64 digits, or not of the wanted top-level type is a typed
rejection of that one value, never an exception that escapes into a watch
loop or an agent thread.

What it does not do is check fields: the typed record built from the value
(a join, a round state, a node record) does that, and turns ``BadValue``
into its own refusal. Standard library only, no imports of ours: the worker
side imports it too.
"""
from __future__ import annotations

import enum
import json
import math

DEFAULT_MAX_DEPTH = 16       # the deepest record the daemon writes is 5 levels
MAX_NUMBER_CHARS = 64        # digits of a whole number: a longer one is none we ever write


class Why(str, enum.Enum):
    """Why a value was refused before it was read: one label each, for metrics."""
    TOO_LARGE = "too_large"
    NOT_TEXT = "not_text"          # not UTF-8
    NOT_JSON = "not_json"
    TOO_DEEP = "too_deep"
    BAD_NUMBER = "bad_number"      # NaN, an infinity, or an absurdly long literal
    WRONG_TYPE = "wrong_type"      # not the wanted top-level type


class BadValue(ValueError):
    """One value refused. ``why`` is the label; the message is one line for a log."""

    def __init__(self, why: Why, detail: str):
        super().__init__(f"{why.value}: {detail}")
        self.why = why
        self.detail = detail


_INT_BOUND = 10 ** MAX_NUMBER_CHARS


def _no_constant(name: str):
    raise BadValue(Why.BAD_NUMBER, f"{name} is not a number we accept")


def _check_tree(doc, limit: int) -> None:
    """BadValue if a container in ``doc`` lies deeper than ``limit`` or a number is not
    finite or has more than MAX_NUMBER_CHARS digits (one iterative pass, no recursion:
    checking after the C parser is several times cheaper than a hook per number)."""
    stack = [(doc, 1)] if type(doc) in (dict, list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise BadValue(Why.TOO_DEEP, f"nested deeper than {limit}")
        for c in (node.values() if type(node) is dict else node):
            kind = type(c)
            if kind is dict or kind is list:
                stack.append((c, depth + 1))
            elif kind is float:
                if not math.isfinite(c):
                    raise BadValue(Why.BAD_NUMBER, "a number that is not finite")
            elif kind is int and not -_INT_BOUND < c < _INT_BOUND:
                raise BadValue(Why.BAD_NUMBER, f"a number of more than {MAX_NUMBER_CHARS} "
                                               "digits")
    if type(doc) is float and not math.isfinite(doc) or \
            type(doc) is int and not -_INT_BOUND < doc < _INT_BOUND:
        raise BadValue(Why.BAD_NUMBER, "a number out of range")


def as_bytes(data: str | bytes | None, max_bytes: int) -> bytes:
    """``data`` as bytes, or BadValue if it is none, not text, or over ``max_bytes``
    (a str over the cap is refused before it is encoded)."""
    if data is None:
        raise BadValue(Why.NOT_JSON, "no value")
    if isinstance(data, str):
        if len(data) > max_bytes:  # each character is at least one byte
            raise BadValue(Why.TOO_LARGE, f"over {max_bytes} bytes")
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError:
            raise BadValue(Why.NOT_TEXT, "not encodable as UTF-8") from None
    elif isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
    else:
        raise BadValue(Why.WRONG_TYPE, f"a {type(data).__name__}, not text")
    if len(raw) > max_bytes:
        raise BadValue(Why.TOO_LARGE, f"{len(raw)} bytes, over {max_bytes}")
    return raw


def decode(data: str | bytes | None, *, max_bytes: int, want: type | None = dict,
           max_depth: int = DEFAULT_MAX_DEPTH):
    """The JSON document in ``data``, or ``BadValue``.

    ``max_bytes`` bounds the encoded size and is checked before any parsing;
    ``want`` is the required top-level type (``dict``, ``list``, or None for
    any); ``max_depth`` counts containers (``{}`` is depth 1)."""
    raw = as_bytes(data, max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadValue(Why.NOT_TEXT, "not UTF-8") from None
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except BadValue:
        raise
    except RecursionError:
        raise BadValue(Why.TOO_DEEP, "nested deeper than the parser goes") from None
    except ValueError as exc:   # Python refuses int literals over 4300 digits itself
        why = Why.BAD_NUMBER if "integer string conversion" in str(exc) else Why.NOT_JSON
        raise BadValue(why, str(exc)[:120]) from None
    except (TypeError, OverflowError) as exc:
        raise BadValue(Why.NOT_JSON, str(exc)[:120]) from None
    if want is not None and not isinstance(doc, want):
        raise BadValue(Why.WRONG_TYPE, f"a {type(doc).__name__}, not a {want.__name__}")
    _check_tree(doc, max_depth)
    return doc
