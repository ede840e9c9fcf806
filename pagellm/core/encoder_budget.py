"""How many images' encoder work one step takes on: the vision encoder runs inside the step, so
a step whose prefill chunks reach many images would stall every decode in it. The step's
encoder budget is counted in image rows (the encoder's output tokens), as the token budget
counts tokens: a chunk that would start an image past the budget ends before that image (the
next step takes it), except that every step may start at least one image, so a single image
larger than the budget still runs.
"""

from __future__ import annotations

from pagellm.core.sequence import Sequence


class EncoderBudget:
    """One step's image rows left to encode."""

    def __init__(self, rows: int) -> None:
        self.left = rows
        self.started_any = False

    def cut(self, seq: Sequence, start: int, num_new: int) -> int:
        """``num_new`` tokens from ``start``, cut before the first image the budget cannot take
        (0: not even its first; an image the chunk starts inside was encoded by an earlier step)."""
        for feature in seq.mm_features:  # (in prompt order)
            if not start <= feature.offset < start + num_new:
                continue
            if feature.num_embeds > self.left and self.started_any:
                return feature.offset - start
            self.left -= feature.num_embeds
            self.started_any = True
        return num_new
