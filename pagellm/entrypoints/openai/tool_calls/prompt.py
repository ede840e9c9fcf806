"""Tools in the prompt: given to a chat template that renders them, or written into the
conversation for one that ignores them (the default model's ChatML template does).

For a template that ignores tools, the tools and how to call them go at the end of the system
message (one is added when there is none), earlier calls are written into the assistant's
messages as the ``hermes`` parser reads them, and tool results become user messages holding a
``<tool_response>`` block, so that any model's own template renders the whole exchange.
"""

from __future__ import annotations

import json
from typing import Any

from pagellm.bounded_json import parse_json_text

TOOLS_PREAMBLE = (
    "You can call functions to help answer. Their signatures follow between <tools> and </tools>, one JSON "
    "object per line:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with one block per call, each "
    "holding a JSON object with the function's name and its arguments:\n<tool_call>\n"
    '{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>'
)
DEFAULT_SYSTEM = "You are a helpful assistant."


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template uses its ``tools`` variable (else they must be written in)."""
    return bool(template) and "tools" in template  # type: ignore[operator]


def calls_text(tool_calls: list[dict[str, Any]]) -> str:
    """Earlier calls as the model writes them (hermes blocks)."""
    blocks = []
    for call in tool_calls:
        function = call["function"]
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):  # OpenAI's wire form: JSON text
            arguments = parse_json_text(arguments, "tool call arguments")
        if not isinstance(arguments, dict):
            raise ValueError("tool call arguments must be a JSON object")
        body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(blocks)


def write_tools_in(messages: list[dict[str, Any]], functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that ignores tools (see the module docstring).

    ``messages`` are template dicts (``tool_calls`` arguments already parsed to objects);
    ``functions`` the OpenAI ``function`` objects of the tools (none: only the history is
    rewritten).
    """
    result: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            result.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif role == "assistant" and message.get("tool_calls"):
            content = message.get("content") or ""
            text = calls_text(message["tool_calls"])
            result.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        else:
            result.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
    if functions:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(f, ensure_ascii=False) for f in functions))
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": f"{result[0]['content']}\n\n{preamble}"}
        else:
            result.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{preamble}"})
    return result
