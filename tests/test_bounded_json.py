"""The bounded JSON parse every JSON value from outside goes through (pagellm.bounded_json)."""

from __future__ import annotations

import pytest

from pagellm.bounded_json import MAX_JSON_DEPTH, check_json_depth, parse_json_text


def test_parses_what_is_within_bounds() -> None:
    assert parse_json_text('{"a": [1, 2, {"b": null}]}', "x") == {"a": [1, 2, {"b": None}]}
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json_text(at_limit, "x") is not None
    assert parse_json_text('"text"', "x") == "text"


@pytest.mark.parametrize(("text", "words"), [
    ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "nested deeper than 128 levels"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than 128 levels"),  # past the parser's own recursion limit
    ("{oops", "is not valid JSON"),
    ("1" * 5000, "is not valid JSON"),  # an integer past Python's digit limit
    ("[" + "1," * 600_000 + "1]", "characters long"),
])
def test_refuses_with_a_value_error_naming_the_field(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=f"^the field .*{words}"):
        parse_json_text(text, "the field")


def test_depth_of_parsed_values() -> None:
    value: object = 1
    for _ in range(MAX_JSON_DEPTH):
        value = [value]
    check_json_depth(value, "v")  # scalars do not count as a level
    with pytest.raises(ValueError, match="v is nested deeper"):
        check_json_depth([value], "v")
    check_json_depth(["x"] * 1_000_000, "long but flat")
    check_json_depth("a string", "scalar")


def test_count_of_objects_and_arrays() -> None:
    value = {"a": [{"b": 1}, {"c": [1, 2]}], "d": "text"}  # the root, a list, two dicts, a list: 5
    check_json_depth(value, "body", max_containers=5)
    with pytest.raises(ValueError, match="body holds more than 4 JSON objects and arrays"):
        check_json_depth(value, "body", max_containers=4)
    check_json_depth(["x"] * 10_000, "body", max_containers=1)  # scalars are not counted
