"""Text workloads of ``pagellm bench latency``, rendered through the model's chat template:

* ``copy``: answers that rewrite their prompt (a code edit), where speculative decoding's n-gram
  lookup finds most of the answer in the prompt. Each request shows the same Python module and
  asks for it back with one name changed (a different name each request: no two prompts equal).
* ``chat``: open questions whose answers have little to copy from the prompt: what speculation
  must not slow down.
"""

from __future__ import annotations

from typing import Any

SOURCE = '''def merge_intervals(items):
    """Merge overlapping [start, end] intervals; returns them sorted by start."""
    if not items:
        return []
    ordered = sorted(items, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(items):
    """Length of the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(items))


def gaps(items, lower, upper):
    """The parts of [lower, upper] that no interval covers."""
    result = []
    cursor = lower
    for start, end in merge_intervals(items):
        if start > cursor:
            result.append([cursor, min(start, upper)])
        cursor = max(cursor, end)
    if cursor < upper:
        result.append([cursor, upper])
    return result
'''
NEW_NAMES = ("spans", "ranges", "segments", "pairs", "windows", "periods", "blocks", "chunks")


QUESTIONS = (
    "Why does the sky look blue during the day but red at sunset?",
    "Describe a walk through a city market early on a winter morning.",
    "What should someone think about before adopting a dog?",
    "Explain how a bicycle stays upright while it is moving.",
    "Write a short letter to a friend about a trip to the mountains.",
    "What are the main differences between a lake and a sea?",
    "Give advice to a student preparing for a first job interview.",
    "How do bees decide where to build a new hive?",
)


def _chat(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def copy_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` chat prompts (token ids) asking for ``SOURCE`` back with ``items`` renamed."""
    return [
        _chat(tokenizer, f"Here is a Python module:\n\n```python\n{SOURCE}```\n\nRewrite the whole module with the "
                         f"parameter `items` renamed to `{NEW_NAMES[i % len(NEW_NAMES)]}` everywhere. Reply with the "
                         "code only.")
        for i in range(count)
    ]  # fmt: skip


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` open questions (token ids), in turn."""
    return [_chat(tokenizer, QUESTIONS[i % len(QUESTIONS)]) for i in range(count)]


TEXT_WORKLOADS = {"copy": copy_prompts, "chat": chat_prompts}
