"""The OpenAI-compatible server (``pagellm serve``): protocol models, serving logic, routes."""
