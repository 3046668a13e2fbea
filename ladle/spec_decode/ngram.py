"""Prompt lookup (n-gram) drafting: find the context's latest earlier occurrence of its last few
tokens and propose what followed it then. Free to compute; it hits on text that repeats its
context (edits, quotes, code)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the context's last n tokens, for the
    longest n in [n_min, n_max] that matches; [] when none does."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram (not the suffix itself)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
