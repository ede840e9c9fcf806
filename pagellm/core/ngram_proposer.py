"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens, in its prompt or its output so far.

Each sequence keeps an index per n from its n-grams to the position after their latest
occurrence, extended with the tokens added since its last proposal: a proposal costs a few
dictionary operations per new token, not a scan of the sequence (a Python scan of a 2,000-token
context costs about as much as a decode step of the default model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class _SequenceIndex:
    """For each n, n-gram -> the position after its latest occurrence ending before ``upto``."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.grams: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.upto = 0  # occurrences ending at positions < upto are indexed

    def extend(self, tokens: Sequence[int], end: int) -> None:
        """Index the occurrences ending at positions upto .. end - 1."""
        for n, grams in self.grams.items():
            for stop in range(max(self.upto, n), end):
                grams[tuple(tokens[stop - n : stop])] = stop
        self.upto = max(self.upto, end)


class NgramProposer:
    """Proposals for many sequences (``propose`` / ``remove`` by sequence id)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {n_min}, {n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self._indexes: dict[str, _SequenceIndex] = {}

    def propose(self, seq_id: str, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens to follow ``tokens`` (which only ever grow for one id), from the
        longest n whose last n tokens occurred before; [] when none did."""
        if limit <= 0:
            return []
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = _SequenceIndex(self.n_min, self.n_max)
        length = len(tokens)
        # Occurrences ending before the last position only: the suffix itself is no match.
        index.extend(tokens, length)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            stop = index.grams[n].get(tuple(tokens[length - n :]))
            if stop is not None and stop < length:
                return list(tokens[stop : min(stop + limit, length)])
        return []

    def remove(self, seq_ids: Iterable[str]) -> None:
        """Forget ended sequences."""
        for seq_id in seq_ids:
            self._indexes.pop(seq_id, None)
