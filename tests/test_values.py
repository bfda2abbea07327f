"""values.decode: every hostile shape is one typed BadValue, never another exception."""
from __future__ import annotations

import pytest

from elasticd.values import BadValue, Why, decode


@pytest.mark.parametrize("data, why", [
    ("[" * 50000, Why.TOO_DEEP),
    ("{\"a\":" * 5000 + "1" + "}" * 5000, Why.TOO_DEEP),
    ('{"a": ' + "[" * 17 + "]" * 17 + "}", Why.TOO_DEEP),
    ('{"nproc": 1e999}', Why.BAD_NUMBER),
    ('{"nproc": -1e999}', Why.BAD_NUMBER),
    ('{"nproc": NaN}', Why.BAD_NUMBER),
    ('{"nproc": Infinity}', Why.BAD_NUMBER),
    ('{"n": ' + "9" * 5000 + "}", Why.BAD_NUMBER),
    ('"x" ', Why.WRONG_TYPE),
    ("[1, 2]", Why.WRONG_TYPE),
    ("{", Why.NOT_JSON),
    ("", Why.NOT_JSON),
    (None, Why.NOT_JSON),
    (b"\xff\xfe{}", Why.NOT_TEXT),
    ("\ud800", Why.NOT_TEXT),
    ('{"s": "' + "x" * (1 << 20) + '"}', Why.TOO_LARGE),
    (12, Why.WRONG_TYPE),
])
def test_each_hostile_value_is_one_typed_rejection(data, why):
    with pytest.raises(BadValue) as got:
        decode(data, max_bytes=64 * 1024)
    assert got.value.why is why, got.value


def test_good_values_decode_as_json_does():
    assert decode('{"a": [1, 2.5, "\u00e9", null, true], "b": {"c": -3}}', max_bytes=1024) == \
        {"a": [1, 2.5, "\u00e9", None, True], "b": {"c": -3}}
    assert decode(b"[1]", max_bytes=8, want=list) == [1]
    assert decode("3", max_bytes=8, want=None) == 3
    assert decode('{"a": ' + "[" * 15 + "]" * 15 + "}", max_bytes=1024) is not None


def test_the_size_cap_is_checked_in_bytes_before_parsing():
    with pytest.raises(BadValue) as got:
        decode('"' + "\u00e9" * 600 + '"', max_bytes=1000, want=str)
    assert got.value.why is Why.TOO_LARGE
