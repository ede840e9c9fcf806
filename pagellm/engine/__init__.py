"""Text in, text out: tokenizing, driving steps, detokenizing and stop strings."""
