"""The server's bounds on one request's size, declared once (``ServerSettings`` and the
``pagellm serve`` flags read them; the engine's own limits are ``LimitsConfig``)."""

from __future__ import annotations

# Bodies larger than this are refused with 413 before they are read whole (the longest prompt
# a model takes is far smaller; a hostile body must not make the server parse gigabytes).
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# The most prompts one /v1/completions request may hold: each becomes an engine request, so the
# list is bounded before any of them is tokenized (--max-prompts-per-request).
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
# The most JSON objects and arrays one request body may hold (messages, content parts, tools,
# schema nodes). The body is validated in one native call that holds the interpreter, so this
# bounds how long every other route waits: 65,536 one-line messages parse and validate in about
# 0.4 s on a 2-core machine; a million fit in the body limit and took 3-6 s.
MAX_BODY_CONTAINERS = 1 << 16
