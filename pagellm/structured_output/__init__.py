"""Constrained decoding: grammars compiled once (llguidance), one matcher per sequence, and the
packed vocabulary mask each step applies before sampling."""
