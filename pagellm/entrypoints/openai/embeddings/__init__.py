"""OpenAI's embeddings API (``/v1/embeddings``): protocol models and serving."""
