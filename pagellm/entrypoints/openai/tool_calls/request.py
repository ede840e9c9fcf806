"""What a chat request's ``tools`` and ``tool_choice`` ask of the server, checked once.

- ``"none"`` (or no tools): no calls; earlier calls in the history are still rendered.
- ``"auto"`` (the default with tools): the model decides; calls are parsed out of its text.
- ``"required"``, or a named function: a grammar makes the model write a valid call (one, or
  several with ``parallel_tool_calls``) to one of the allowed tools, with arguments that match
  the function's schema (an empty schema allows ``{}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.errors import BadRequestError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from pagellm.entrypoints.openai.tool_calls.parsers import ToolParser
from pagellm.structured_outputs_params import StructuredOutputsParams


# OpenAI's own limit on the tools of one request.
MAX_TOOLS = 128


@dataclass
class ToolPlan:
    functions: list[dict[str, Any]]  # the tools shown to the model (OpenAI function objects)
    parser: ToolParser | None  # None: the answer is plain text
    constraint: StructuredOutputsParams | None  # set for "required" and a named function


def plan_tools(request: ChatCompletionRequest, parser: ToolParser, auto_enabled: bool) -> ToolPlan:
    """The request's tool plan; a 400 naming the field for a choice that cannot work."""
    tools = request.tools or []
    choice = request.tool_choice
    if len(tools) > MAX_TOOLS:
        raise BadRequestError(f"tools holds {len(tools)} tools, more than the {MAX_TOOLS} allowed", param="tools")
    if not tools:
        if choice not in (None, "none"):
            raise BadRequestError("tool_choice needs tools", param="tool_choice")
        return ToolPlan([], None, None)
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise BadRequestError("tools must have distinct function names", param="tools")
    if choice == "none":
        return ToolPlan([], None, None)
    if choice in (None, "auto"):
        if not auto_enabled:
            raise BadRequestError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice', param="tool_choice"
            )
        return ToolPlan(functions, parser, None)
    allowed = functions
    if isinstance(choice, NamedToolChoice):
        allowed = [f for f in functions if f["name"] == choice.function.name]
        if not allowed:
            raise BadRequestError(f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice")
    grammar = parser.grammar(allowed, parallel=request.parallel_tool_calls and choice == "required")
    return ToolPlan(functions, parser, StructuredOutputsParams(grammar=grammar))
