"""Quantities with units, converted to SI base units at the edge.

Everything inside autoconf is SI: bytes, seconds, bytes/s, FLOP/s. Spec files may write
``"300 GB/s"``, ``"200 Gbit/s"``, ``"2 us"``, ``"80 GiB"``, ``"989 TFLOP/s"`` or a plain number
already in base units.
"""

from __future__ import annotations

import math
import re

from autoconf.errors import UserError

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}

# unit stem -> (kind, factor to the base unit of that kind)
_STEMS = {
    "B": ("bytes", 1.0), "byte": ("bytes", 1.0), "bytes": ("bytes", 1.0),
    "bit": ("bytes", 1.0 / 8), "b": ("bytes", 1.0 / 8),
    "s": ("seconds", 1.0), "ms": ("seconds", 1e-3), "us": ("seconds", 1e-6),
    "µs": ("seconds", 1e-6), "ns": ("seconds", 1e-9),
    "FLOP": ("flop", 1.0), "FLOPS": ("flop_per_s", 1.0), "flop": ("flop", 1.0),
    "W": ("watts", 1.0), "Hz": ("hertz", 1.0),
}

_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ]*)\s*(?:/\s*(s|sec))?\s*$")

KINDS = ("bytes", "seconds", "bytes_per_s", "flop_per_s", "watts", "hertz")


def _split_unit(unit: str) -> tuple[str, float]:
    if unit in ("ms", "us", "µs", "ns", "s"):
        return _STEMS[unit]
    for prefix in ("Ki", "Mi", "Gi", "Ti", "Pi", "k", "K", "M", "G", "T", "P", ""):
        if unit.startswith(prefix) and unit[len(prefix):] in _STEMS:
            kind, factor = _STEMS[unit[len(prefix):]]
            return kind, factor * _PREFIX[prefix]
    raise KeyError(unit)


def parse_quantity(value: object, kind: str, what: str = "value", unit_required: bool = False) -> float:
    """Return ``value`` in SI base units of ``kind`` (one of :data:`KINDS`), finite and >= 0.

    ``what`` names the field in error messages, e.g. ``"intra_node_bandwidth"``.
    ``unit_required``: refuse a bare number (the file schemas: "300" could mean B/s or GB/s).
    """
    if isinstance(value, bool):
        raise UserError(f"{what}: {value!r} is not a quantity; expected a number or e.g. '300 GB/s'")
    if isinstance(value, (int, float)):
        if unit_required:
            raise UserError(f"{what}: {value!r} has no unit; write it with one, e.g. '300 GB/s' or '2 us'")
        try:
            v = float(value)
        except OverflowError:
            v = math.inf
        if not math.isfinite(v):
            raise UserError(f"{what}: {value!r} is not a finite quantity")
        if v < 0:
            raise UserError(f"{what}: {value!r} is negative; expected a non-negative quantity")
        return v
    if not isinstance(value, str):
        raise UserError(f"{what}: {value!r} is not a quantity; expected a number or a string with a unit")
    m = _RE.match(value)
    examples = {"bytes": "'80 GiB'", "seconds": "'2 us'", "bytes_per_s": "'300 GB/s' or '200 Gbit/s'",
                "flop_per_s": "'989 TFLOP/s'", "watts": "'500 W'", "hertz": "'1410 MHz'"}[kind]
    if not m:
        raise UserError(f"{what}: cannot read {value!r}; expected a number and a unit, e.g. {examples}")
    number, unit, per_s = float(m.group(1)), m.group(2), m.group(3)
    if not math.isfinite(number):
        raise UserError(f"{what}: {value!r} is not a finite quantity")
    if not unit:
        if per_s:
            raise UserError(f"{what}: {value!r} has no unit before '/s'; e.g. {examples}")
        if unit_required:
            raise UserError(f"{what}: {value!r} has no unit; write it with one, e.g. {examples}")
        return number
    try:
        stem_kind, factor = _split_unit(unit)
    except KeyError:
        raise UserError(f"{what}: unknown unit {unit!r} in {value!r}; e.g. {examples}") from None
    if per_s:
        stem_kind = {"bytes": "bytes_per_s", "flop": "flop_per_s"}.get(stem_kind, "invalid")
    if stem_kind != kind:
        raise UserError(f"{what}: {value!r} is not a {kind.replace('_', ' ')} quantity; e.g. {examples}")
    result = number * factor
    if not math.isfinite(result):
        raise UserError(f"{what}: {value!r} is not a finite quantity")
    return result


