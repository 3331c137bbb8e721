"""Draft tokens for speculative decoding by n-gram prompt lookup.

Text that repeats what came before (a quoted passage, code being edited, a list that follows a
pattern, a model stuck in a loop) continues as it continued last time. The draft is what
followed the latest earlier occurrence of the sequence's last n tokens with a whole draft after
it, trying the longest n first; the engine verifies the draft in one forward and keeps the part
the model itself would have produced (speculation.py).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram_drafts(
    token_ids: list[int], min_ngram: int, max_ngram: int, max_drafts: int
) -> list[int]:
    """At most `max_drafts` tokens that followed an earlier occurrence of the last n tokens,
    for the largest n in [min_ngram, max_ngram] that occurs; [] when none does."""
    length = len(token_ids)
    if max_drafts < 1 or length <= min_ngram:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Windows that start early enough to be followed by a token, the suffix itself excluded.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            # The latest occurrence followed by a whole draft; in a short loop (the latest is
            # right behind the suffix) the earliest, which has the most tokens after it.
            whole = matches[matches <= length - n - max_drafts]
            start = int(whole[-1] if whole.size else matches[0]) + n
            return tokens[start : start + max_drafts].tolist()
    return []
