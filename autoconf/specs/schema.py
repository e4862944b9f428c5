"""Strict input schemas: every file autoconf reads is checked here before anything uses it.

DESIGN. One small declarative vocabulary (``Int``, ``Num``, ``Bool``, ``Str``, ``Quantity``,
``Null``, ``List``, ``Map``, ``Dict``, ``Opaque``), each a callable ``spec(value, path)`` that returns
the checked value or raises :class:`UserError` naming the path (``node_groups[0].nics.bandwidth``)
and what would be valid. The file kinds (model YAML / JSON, Hugging Face config.json, cluster
YAML, profile JSON, calibration JSON, the launch plan's config.json) are ``Dict`` specs next to the
loaders that use them. A frozen dataclass whose fields are a file's keys declares each field once,
with its spec (:func:`checked`), and :func:`schema_of` derives the ``Dict`` from the fields.

The rules, for every kind:

- unknown keys are refused at every depth, with a did-you-mean (difflib);
- exact types: no string for a number or a bool, no bool for a count, no float for an integer;
- numbers are finite and in a stated range; a bandwidth, latency or memory size written by a
  person needs its unit ("300 GB/s", "2 us", "80 GiB"): a bare number is refused;
- sizes are bounded: the file's bytes (:func:`read_text`), YAML aliases (the expanded node
  count is computed on the composed graph, *before* construction, so an alias bomb costs nothing),
  nesting depth, list lengths and string lengths;
- a file of another kind is named as such (:func:`check_kind`): "x.json looks like a profile,
  not a calibration file".

This was chosen over pydantic: the project's dependencies are fixed (optuna, numpy, networkx,
rich, pyyaml), and the vocabulary plus the file readers is ~400 lines, with messages written for
the CLI's one line on stderr. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os

from autoconf.errors import UserError
from autoconf.files import read_input
from autoconf.specs.units import fmt_quantity, parse_quantity

MAX_TEXT_BYTES = 1 << 20          # model, cluster and calibration files
MAX_STR = 4096                    # characters in any string value
MAX_YAML_NODES = 100_000          # nodes of a YAML document once its aliases are expanded


def show_value(value, limit: int = 60) -> str:
    """repr() cut to ``limit`` characters, for one-line messages."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - a repr must never turn an error into a traceback
        r = f"<{type(value).__name__}>"
    r = r.replace("\n", "\\n")
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _type_name(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "null"}.get(type(value), type(value).__name__)


def _at(path: str) -> str:
    return f"{path}: " if path else ""


def _val(path: str, value) -> str:
    """'path=value' (or the value alone at the top)."""
    return f"{path}={show_value(value)}" if path else show_value(value)


class Spec:
    """A check of one value; ``__call__(value, path)`` returns the checked value."""

    def __call__(self, value, path: str = ""):
        raise NotImplementedError

    def fail(self, value, path: str, what: str):
        raise UserError(f"{_val(path, value)} is {_type_name(value)}; expected {what}")


class Int(Spec):
    """An integer (not a bool, not a float, not a string) in [lo, hi]."""

    def __init__(self, lo: int = 0, hi: int = 2**31):
        self.lo, self.hi = lo, hi

    def __call__(self, value, path=""):
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(value, path, f"an integer in [{self.lo}, {self.hi}]")
        if not self.lo <= value <= self.hi:
            raise UserError(f"{_val(path, value)} is out of range; expected an integer in [{self.lo}, {self.hi}]")
        return value


