"""Schemas derived from dataclass fields (``specs.schema.checked`` / ``schema_of`` / ``defaults_of``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from autoconf.errors import UserError
from autoconf.space.config import COMPRESSION_FIELDS, CONFIG_SCHEMA, DEFAULTED_FIELDS, ParallelConfig
from autoconf.specs.cluster import SI_CLUSTER_SCHEMA, SI_GROUP_SCHEMA, ClusterSpec, NodeGroup
from autoconf.specs.model import LATER_FIELDS, LIMITS, MODEL_SCHEMA, ModelSpec
from autoconf.specs.schema import Bool, Int, Str, checked, defaults_of, schema_of


@dataclass(frozen=True)
class Point:
    x: int = checked(Int(0, 9))
    """A required coordinate."""
    label: str = checked(Str(max_len=8), "p")
    tags: tuple = checked(Str(), default_factory=tuple)
    cache: dict = dataclasses.field(default_factory=dict, init=False)


def test_a_field_without_a_default_is_required_one_with_a_default_optional():
    schema = schema_of(Point, "a point")
    assert list(schema.required) == ["x"]
    assert list(schema.optional) == ["label", "tags"]  # cache is not an __init__ argument
    assert schema.what == "a point"
    assert schema({"x": 3}) == {"x": 3}
    with pytest.raises(UserError, match="missing x"):
        schema({"label": "a"})
    with pytest.raises(UserError, match=r"x=10 is out of range; expected an integer in \[0, 9\]"):
        schema({"x": 10})


def test_unknown_keys_are_refused_with_a_did_you_mean():
    schema = schema_of(Point, "a point")
    with pytest.raises(UserError, match=r"unknown key 'lable' \(did you mean 'label'\?\); valid: x, label, tags"):
        schema({"x": 1, "lable": "a"})


def test_extra_keys_and_the_listing_order():
    schema = schema_of(Point, "a point", order=("tags",), flag=Bool())
    assert list(schema.required) == ["x"]
    assert list(schema.optional) == ["tags", "label", "flag"]
    assert schema({"x": 1, "flag": True}) == {"x": 1, "flag": True}
    with pytest.raises(TypeError, match="order names"):
        schema_of(Point, "a point", order=("nope",))
    with pytest.raises(TypeError, match="order names"):
        schema_of(Point, "a point", order=("tags", "tags"))
    with pytest.raises(TypeError, match="not a field"):
        schema_of(Point, "a point", label=Str())


def test_a_field_without_a_schema_is_refused():
    @dataclass(frozen=True)
    class Bare:
        x: int = checked(Int())
        y: int = 0

    with pytest.raises(TypeError, match=r"Bare\.y has no schema"):
        schema_of(Bare, "a bare thing")


def test_defaults_of_reads_the_fields():
    assert defaults_of(Point, ("label", "tags")) == {"label": "p", "tags": ()}
    with pytest.raises(TypeError, match="no field with a default"):
        defaults_of(Point, ("x",))
    with pytest.raises(TypeError, match="no field with a default"):
        defaults_of(Point, ("nope",))


@pytest.mark.parametrize("cls, schema", [(ModelSpec, MODEL_SCHEMA), (ParallelConfig, CONFIG_SCHEMA),
                                         (NodeGroup, SI_GROUP_SCHEMA), (ClusterSpec, SI_CLUSTER_SCHEMA)])
def test_the_file_schemas_keys_are_the_dataclasses_fields(cls, schema):
    fields = [f for f in dataclasses.fields(cls) if f.init]
    assert set(schema.keys) == {f.name for f in fields}
    assert set(schema.required) == {f.name for f in fields
                                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def test_the_derived_tables_hold_the_fields_defaults_and_ranges():
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    assert all(LATER_FIELDS[k] == defaults[k] for k in LATER_FIELDS)
    assert LIMITS["num_layers"] == (1, 4096) and set(LIMITS) == set(MODEL_SCHEMA.required)
    defaults = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    assert {**COMPRESSION_FIELDS, **DEFAULTED_FIELDS} == {k: defaults[k] for k in {**COMPRESSION_FIELDS,
                                                                                   **DEFAULTED_FIELDS}}
