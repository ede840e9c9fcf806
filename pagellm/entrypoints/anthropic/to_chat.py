"""An Anthropic Messages request as the chat request the OpenAI path already serves.

The conversation maps one to one: ``system`` is the system message; a user turn's text blocks
its content, its ``tool_result`` blocks ``tool`` messages (before its text, as the results answer
the previous turn's calls); an assistant turn's text its content, its ``tool_use`` blocks its
tool calls and its thinking blocks its ``reasoning_content``. Tools,
``tool_choice``, ``stop_sequences``, sampling, ``output_config.format`` (a JSON schema: the chat
path's ``response_format``) and ``thinking`` (as the template's ``enable_thinking``, which
Qwen3-style templates read) map to their chat fields. What cannot map
is refused naming the field: documents, server tools, a tool result whose call is not in an
earlier assistant turn, blocks in the wrong role's turn. A user turn's images become the chat
path's ``image_url`` parts (a text model's refusal, the limits and the decoding are its).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagellm.entrypoints.anthropic.protocol import (
    ImageBlock,
    MessageParam,
    MessagesRequest,
    MessagesRequestBase,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from pagellm.entrypoints.openai.errors import BadRequestError
from pagellm.entrypoints.openai.protocol import TEXT_CHECKED, ChatCompletionRequest

# Client tools may say so; anything else with a type is one of Anthropic's server tools.
CLIENT_TOOL_TYPES = (None, "custom")


def to_chat_request(request: MessagesRequestBase, model: str, max_tokens: int | None = None) -> ChatCompletionRequest:
    """The chat request serving ``request`` (``max_tokens``: count_tokens asks for none)."""
    body: dict[str, Any] = {"model": model, "messages": _messages(request), **_tools(request)}
    if isinstance(request, MessagesRequest):
        body.update(max_tokens=request.max_tokens, stop=request.stop_sequences, temperature=request.temperature,
                    top_p=request.top_p, top_k=request.top_k)  # fmt: skip
        if request.structured_outputs is not None:
            body["structured_outputs"] = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        output_format = request.output_config.format if request.output_config is not None else None
        if output_format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": output_format.json_schema}}  # fmt: skip
    elif max_tokens is not None:
        body["max_tokens"] = max_tokens
    if request.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": request.thinking.type == "enabled"}
    try:  # every string was checked when the Messages request was parsed
        return ChatCompletionRequest.model_validate(body, context={TEXT_CHECKED: True})
    except ValidationError as exc:
        raise BadRequestError(f"the request cannot be served: {exc.errors(include_url=False)[0]['msg']}") from None


def _messages(request: MessagesRequestBase) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = request.system_text
    if system:
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()  # the ids of the calls made so far
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant_turn(message, f"messages[{i}]", calls))
        else:
            messages.extend(_user_turn(message, f"messages[{i}]", calls))
    return messages


def _assistant_turn(message: MessageParam, where: str, calls: set[str]) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            tool_calls.append({"id": block.id, "type": "function",
                               "function": {"name": block.name, "arguments": arguments}})  # fmt: skip
        else:
            raise _refused(block, f"{where}.content[{j}]", "an assistant turn")
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if any(thinking):  # as reasoning_content: a template renders it or not (Qwen3's drops old turns')
        turn["reasoning_content"] = "\n".join(thinking)
    if tool_calls:
        turn["tool_calls"] = tool_calls
    return turn


def _user_turn(message: MessageParam, where: str, calls: set[str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # its text and images, in order
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock) and block.type == "image" and block.source is not None:
            parts.append({"type": "image_url", "image_url": {"url": block.source.data_url}})
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise BadRequestError(
                    f"{where}.content[{j}]: tool_result answers tool_use_id {block.tool_use_id!r}, which no earlier "
                    "assistant turn's tool_use block has", param=f"{where}.content[{j}].tool_use_id",
                )  # fmt: skip
            text = f"Error: {block.text}" if block.is_error else block.text
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        else:
            raise _refused(block, f"{where}.content[{j}]", "a user turn")
    if any(part["type"] == "image_url" for part in parts):
        return [*results, {"role": "user", "content": parts}]
    texts = [part["text"] for part in parts]
    return [*results, *([{"role": "user", "content": "\n".join(texts)}] if texts else [])]


def _refused(block: object, where: str, turn: str) -> BadRequestError:
    if isinstance(block, ImageBlock):
        return BadRequestError(f"{where}: {block.type} blocks are not supported here (images: in a user turn, with a "
                               "source)", param=where)  # fmt: skip
    kind = getattr(block, "type", type(block).__name__)
    return BadRequestError(f"{where}: a {kind} block does not belong in {turn}", param=where)


def _tools(request: MessagesRequestBase) -> dict[str, Any]:
    """The chat fields of ``tools`` and ``tool_choice``."""
    fields: dict[str, Any] = {}
    tools = request.tools or []
    for i, tool in enumerate(tools):
        if tool.type not in CLIENT_TOOL_TYPES:
            raise BadRequestError(
                f"tools[{i}] is the server tool {tool.type!r}, which this server does not run: define a client tool "
                "(name, description, input_schema) and run it yourself", param=f"tools[{i}].type",
            )  # fmt: skip
    if tools:
        fields["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in tools
        ]  # fmt: skip
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise BadRequestError('tool_choice of type "tool" needs a name', param="tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields
