"""The value checks every reader of untrusted input shares (`colonnade.untrusted`)."""

import math

import pytest

from colonnade import protocol
from colonnade.pulse import format as pulse_format
from colonnade.untrusted import MAX_INT, SchemaError, is_int, is_number, need


def test_a_bool_is_neither_an_int_nor_a_number():
    # JSON's `true` reads as a Python bool, which isinstance(x, int) accepts
    assert not is_int(True) and not is_int(False, -1, 1)
    assert not is_number(True) and not is_number(False, finite=False)


def test_is_int_takes_its_bounds_inclusive():
    assert is_int(0) and is_int(MAX_INT) and not is_int(MAX_INT + 1) and not is_int(-1)
    assert is_int(-1, -1, 4096) and is_int(4096, -1, 4096) and not is_int(4097, -1, 4096)
    assert is_int(-(1 << 70), -math.inf, math.inf)
    assert not is_int(1.0) and not is_int("1")


def test_is_number_refuses_nan_and_infinity_unless_asked():
    assert is_number(1) and is_number(-0.5)
    assert not is_number(math.nan) and not is_number(math.inf) and not is_number("1")
    assert is_number(math.inf, finite=False) and is_number(math.nan, finite=False)


def test_need_raises_the_schema_error_every_reader_catches():
    need(True, "unused")
    with pytest.raises(SchemaError, match=r"^version/seq: integers$"):
        need(False, "version/seq: integers")
    assert protocol.SchemaError is SchemaError and issubclass(SchemaError, ValueError)
    with pytest.raises(ValueError, match="header must be an object"):  # the codec's readers
        pulse_format.validate_header([])
