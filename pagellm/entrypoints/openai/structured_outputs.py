"""The request fields that constrain an output, as one ``StructuredOutputsParams``.

Clients spell a constraint three ways: OpenAI's ``response_format``, vLLM's
``structured_outputs`` object, and vLLM's older ``guided_*`` fields. A request may use one of
them; a constraint that does not compile is a 400 naming the field it came from.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pagellm.entrypoints.openai.errors import BadRequestError
from pagellm.entrypoints.openai.protocol import SamplingRequest
from pagellm.structured_outputs_params import StructuredOutputsParams

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs_of(
    request: SamplingRequest, tool_constraint: StructuredOutputsParams | None = None, thinking: str | None = None
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint (None: free text) and the field it came in; a 400 when its
    fields are malformed. Whether it compiles is the engine's check (``check_params``): a
    failure there is reported under that field (:func:`constraint_error`).
    ``tool_constraint`` is the grammar a forced tool choice asks for (field ``tool_choice``);
    ``thinking``: the constraint applies after a reasoning model's thinking (``THINKING_MODES``)."""
    sources = _given_sources(request) + (["tool_choice"] if tool_constraint is not None else [])
    if not sources:
        return None, None
    if len(sources) > 1:
        raise BadRequestError(
            f"give one output constraint, not several: {', '.join(sources)}", param=sources[1]
        )
    param = sources[0]
    try:
        params = tool_constraint if tool_constraint is not None else StructuredOutputsParams(**_fields(request, param))
        if thinking is not None:
            params = replace(params, thinking=thinking)
    except ValueError as exc:
        raise constraint_error(exc, param) from exc
    return params, param


def constraint_error(error: ValueError, param: str) -> BadRequestError:
    """A constraint's fault, named by the request field the constraint came in."""
    return BadRequestError(f"{param}: {error}", param=param)


def _given_sources(request: SamplingRequest) -> list[str]:
    sources = []
    if request.response_format is not None and request.response_format.type != "text":
        sources.append("response_format")
    if request.structured_outputs is not None:
        sources.append("structured_outputs")
    sources.extend(name for name in _GUIDED if getattr(request, name) is not None)
    return sources


def _fields(request: SamplingRequest, param: str) -> dict[str, Any]:
    """``StructuredOutputsParams`` keywords from the field the constraint came in."""
    if param == "response_format":
        response_format = request.response_format
        assert response_format is not None
        if response_format.type == "json_object":
            return {"json_object": True}
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise ValueError("a json_schema response format needs json_schema.schema")
        return {"json": spec.json_schema}
    if param == "structured_outputs":
        so = request.structured_outputs
        assert so is not None
        return {
            "json": so.json_, "json_object": so.json_object, "regex": so.regex, "choice": so.choice,
            "grammar": so.grammar, "whitespace_pattern": so.whitespace_pattern,
            "disable_any_whitespace": so.disable_any_whitespace,
        }  # fmt: skip
    kind = param.removeprefix("guided_")
    return {kind: getattr(request, param), "whitespace_pattern": request.guided_whitespace_pattern}


# ``--structured-outputs-config``: vLLM's keys that apply to this server.
STRUCTURED_OUTPUTS_CONFIG_KEYS = ("enable_in_reasoning",)


def enable_in_reasoning(config: str | None) -> bool:
    """``--structured-outputs-config``'s ``enable_in_reasoning`` (vLLM's): constraints apply from
    the answer's first token, thinking included, instead of after the thinking (false, the
    default, with a ``--reasoning-parser``). ValueError naming what is wrong."""
    if config is None:
        return False
    try:
        value = json.loads(config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--structured-outputs-config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--structured-outputs-config must be a JSON object")
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--structured-outputs-config keys {unknown} are not supported; supported: "
                         f"{', '.join(STRUCTURED_OUTPUTS_CONFIG_KEYS)}")  # fmt: skip
    enabled = value.get("enable_in_reasoning", False)
    if not isinstance(enabled, bool):
        raise ValueError("--structured-outputs-config enable_in_reasoning must be true or false")
    return enabled
