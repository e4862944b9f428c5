"""All parsing of a number with a unit, in one place (``autoconf.specs.units``): quantities of the
spec files, counts and durations of ``plan``'s flags, link rates of the testbed, against their
closed forms and their one-line refusals."""

from __future__ import annotations

import math

import pytest

from autoconf.errors import UserError
from autoconf.specs.units import float_list, fmt_rate, parse_count, parse_duration, parse_quantity, parse_rate


@pytest.mark.parametrize("value,kind,si", [("300 GB/s", "bytes_per_s", 300e9), ("2 us", "seconds", 2e-6),
                                           ("80 GiB", "bytes", 80 * 2**30), ("312 TFLOP/s", "flop_per_s", 312e12),
                                           (25.0, "bytes", 25.0)])
def test_quantities_in_si(value, kind, si):
    assert parse_quantity(value, kind) == pytest.approx(si, rel=1e-12)


@pytest.mark.parametrize("value", [True, "fast", "-1 GB/s", "nan GB/s", "1e999 GB/s"])
def test_quantities_refused_in_one_line(value):
    with pytest.raises(UserError) as e:
        parse_quantity(value, "bytes_per_s", "bw")
    assert "\n" not in str(e.value) and str(e.value).startswith("bw")


def test_a_bare_number_needs_a_unit_where_the_schema_says_so():
    with pytest.raises(UserError, match="has no unit"):
        parse_quantity(300, "bytes_per_s", "bw", unit_required=True)


@pytest.mark.parametrize("text,v", [("2T", 2e12), ("1.4e12", 1.4e12), ("300B", 300e9), ("10M", 10e6), ("5k", 5e3)])
def test_counts(text, v):
    assert parse_count(text, "--tokens") == v


@pytest.mark.parametrize("text", ["0", "2X", "-1T", "inf"])
def test_counts_refused(text):
    with pytest.raises(UserError, match="--tokens"):
        parse_count(text, "--tokens")


@pytest.mark.parametrize("text,s", [("60d", 60 * 86400), ("8w", 8 * 7 * 86400), ("2min", 120), ("90s", 90),
                                    ("1.5y", 1.5 * 365 * 86400), ("3", 3 * 86400)])
def test_durations(text, s):
    assert parse_duration(text, "--deadline") == pytest.approx(s)


def test_durations_refused_and_zero_only_where_allowed():
    with pytest.raises(UserError, match="units: s, sec, min"):
        parse_duration("3 fortnights", "--deadline")
    with pytest.raises(UserError, match="positive finite"):
        parse_duration("0", "--deadline")
    assert parse_duration("0", "--checkpoint-time", allow_zero=True) == 0.0


def test_float_lists():
    assert float_list("0.25,0.5,1,2", "--batch-factors") == (0.25, 0.5, 1.0, 2.0)


def test_rates_round_trip():
    for bits in (1e6, 200e6, 1e9, 2.5e9, 100e9):
        assert parse_rate(fmt_rate(bits)) == pytest.approx(bits)
    assert math.isclose(parse_rate("1gbit"), 1e9)


@pytest.mark.parametrize("text,bits", [("200mbit", 200e6), ("10gbit", 10e9), ("1 Gbit/s", 1e9), ("1.5Gbit", 1.5e9),
                                       ("500kbit", None), ("2500mbit", 2.5e9), ("100Gbit", 100e9)])
def test_parse_rate(text, bits):
    if bits is None:  # below the 1 mbit floor
        with pytest.raises(UserError, match="1mbit to 100gbit"):
            parse_rate(text)
    else:
        assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["200mbps", "200", "fast", "200 MB/s", "-1gbit", "1e9bit"])
def test_parse_rate_refuses_bytes_and_bare_numbers(text):
    with pytest.raises(UserError, match="bits per second"):
        parse_rate(text)


