"""A Responses request as the chat request the chat path already serves.

``input`` (a string: one user message; or items) becomes chat messages: messages by role
(``developer`` as ``system``), ``function_call`` items the tool calls of an assistant turn (the
one just before, or a new one), ``function_call_output`` items ``tool`` messages, a ``reasoning``
item the next assistant turn's ``reasoning_content``. ``previous_response_id`` puts the stored
conversation first; ``instructions`` are this request's own system message (never carried
over, as OpenAI's). Tools, ``tool_choice``, ``text.format`` and sampling map to their chat fields.
Hosted tools (``web_search``, ...) are left out of the tools the model sees: the server does not
run them, and agent clients list them whatever the task; a ``namespace`` gives its functions.
A user message's ``input_image`` parts become the chat path's ``image_url`` parts (a text
model's refusal, the limits and the decoding are its). Refused naming the field: hosted tools'
items, files, audio, a call's output whose call is in no earlier item, and ``background``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pydantic import ValidationError

from pagellm.entrypoints.openai.errors import BadRequestError
from pagellm.entrypoints.openai.protocol import TEXT_CHECKED, ChatCompletionRequest
from pagellm.entrypoints.openai.responses.protocol import (
    FunctionCallItem,
    FunctionTool,
    FunctionCallOutputItem,
    InputMedia,
    InputText,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)


def conversation_of(request: ResponsesRequest, previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of ``previous`` (a stored conversation) then of ``request.input``."""
    messages = [dict(m) for m in previous]
    calls = {c["id"] for m in previous for c in m.get("tool_calls") or ()}
    if isinstance(request.input, str):
        return [*messages, {"role": "user", "content": request.input}]
    thinking: str | None = None
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message: dict[str, Any] = {"role": role, "content": _content(item, where)}
            if role == "assistant" and thinking is not None:
                message["reasoning_content"], thinking = thinking, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            turn = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
            if turn is None:
                turn = {"role": "assistant", "content": None}
                if thinking is not None:
                    turn["reasoning_content"], thinking = thinking, None
                messages.append(turn)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            turn["tool_calls"] = [*(turn.get("tool_calls") or []), call]
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise BadRequestError(f"{where}: function_call_output answers call_id {item.call_id!r}, which no "
                                      "earlier function_call item has", param=f"{where}.call_id")  # fmt: skip
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        elif isinstance(item, ReasoningItem):
            thinking = item.text
        else:
            raise BadRequestError(f"{where}: {item.type} items are not supported (hosted tools and item references "
                                  "are not served here)", param=f"{where}.type")  # fmt: skip
    return messages


def _content(item: MessageItem, where: str) -> str | list[dict[str, Any]]:
    """A message's chat content: its text, or (a user turn with images) its text and
    ``image_url`` parts in order; files, audio and images by file id are refused."""
    if isinstance(item.content, str) or not any(isinstance(p, InputMedia) for p in item.content):
        return item.text
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(item.content):
        if isinstance(part, InputMedia):
            if part.type != "input_image" or part.image_url is None or item.role != "user":
                raise BadRequestError(f"{where}.content[{j}]: {part.type} is not supported here (images: in a user "
                                      "message, by image_url)", param=f"{where}.content[{j}]")  # fmt: skip
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            parts.append({"type": "text", "text": part.text if isinstance(part, InputText) else part.refusal})
    return parts


def to_chat_request(request: ResponsesRequest, model: str, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request serving ``request`` over ``conversation`` (``conversation_of``)."""
    if request.background:
        raise BadRequestError("background responses are not supported: send the request without background",
                              param="background")  # fmt: skip
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {
        "model": model, "messages": [*system, *conversation], "max_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "parallel_tool_calls": request.parallel_tool_calls,
        **_tools(request), **_format(request),
    }  # fmt: skip
    if request.structured_outputs is not None:
        body["structured_outputs"] = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    try:  # every string was checked when the Responses request was parsed
        return ChatCompletionRequest.model_validate(body, context={TEXT_CHECKED: True})
    except ValidationError as exc:
        raise BadRequestError(f"the request cannot be served: {exc.errors(include_url=False)[0]['msg']}") from None


def _tools(request: ResponsesRequest) -> dict[str, Any]:
    """The function tools as chat tools: a namespace's functions among them, hosted tools left out
    (agent clients list them whatever the task: Codex CLI always offers ``web_search``; the model
    is told only of the tools its caller runs)."""
    fields: dict[str, Any] = {}
    functions = []
    for i, tool in enumerate(request.tools or []):
        if tool.type == "namespace":
            functions.extend(_function(inner, f"tools[{i}].tools[{j}]") for j, inner in enumerate(tool.tools or []))
        elif tool.type == "function":
            functions.append(_function(tool, f"tools[{i}]"))
    repeated = sorted(n for n, count in Counter(f["function"]["name"] for f in functions).items() if count > 1)
    if repeated:
        raise BadRequestError(f"tools name the function {repeated[0]!r} more than once (namespaces included)",
                              param="tools")  # fmt: skip
    if functions:
        fields["tools"] = functions
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
    return fields


def _function(tool: FunctionTool, where: str) -> dict[str, Any]:
    """One function tool as a chat tool (a namespace holds function tools only)."""
    if tool.type != "function":
        raise BadRequestError(f"{where} is a {tool.type!r} tool: a namespace holds function tools",
                              param=f"{where}.type")  # fmt: skip
    if tool.name is None:
        raise BadRequestError(f"{where} needs a name", param=f"{where}.name")
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}  # fmt: skip


def _format(request: ResponsesRequest) -> dict[str, Any]:
    """``text.format`` as the chat path's ``response_format``."""
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.json_schema is None:
        raise BadRequestError("text.format of type json_schema needs a schema", param="text.format.schema")
    schema = {"name": fmt.name or "output", "schema": fmt.json_schema, "strict": fmt.strict}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}
