"""StructuredOutputsParams and SamplingParams.structured_outputs: exactly one kind, clear errors."""
from __future__ import annotations

import pytest

from peregrine.sampling_params import SamplingParams
from peregrine.structured_output import StructuredOutputsParams

_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs, kind", [
    ({"json": _SCHEMA}, "json"), ({"json": '{"type": "string"}'}, "json"),
    ({"json_object": True}, "json_object"), ({"regex": "[a-z]+"}, "regex"),
    ({"choice": ["yes", "no"]}, "choice"), ({"grammar": 'root ::= "a"'}, "grammar")])
def test_each_kind_is_accepted(kwargs, kind):
    so = StructuredOutputsParams(**kwargs)
    assert so.kind == kind
    assert SamplingParams(structured_outputs=so).structured_outputs is so


@pytest.mark.parametrize("kwargs", [{}, {"json_object": False}, {"regex": "a", "choice": ["a"]},
                                    {"json": _SCHEMA, "json_object": True}])
def test_exactly_one_kind_is_required(kwargs):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"json": "{not json"}, "structured_outputs.json"), ({"json": [1, 2]}, "structured_outputs.json"),
    ({"json": "3"}, "structured_outputs.json"), ({"regex": ""}, "structured_outputs.regex"),
    ({"regex": 5}, "structured_outputs.regex"), ({"grammar": ""}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"), ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"), ({"json_object": 1}, "structured_outputs.json_object")])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_rejects_other_types_and_min_tokens():
    with pytest.raises(ValueError, match="^structured_outputs "):
        SamplingParams(structured_outputs={"json": _SCHEMA})
    with pytest.raises(ValueError, match="^min_tokens "):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_cache_key_is_canonical():
    a = StructuredOutputsParams(json={"b": 1, "a": {"y": 2, "x": 1}})
    b = StructuredOutputsParams(json='{"a": {"x": 1, "y": 2},  "b": 1}')
    assert a.cache_key() == b.cache_key() == ("json", '{"a":{"x":1,"y":2},"b":1}')
    assert StructuredOutputsParams(choice=["a", "b"]).cache_key() != \
        StructuredOutputsParams(choice=["b", "a"]).cache_key()


def test_clone_keeps_the_field():
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=("x", "y")))
    assert p.clone().structured_outputs == p.structured_outputs
    assert p.structured_outputs.choice == ["x", "y"]
