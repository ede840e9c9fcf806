"""The one id scheme of the engine's sequences: sequence ``k`` of request ``R`` is ``R#k``.

Every sequence the engine schedules belongs to one user request: a request's samples (``n``,
``best_of``: ``R#0`` ... ``R#{n-1}``, ``R#0`` alone when ``n`` is 1) and a beam search's beams
(numbered on as beams fork). The request a sequence belongs to is its id up to the last ``#``,
whatever ``R`` holds itself, so no map from sequences to requests is kept anywhere.
"""

from __future__ import annotations


def sequence_id(request_id: str, index: int) -> str:
    """The id of sequence ``index`` of ``request_id``."""
    return f"{request_id}#{index}"


def request_of(seq_id: str) -> str:
    """The request a sequence id belongs to (:func:`sequence_id` read backwards)."""
    request_id, sep, index = seq_id.rpartition("#")
    if not sep or not index.isdigit():
        raise ValueError(f"{seq_id!r} is not a sequence id (request#index)")
    return request_id
