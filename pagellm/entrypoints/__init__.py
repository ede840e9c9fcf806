"""User-facing APIs: the offline ``LLM`` class, the CLI and the OpenAI-compatible server."""