def fmt_quantity(v: float, kind: str) -> str:
    """A readable SI quantity of ``kind`` (for messages)."""
    if kind == "bytes":
        return fmt_bytes(v)
    if kind == "seconds":
        return fmt_seconds(v) if v > 0 else "0 s"
    unit = {"bytes_per_s": "B/s", "watts": "W", "hertz": "Hz"}.get(kind, "FLOP/s")
    for p, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= f:
            return f"{v / f:g} {p}{unit}"
    return f"{v:g} {unit}"


def fmt_bytes(n: float) -> str:
    for unit, f in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


_COUNT = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


_DURATION = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0,
             "y": 365 * 86400.0}


def parse_count(text: str, what: str) -> float:
    """``2T``, ``1.4e12``, ``300B``, ``10M``: a positive number with an optional K/M/B/T/P suffix."""
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKMBGTP]?)\s*", str(text))
    if not m:
        raise UserError(f"{what} {text!r}: expected a number with an optional suffix K, M, B, T or P (e.g. 2T)")
    v = float(m.group(1)) * _COUNT[m.group(2)]
    if not (math.isfinite(v) and v > 0):
        raise UserError(f"{what} {text!r}: must be a positive finite number")
    return v


def parse_duration(text: str, what: str, default_unit: str = "d", allow_zero: bool = False) -> float:
    """``60d``, ``8w``, ``1440h``, ``2min``, ``90s``, ``1.5y``; a bare number is in ``default_unit``.
    Seconds; positive, or zero too with ``allow_zero``."""
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*", str(text))
    if not m or (m.group(2) or default_unit) not in _DURATION:
        raise UserError(f"{what} {text!r}: expected a duration like 60d, 8w, 1440h, 10min or 90s "
                        f"(units: {', '.join(_DURATION)})")
    v = float(m.group(1)) * _DURATION[m.group(2) or default_unit]
    if not (math.isfinite(v) and (v > 0 or (allow_zero and v == 0))):
        want = "finite duration of 0 or more" if allow_zero else "positive finite duration"
        raise UserError(f"{what} {text!r}: must be a {want}")
    return v


def float_list(text: str, what: str) -> tuple:
    try:
        out = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise UserError(f"{what} {text!r}: expected numbers separated by commas, like 0.25,0.5,1,2") from None
    if not out or any(not (math.isfinite(x) and x > 0) for x in out):
        raise UserError(f"{what} {text!r}: every factor must be a positive number")
    return out


MIN_RATE_BIT_S, MAX_RATE_BIT_S = 1e6, 100e9
"""The link rates the testbed shapes (tc's tbf: 1 Mbit/s to 100 Gbit/s)."""
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(bit|Bit)(?:/s)?\s*$")


_RATE_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """A NIC rate in bits per second, from tc's spelling ("200mbit", "10gbit") or the cluster
    files' ("1 Gbit/s"); bytes per second ("mbps" means megabytes to tc) are refused as ambiguous."""
    m = _RATE_RE.match(str(text))
    if not m:
        raise UserError(f"rate {text!r}: expected bits per second, e.g. 200mbit, 10gbit or '1 Gbit/s'")
    v = float(m.group(1)) * _RATE_PREFIX[m.group(2).lower()]
    if not MIN_RATE_BIT_S <= v <= MAX_RATE_BIT_S:
        raise UserError(f"rate {text!r}: expected 1mbit to 100gbit")
    return v


def fmt_rate(bit_s: float) -> str:
    """'200 Mbit/s', '10 Gbit/s' (the cluster files' spelling)."""
    for div, unit in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bit_s >= div:
            return f"{bit_s / div:g} {unit}"
    return f"{bit_s:g} bit/s"