class Num(Spec):
    """A finite number (int or float, not bool) in [lo, hi]; ``lo_open`` excludes lo."""

    def __init__(self, lo: float = 0.0, hi: float = 1e30, lo_open: bool = False, hi_open: bool = False):
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open

    def _range(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def __call__(self, value, path=""):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(value, path, f"a number in {self._range()}")
        try:
            v = float(value)
        except OverflowError:  # an integer beyond any float
            raise UserError(f"{_val(path, value)} is out of range; expected a number in {self._range()}") from None
        if not math.isfinite(v):
            raise UserError(f"{_val(path, value)} is not a finite number; expected a number in {self._range()}")
        if v < self.lo or v > self.hi or (self.lo_open and v == self.lo) or (self.hi_open and v == self.hi):
            raise UserError(f"{_val(path, value)} is out of range; expected a number in {self._range()}")
        return v


class Bool(Spec):
    """true or false; not "false", not 0 or 1."""

    def __call__(self, value, path=""):
        if not isinstance(value, bool):
            self.fail(value, path, "true or false")
        return value


class Str(Spec):
    """A string, optionally one of ``choices``."""

    def __init__(self, choices=None, max_len: int = MAX_STR, nonempty: bool = False):
        self.choices, self.max_len, self.nonempty = tuple(choices) if choices else None, max_len, nonempty

    def __call__(self, value, path=""):
        if not isinstance(value, str):
            self.fail(value, path, "one of " + ", ".join(self.choices) if self.choices else "a string")
        if self.choices is not None and value not in self.choices:
            raise UserError(f"{_val(path, value)} is not valid{_did_you_mean(value, self.choices)}; "
                            f"valid: {', '.join(self.choices)}")
        if len(value) > self.max_len:
            raise UserError(f"{_at(path)}a string of {len(value)} characters; at most {self.max_len}")
        if self.nonempty and not value.strip():
            raise UserError(f"{_at(path)}must not be empty")
        return value


class Quantity(Spec):
    """A string with a unit, e.g. "300 GB/s", converted to SI and checked against [lo, hi]."""

    EXAMPLES = {"bytes": "80 GiB", "seconds": "2 us", "bytes_per_s": "300 GB/s", "flop_per_s": "989 TFLOP/s",
                "watts": "500 W", "hertz": "1410 MHz"}

    def __init__(self, kind: str, lo: float, hi: float, lo_open: bool = False):
        self.kind, self.lo, self.hi, self.lo_open = kind, lo, hi, lo_open

    def __call__(self, value, path=""):

        eg = self.EXAMPLES[self.kind]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise UserError(f"{_val(path, value)} has no unit; write it with one, e.g. \"{eg}\"")
        if not isinstance(value, str):
            self.fail(value, path, f"a quantity with a unit, e.g. \"{eg}\"")
        if len(value) > 64:
            raise UserError(f"{_val(path, value)} is too long for a quantity; e.g. \"{eg}\"")
        v = parse_quantity(value, self.kind, path or "value", unit_required=True)
        if v < self.lo or v > self.hi or (self.lo_open and v == self.lo):
            raise UserError(f"{_val(path, value)} is out of range; expected "
                            f"{'more than' if self.lo_open else 'at least'} {fmt_quantity(self.lo, self.kind)} "
                            f"and at most {fmt_quantity(self.hi, self.kind)}")
        return v


class Null(Spec):
    """``inner`` or null (None)."""

    def __init__(self, inner: Spec):
        self.inner = inner

    def __call__(self, value, path=""):
        return None if value is None else self.inner(value, path)


class List(Spec):
    """A list of ``item`` with min_len <= length <= max_len."""

    def __init__(self, item: Spec, min_len: int = 0, max_len: int = 1 << 20):
        self.item, self.min_len, self.max_len = item, min_len, max_len

    def __call__(self, value, path=""):
        if not isinstance(value, (list, tuple)):
            self.fail(value, path, "a list")
        if not self.min_len <= len(value) <= self.max_len:
            raise UserError(f"{_at(path)}a list of {len(value)} entries; expected "
                            f"{self.min_len} to {self.max_len}")
        return [self.item(v, f"{path}[{i}]") for i, v in enumerate(value)]


class Map(Spec):
    """A mapping from string keys to ``value`` (free keys, e.g. 'layer/mbs/tp' -> bytes)."""

    def __init__(self, value: Spec, max_len: int = 1 << 16):
        self.value, self.max_len = value, max_len

    def __call__(self, value, path=""):
        if not isinstance(value, dict):
            self.fail(value, path, "a mapping")
        if len(value) > self.max_len:
            raise UserError(f"{_at(path)}{len(value)} entries; at most {self.max_len}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or len(k) > 256:
                raise UserError(f"{_at(path)}key {show_value(k)} must be a short string")
            out[k] = self.value(v, f"{path}.{k}" if path else k)
        return out


class Dict(Spec):
    """A mapping with known keys: ``required`` and ``optional`` map key -> Spec.

    Unknown keys are refused with a did-you-mean; the result holds only the keys given (callers
    apply defaults). ``what`` describes the mapping in messages ("a node group").
    """

    def __init__(self, required: dict | None = None, optional: dict | None = None, what: str = "a mapping"):
        self.required, self.optional, self.what = dict(required or {}), dict(optional or {}), what

    @property
    def keys(self) -> list[str]:
        return list(self.required) + list(self.optional)

    def __call__(self, value, path=""):
        if not isinstance(value, dict):
            self.fail(value, path, f"{self.what} with keys {', '.join(self.keys)}")
        for k in value:
            if not isinstance(k, str):
                raise UserError(f"{_at(path)}key {show_value(k)} is {_type_name(k)}; keys are names such as "
                                f"{', '.join(self.keys[:4])}")
        unknown = [k for k in value if k not in self.required and k not in self.optional]
        if unknown:
            k = unknown[0]
            raise UserError(f"{_at(path)}unknown key {show_value(k)}{_did_you_mean(k, self.keys)}; "
                            f"valid: {', '.join(self.keys)}")
        missing = [k for k in self.required if k not in value]
        if missing:
            raise UserError(f"{_at(path)}missing {', '.join(missing)}")
        out = {}
        for k, v in value.items():
            spec = self.required.get(k) or self.optional[k]
            out[k] = spec(v, f"{path}.{k}" if path else k)
        return out


class Opaque(Spec):
    """Any JSON value, checked only for being JSON data (e.g. a stored estimate nobody reads back)."""

    def __call__(self, value, path=""):
        return value


def _did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -- schemas from dataclasses ----------------------------------------------------------------------

def checked(spec: Spec, default=dataclasses.MISSING, **kw):
    """A dataclass field whose file form ``spec`` checks (:func:`schema_of`); without a default
    (or ``default_factory``, passed through with the other ``dataclasses.field`` arguments) the
    key is required."""
    return dataclasses.field(default=default, metadata={"schema": spec}, **kw)


def schema_of(cls, what: str, order: tuple = (), **extra: Spec) -> Dict:
    """The :class:`Dict` spec of ``cls``'s file form, from its fields' :func:`checked` specs.

    A field without a default is required, one with a default optional; a field that is not an
    ``__init__`` argument is not in the file form. ``extra``: optional keys of the file form that
    are not fields. Messages list the required keys in declaration order, then the optional keys
    named in ``order`` in that order, then the others in declaration order. A field without a
    spec, an ``extra`` key that is a field, or an ``order`` name that is no optional key is a
    programming error: TypeError, at import.
    """
    required, optional = {}, {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        spec = f.metadata.get("schema")
        if not isinstance(spec, Spec):
            raise TypeError(f"{cls.__name__}.{f.name} has no schema: declare it with checked(spec)")
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        (optional if has_default else required)[f.name] = spec
    for k, spec in extra.items():
        if k in required or k in optional or not isinstance(spec, Spec):
            raise TypeError(f"{cls.__name__}: extra key {k!r} must be a Spec and not a field")
        optional[k] = spec
    wrong = [k for k in order if k not in optional]
    if wrong or len(set(order)) != len(order):
        raise TypeError(f"{cls.__name__}: order names {wrong or 'a key twice'}; it lists optional keys once")
    optional = {k: optional[k] for k in (*order, *optional)}
    return Dict(required=required, optional=optional, what=what)


def defaults_of(cls, names) -> dict:
    """name -> default of each of ``cls``'s fields ``names`` (TypeError for a field without one)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for k in names:
        f = fields.get(k)
        if f is None or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
            raise TypeError(f"{cls.__name__}.{k} is no field with a default")
        out[k] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


# -- reading files ----------------------------------------------------------------------------------

def read_text(path: str, what: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The file's text; UserError if missing, not a regular file (a FIFO, a device, a directory,
    a symlink loop: :func:`autoconf.files.read_input`), unreadable, too large or binary."""
    data = read_input(path, what, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{what} {path!r} is binary data, not UTF-8 text") from None
    if "\x00" in text:
        raise UserError(f"{what} {path!r} is binary data (it holds NUL bytes), not a text file")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text


def parse_json(text: str, path: str, what: str, expected: tuple = ()):
    """JSON text -> data; NaN and Infinity are read (the schemas refuse them with the key's name).

    With ``expected`` (kind names), a file that is not JSON but YAML of another kind says so.
    """
    try:
        return json.loads(text, object_pairs_hook=_json_object)
    except UserError as e:
        raise UserError(f"{what} {path!r}: {e}") from None
    except json.JSONDecodeError as e:
        if expected:
            try:
                other = parse_yaml(text, path, what)
            except UserError:
                other = None
            check_kind(other, path, expected)
        raise UserError(f"{what} {path!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except RecursionError:
        raise UserError(f"{what} {path!r} is nested too deeply to be a {what}") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise UserError(f"{what} {path!r} is not valid JSON: {_why(e)}") from None


def _why(e: Exception) -> str:
    text = " ".join(str(e).split())
    return "a number with thousands of digits" if "digits" in text else text[:120]


def parse_yaml(text: str, path: str, what: str = "file"):
    """YAML text -> data with the safe loader; alias bombs and deep nesting refused before construction."""
    import yaml

    loader = None
    try:
        loader = _bounded_loader()(text)
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        problem = " ".join(str(problem).split())[:160]
        raise UserError(f"{what} {path!r} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise UserError(f"{what} {path!r} is nested too deeply to be a {what}") from None
    except UserError as e:
        raise UserError(f"{what} {path!r}: {e}") from None
    except (ValueError, OverflowError) as e:  # e.g. an integer with more digits than Python converts
        raise UserError(f"{what} {path!r} holds a value YAML cannot convert: {_why(e)}") from None
    finally:
        if loader is not None:
            loader.dispose()


_LOADER = None


def _bounded_loader():
    """A yaml.SafeLoader that measures the composed document before constructing it."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        def get_single_data(self):
            node = self.get_single_node()
            if node is None:
                return None
            n = _expanded_size(node, {}, set())
            if n > MAX_YAML_NODES:
                raise UserError(f"the document expands to {n:,} nodes through its aliases (at most "
                                f"{MAX_YAML_NODES:,}): refused as an alias bomb")
            return self.construct_document(node)

    _LOADER = BoundedSafeLoader
    return _LOADER


def _no_duplicate_keys(items) -> None:
    """A YAML mapping's (key node, value node) pairs name each plain key once: a key written twice
    would silently keep its last value."""
    seen: dict = {}
    for item in items:
        if not isinstance(item, tuple) or not isinstance(item[0].value, str) or item[0].value == "<<":
            continue
        k = item[0].value
        if k in seen:
            raise UserError(f"key {k!r} appears twice (lines {seen[k]} and {item[0].start_mark.line + 1}); "
                            "give it once")
        seen[k] = item[0].start_mark.line + 1


def _json_object(pairs):
    """``json.loads``'s object hook: a key written twice is refused, not silently the last one."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise UserError(f"key {k!r} appears twice in one object; give it once")
        out[k] = v
    return out


def _expanded_size(node, memo: dict, active: set) -> int:
    """Nodes of the document with every alias expanded, counted on the shared graph (linear time)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise UserError("a YAML alias refers to a node that contains it (a recursive document)")
    value = node.value
    if isinstance(value, list):
        _no_duplicate_keys(value)
        active.add(key)
        n = 1
        for item in value:
            if isinstance(item, tuple):  # mapping: (key node, value node)
                n += _expanded_size(item[0], memo, active) + _expanded_size(item[1], memo, active)
            else:
                n += _expanded_size(item, memo, active)
        active.discard(key)
    else:
        n = 1
    memo[key] = n
    return n


# -- file kinds -----------------------------------------------------------------------------------

KIND_NAMES = {"model": "a model file", "hf": "a Hugging Face config.json", "cluster": "a cluster file",
              "profile": "a profile", "calibration": "a calibration file", "plan": "a launch plan (config.json)"}


def guess_kind(data) -> str | None:
    """Which of autoconf's file kinds ``data`` looks like, from its signature keys (or None)."""
    if not isinstance(data, dict):
        return None
    keys = set(data)
    if "provenance" in keys or {"ranks", "compute_dtype"} <= keys:
        return "profile"
    if "factors" in keys:
        return "calibration"
    if {"model", "config"} <= keys:
        return "plan"
    if "node_groups" in keys:
        return "cluster"
    if "num_layers" in keys and "hidden_size" in keys:
        return "model"
    if keys & {"model_type", "architectures", "num_hidden_layers", "n_layer", "n_embd"}:
        return "hf"
    return None


def check_kind(data, path: str, expected: tuple) -> None:
    """Refuse a file that is recognisably another kind than ``expected`` (kind names above)."""
    got = guess_kind(data)
    if got is not None and got not in expected:
        raise UserError(f"{os.path.basename(path)} looks like {KIND_NAMES[got]}, not "
                        f"{KIND_NAMES[expected[0]]} ({path!r})")


def load_yaml(path: str, what: str = "file"):
    """A YAML file's data: size-bounded, text only, aliases bounded (see :mod:`autoconf.specs.schema`)."""
    return parse_yaml(read_text(path, what), path, what)
